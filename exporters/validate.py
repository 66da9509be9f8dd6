"""`dflash validate`: check an exported DFlash/DSpark draft, alone or against its target.

Every check is a small function that returns one `CheckResult`: a stable name, pass/fail, a one-line
detail and, on failure, a concrete fix. Checks never raise: a draft that is wrong in several ways gets
several failed checks, and a check that an earlier failure makes meaningless (nothing to inspect when
the IR does not read) fails with a detail starting "skipped:". Only a folder that cannot be read at all
(missing, or no `openvino_model.xml`) raises `InputError`.

What is checked is the contract of docs/draft-format.md. The JSON form of a report
(`ValidationReport.to_json`) is a stable schema for CI scripts:

    {"draft": str, "target": str | null, "ok": bool,
     "checks": [{"name": str, "passed": bool, "detail": str, "fix": str | null}, ...]}

Check names, in report order: ir_reads, per_row_layout, dflash_mode, mask_token_id, target_layer_ids,
hidden_states_width, hidden_size_matches_target (only with a target), block_size,
candidate_position_offset, markov_head, paged_attention (only with check_paged).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from dflash.core.draft_format import (
    DENSE_INPUTS,
    DENSE_OUTPUT,
    DRAFT_MODEL_FILE,
    MARKOV_HEAD_FILE,
    SUPPORTED_MARKOV_HEAD_TYPES,
    TOPK_INPUTS,
    TOPK_OUTPUT,
    draft_vocab_problem,
    read_rt_info,
)
from dflash.core.errors import DflashError, InputError
from dflash.core.hidden_states import RT_INFO_KEY as HIDDEN_STATES_RT_INFO_KEY
from dflash.exporters.staging import check_complete

TARGET_MODEL_FILE = "openvino_model.xml"
MARKOV_HEAD_INPUTS = (*DENSE_INPUTS, *TOPK_INPUTS)
MARKOV_HEAD_OUTPUTS = (DENSE_OUTPUT, TOPK_OUTPUT)

# The per-row backbone ports the engine feeds and reads (token_type_ids is checked on its own).
ROW_INPUTS = ("inputs_embeds", "hidden_states", "position_ids")
ROW_OUTPUT = "last_hidden_state"

REEXPORT_DRAFT = "re-export the draft checkpoint with `dflash export <draft-checkpoint> <output-dir>`"


# ---------------------------------------------------------------------------------------------
# Report


@dataclass
class CheckResult:
    """One check: `detail` says what was found (one line), `fix` what to do when it failed."""

    name: str
    passed: bool
    detail: str
    fix: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "detail": self.detail, "fix": self.fix}


@dataclass
class ValidationReport:
    """All checks of one draft folder (and the target it was checked against, if any)."""

    draft_dir: Path
    target_dir: Path | None
    checks: list[CheckResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every check passed."""
        return all(check.passed for check in self.checks)

    @property
    def failed(self) -> list[CheckResult]:
        return [check for check in self.checks if not check.passed]

    def check(self, name: str) -> CheckResult:
        """The check called `name`; KeyError when the report has none (e.g. a target-only check)."""
        for check in self.checks:
            if check.name == name:
                return check
        raise KeyError(name)

    def to_json(self) -> dict[str, Any]:
        """The stable JSON schema documented at the top of this module."""
        return {
            "draft": str(self.draft_dir),
            "target": str(self.target_dir) if self.target_dir is not None else None,
            "ok": self.ok,
            "checks": [check.to_json() for check in self.checks],
        }


def _passed(name: str, detail: str) -> CheckResult:
    return CheckResult(name, True, detail, None)


def _failed(name: str, detail: str, fix: str) -> CheckResult:
    return CheckResult(name, False, detail, fix)


def _skipped(name: str, reason: str, fix: str) -> CheckResult:
    return CheckResult(name, False, f"skipped: {reason}", fix)


# ---------------------------------------------------------------------------------------------
# What is read from the folders


@dataclass
class _Draft:
    folder: Path
    model: Any = None  # ov.Model, None when the IR does not read
    read_error: str | None = None
    config: dict[str, Any] = field(default_factory=dict)  # the draft's config.json, {} when absent

    def rt(self, *path: str) -> str | None:
        """An rt_info value as a string, None when absent (keys nest: "dflash", "mask_token_id")."""
        return read_rt_info(self.model, *path)

    def port_names(self, ports) -> set[str]:
        return {name for port in ports for name in port.get_names()}

    def last_dim(self, ports, name: str) -> int | None:
        """Static last dimension of the port called `name`, None when absent or dynamic."""
        for port in ports:
            if name in port.get_names():
                shape = port.get_partial_shape()
                if shape.rank.is_static and shape.rank.get_length() > 0 and shape[-1].is_static:
                    return shape[-1].get_length()
        return None


@dataclass
class _Target:
    folder: Path
    hidden_size: int | None
    vocab_size: int | None
    vocab_source: str  # where vocab_size came from, for messages
    layers: list[int] | None  # target layers the engine can read
    layers_source: str


def _read_draft(folder: Path) -> _Draft:
    import openvino as ov

    draft = _Draft(folder=folder)
    config_file = folder / "config.json"
    if config_file.is_file():
        try:
            loaded = json.loads(config_file.read_text())
            draft.config = loaded if isinstance(loaded, dict) else {}
        except (OSError, ValueError):
            draft.config = {}  # only the sliding-window check reads it; it says so when it matters
    try:
        draft.model = ov.Core().read_model(folder / DRAFT_MODEL_FILE)
    except Exception as exc:  # noqa: BLE001 - OpenVINO raises RuntimeError and others; all mean "does not read"
        draft.read_error = _error_line(exc)
    return draft


def _read_target(folder: Path) -> _Target:
    """Hidden size, vocabulary and readable layers of a target folder (exported, or a HF checkpoint)."""
    if not folder.is_dir():
        raise InputError(f"no target folder {folder}", hint="pass the exported target with --target")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise InputError(
            f"{folder} has no config.json", hint="pass the target folder that `dflash export` wrote"
        )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read {config_file}: {_error_line(exc)}", hint="fix or re-export the target") from exc
    # Multimodal targets keep the language model's sizes in text_config.
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    def size(key: str) -> int | None:
        value = config.get(key, text.get(key))
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    target = _Target(
        folder=folder,
        hidden_size=size("hidden_size"),
        vocab_size=size("vocab_size"),
        vocab_source="config.json vocab_size",
        layers=list(range(size("num_hidden_layers"))) if size("num_hidden_layers") else None,
        layers_source="config.json num_hidden_layers",
    )
    incomplete = check_complete(folder)
    if incomplete:
        raise InputError(f"the target is not a complete export: {incomplete}", hint="re-export the target")
    if (folder / TARGET_MODEL_FILE).is_file():
        _read_target_ir(folder / TARGET_MODEL_FILE, target)
    return target


def _read_target_ir(xml: Path, target: _Target) -> None:
    """Prefer what the exported target IR says: its logits width and its layer annotation."""
    import openvino as ov

    try:
        model = ov.Core().read_model(xml)
    except Exception as exc:  # noqa: BLE001
        raise InputError(f"cannot read the target IR {xml}: {_error_line(exc)}", hint="re-export the target") from exc
    for port in model.outputs:
        shape = port.get_partial_shape()
        if "logits" in port.get_names() and shape.rank.is_static and shape[-1].is_static:
            # The engine grafts this lm_head onto the draft, so its width is the vocabulary that counts.
            target.vocab_size = shape[-1].get_length()
            target.vocab_source = "the target's logits"
    text = read_rt_info(model, HIDDEN_STATES_RT_INFO_KEY)
    if text is not None:
        try:
            target.layers = sorted(int(key) for key in json.loads(text)["layers"])
            target.layers_source = "the target's hidden_states_decoder_layers annotation"
        except (ValueError, KeyError, TypeError):
            pass  # a malformed annotation: the engine locates layer outputs itself; keep config's depth


# ---------------------------------------------------------------------------------------------
# Parsing the draft's rt_info (shared by several checks)


class _Bad(ValueError):
    """An rt_info value that is missing or does not parse; its message is the check's detail."""


def _rt_int(draft: _Draft, key: str, default: int | None = None) -> int:
    text = draft.rt("dflash", key)
    if text is None:
        if default is not None:
            return default
        raise _Bad(f"rt_info dflash/{key} is missing")
    try:
        return int(text.strip())
    except ValueError:
        raise _Bad(f"rt_info dflash/{key} is {text!r}, not an integer") from None


def _rt_layer_ids(draft: _Draft) -> list[int]:
    text = draft.rt("dflash", "target_layer_ids")
    if text is None or not text.strip():
        raise _Bad("rt_info dflash/target_layer_ids is missing")
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise _Bad(f"rt_info dflash/target_layer_ids is {text!r}, not comma-separated integers") from None


def _draft_hidden_size(draft: _Draft) -> int | None:
    """H of the draft: the width of inputs_embeds, else of last_hidden_state."""
    return draft.last_dim(draft.model.inputs, "inputs_embeds") or draft.last_dim(draft.model.outputs, ROW_OUTPUT)


# ---------------------------------------------------------------------------------------------
# The checks, in report order


def check_per_row_layout(draft: _Draft) -> CheckResult:
    name = "per_row_layout"
    inputs = draft.port_names(draft.model.inputs)
    outputs = draft.port_names(draft.model.outputs)
    missing = [port for port in ROW_INPUTS if port not in inputs] + (
        [ROW_OUTPUT] if ROW_OUTPUT not in outputs else []
    )
    if missing:
        return _failed(
            name,
            f"not a DFlash draft backbone: no {', '.join(missing)} port",
            f"pass a draft exported with `dflash export`, or {REEXPORT_DRAFT}",
        )
    if "token_type_ids" not in inputs:
        return _failed(
            name,
            "no token_type_ids input: the draft was exported for the old stateful SDPA runner "
            "(optimum-intel <= 2.2 / OpenVINO GenAI 2026.4), which cannot run on PagedAttention",
            f"{REEXPORT_DRAFT}; it writes the per-row layout",
        )
    return _passed(name, "per-row layout: inputs_embeds, hidden_states, position_ids, token_type_ids")


def check_dflash_mode(draft: _Draft) -> CheckResult:
    name = "dflash_mode"
    value = draft.rt("dflash_mode")
    if value == "True":
        return _passed(name, 'rt_info dflash_mode is "True"')
    found = "missing" if value is None else repr(value)
    return _failed(name, f'rt_info dflash_mode is {found}, expected "True"', REEXPORT_DRAFT)


def check_mask_token_id(draft: _Draft, target: _Target | None) -> CheckResult:
    name = "mask_token_id"
    try:
        mask = _rt_int(draft, "mask_token_id")
    except _Bad as bad:
        return _failed(name, str(bad), REEXPORT_DRAFT)
    if mask < 0:
        return _failed(name, f"mask_token_id {mask} is negative", REEXPORT_DRAFT)
    if target is None or target.vocab_size is None:
        return _passed(name, f"mask_token_id {mask}")
    if mask >= target.vocab_size:
        return _failed(
            name,
            f"mask_token_id {mask} is outside the target vocabulary ({target.vocab_size} from {target.vocab_source})",
            "validate against the target the draft was trained for, or fix mask_token_id in the draft "
            f"checkpoint's config.json and {REEXPORT_DRAFT}",
        )
    return _passed(name, f"mask_token_id {mask}, inside the target vocabulary of {target.vocab_size}")


def check_target_layer_ids(draft: _Draft, target: _Target | None) -> CheckResult:
    name = "target_layer_ids"
    fix_ids = f"fix target_layer_ids in the draft checkpoint's config.json and {REEXPORT_DRAFT}"
    try:
        ids = _rt_layer_ids(draft)
    except _Bad as bad:
        return _failed(name, str(bad), REEXPORT_DRAFT)
    shown = ",".join(map(str, ids))
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        return _failed(name, f"target_layer_ids {shown} repeat layer {', '.join(map(str, duplicates))}", fix_ids)
    negative = [i for i in ids if i < 0]
    if negative:
        return _failed(name, f"target_layer_ids {shown} include negative layer {negative[0]}", fix_ids)
    if target is None or target.layers is None:
        return _passed(name, f"target_layer_ids {shown}")
    outside = [i for i in ids if i not in set(target.layers)]
    if outside:
        return _failed(
            name,
            f"target layer {outside[0]} does not exist: the target has layers "
            f"{_span(target.layers)} ({target.layers_source})",
            "validate against the target the draft was trained for (its depth must cover every "
            "target_layer_ids entry)",
        )
    return _passed(name, f"target_layer_ids {shown}, all inside the target's layers {_span(target.layers)}")


def check_hidden_states_width(draft: _Draft, target: _Target | None) -> CheckResult:
    name = "hidden_states_width"
    try:
        k = len(_rt_layer_ids(draft))
    except _Bad:
        return _skipped(name, "target_layer_ids do not parse (see target_layer_ids)", REEXPORT_DRAFT)
    width = draft.last_dim(draft.model.inputs, "hidden_states")
    if width is None:
        return _failed(name, "the hidden_states input has no static width", REEXPORT_DRAFT)
    if target is not None and target.hidden_size is not None:
        expected, of_what = k * target.hidden_size, f"{k} layers x target hidden size {target.hidden_size}"
    else:
        hidden = _draft_hidden_size(draft)
        if width % k:
            return _failed(
                name,
                f"hidden_states is {width} wide, not a multiple of the {k} target_layer_ids",
                f"the rt_info and the graph disagree; {REEXPORT_DRAFT}",
            )
        if hidden is None:
            return _passed(name, f"hidden_states is {width} wide = {k} layers x {width // k}")
        expected, of_what = k * hidden, f"{k} layers x draft hidden size {hidden}"
    if width != expected:
        return _failed(
            name,
            f"hidden_states is {width} wide, expected {expected} ({of_what})",
            "the target_layer_ids or the target do not match the draft's fc layer; validate against the "
            f"target the draft was trained for, or {REEXPORT_DRAFT}",
        )
    return _passed(name, f"hidden_states is {width} wide = {of_what}")


def check_hidden_size_matches_target(draft: _Draft, target: _Target) -> CheckResult:
    name = "hidden_size_matches_target"
    embeds = draft.last_dim(draft.model.inputs, "inputs_embeds")
    output = draft.last_dim(draft.model.outputs, ROW_OUTPUT)
    if embeds is None or output is None:
        return _failed(name, "inputs_embeds or last_hidden_state has no static width", REEXPORT_DRAFT)
    if embeds != output:
        return _failed(name, f"inputs_embeds is {embeds} wide but last_hidden_state {output}", REEXPORT_DRAFT)
    if target.hidden_size is None:
        return _failed(
            name, "the target's config.json has no hidden_size", "pass the target folder that `dflash export` wrote"
        )
    if embeds != target.hidden_size:
        return _failed(
            name,
            f"draft hidden size {embeds} differs from the target's {target.hidden_size}: the target's "
            "embedding and lm_head cannot be grafted onto it",
            "validate against (and run with) the target the draft was trained for",
        )
    return _passed(name, f"hidden size {embeds}, as the target's (embedding and lm_head graft fit)")


def check_draft_block_size(draft: _Draft) -> CheckResult:
    name = "block_size"
    try:
        block = _rt_int(draft, "block_size")  # the rt_info key (z-lab's config.json name)
    except _Bad as bad:
        return _failed(name, str(bad), REEXPORT_DRAFT)
    if block < 2:
        return _failed(
            name,
            f"block_size {block}: a block needs the seed/anchor row and at least one more",
            f"fix block_size in the draft checkpoint's config.json and {REEXPORT_DRAFT}",
        )
    return _passed(name, f"block_size {block}")


def check_candidate_position_offset(draft: _Draft) -> CheckResult:
    name = "candidate_position_offset"
    if draft.rt("dflash", "candidate_position_offset") is None:
        # Drafts written before the key existed were all z-lab DFlash drafts; runtimes default to 1.
        return _passed(name, "candidate_position_offset absent: 1 assumed (z-lab DFlash, row 0 is the seed)")
    try:
        offset = _rt_int(draft, "candidate_position_offset")
    except _Bad as bad:
        return _failed(name, str(bad), REEXPORT_DRAFT)
    if offset not in (0, 1):
        return _failed(
            name,
            f"candidate_position_offset {offset}, expected 0 (DSpark: the anchor row predicts) or 1 (DFlash)",
            REEXPORT_DRAFT,
        )
    meaning = "z-lab DFlash, row 0 is the seed" if offset == 1 else "DSpark, the anchor row predicts"
    return _passed(name, f"candidate_position_offset {offset} ({meaning})")


def check_draft_vocab(draft: _Draft, target: _Target | None) -> CheckResult:
    name = "draft_vocab"
    text = draft.rt("dflash", "draft_vocab")
    if text is None:
        return _passed(name, "no draft vocabulary: the draft proposes from the whole target vocabulary")
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        return _failed(name, "rt_info dflash/draft_vocab is not comma-separated integers", REEXPORT_DRAFT)
    problem = draft_vocab_problem(ids, target.vocab_size if target is not None else None)
    if problem is not None:
        return _failed(name, problem, f"validate against the target the draft was trained for, or {REEXPORT_DRAFT}")
    return _passed(name, f"draft vocabulary of {len(ids)} tokens (its lm_head covers only these)")


def check_markov_head(draft: _Draft, target: _Target | None) -> CheckResult:
    name = "markov_head"
    head_file = draft.folder / MARKOV_HEAD_FILE
    try:
        rank = _rt_int(draft, "markov_rank", default=0)
    except _Bad as bad:
        return _failed(name, str(bad), REEXPORT_DRAFT)
    if rank < 0:
        return _failed(name, f"markov_rank {rank} is negative", REEXPORT_DRAFT)
    if rank == 0:
        return _passed(name, "no Markov head (markov_rank 0)")

    head_type = draft.rt("dflash", "markov_head_type")
    if head_type not in SUPPORTED_MARKOV_HEAD_TYPES:
        found = "missing" if head_type is None else repr(head_type)
        return _failed(
            name,
            f"dflash/markov_head_type is {found}; only the vanilla Markov head is supported",
            "use a DSpark draft with markov_head_type 'vanilla' (or one without a Markov head)",
        )
    if not head_file.is_file():
        return _failed(
            name,
            f"markov_rank {rank} but {MARKOV_HEAD_FILE} is missing",
            f"copy {MARKOV_HEAD_FILE} (and its .bin) from the export folder, or {REEXPORT_DRAFT}",
        )
    problems = _markov_head_problems(head_file, rank, target)
    if problems:
        return _failed(name, "; ".join(problems), REEXPORT_DRAFT)
    vocab = f", vocabulary {target.vocab_size} as the target's" if target is not None and target.vocab_size else ""
    return _passed(name, f"vanilla Markov head, rank {rank}{vocab}")


def _markov_head_problems(head_file: Path, rank: int, target: _Target | None) -> list[str]:
    """Everything wrong with the head IR: ports, type, and W1/W2 shapes against rank and vocabulary."""
    import openvino as ov

    try:
        head = ov.Core().read_model(head_file)
    except Exception as exc:  # noqa: BLE001
        return [f"{MARKOV_HEAD_FILE} does not read: {_error_line(exc)}"]

    def rt(key: str) -> str | None:
        return read_rt_info(head, "markov_head", key)

    problems = []
    inputs = {n for port in head.inputs for n in port.get_names()}
    outputs = {n for port in head.outputs for n in port.get_names()}
    missing = [n for n in MARKOV_HEAD_INPUTS if n not in inputs] + [n for n in MARKOV_HEAD_OUTPUTS if n not in outputs]
    if missing:
        problems.append(f"the head has no {', '.join(missing)} port")
    if rt("type") not in SUPPORTED_MARKOV_HEAD_TYPES:
        problems.append(f"the head's rt_info markov_head/type is {rt('type')!r}, not 'vanilla'")

    # The head's vocabulary is the width of its dense output; its rank the other side of W1/W2.
    vocab = None
    for port in head.outputs:
        shape = port.get_partial_shape()
        if "markov_bias" in port.get_names() and shape.rank.is_static and shape[-1].is_static:
            vocab = shape[-1].get_length()
    if vocab is None and rt("vocab_size") is not None and rt("vocab_size").isdigit():
        vocab = int(rt("vocab_size"))
    if vocab is None:
        return problems + ["cannot tell the head's vocabulary (markov_bias has no static width)"]
    weight_ranks = sorted(
        {
            dims[1] if dims[0] == vocab else dims[0]
            for op in head.get_ops()
            if op.get_type_name() == "Constant"
            for dims in [list(op.get_output_shape(0))]
            if len(dims) == 2 and vocab in dims
        }
    )
    if not weight_ranks:
        problems.append(f"no [{vocab}, r] weight in the head")
    elif weight_ranks != [rank]:
        problems.append(f"the head's W1/W2 have rank {'/'.join(map(str, weight_ranks))}, but markov_rank is {rank}")
    if rt("rank") is not None and rt("rank") != str(rank):
        problems.append(f"the head's rt_info markov_head/rank is {rt('rank')}, but markov_rank is {rank}")
    if target is not None and target.vocab_size is not None and vocab != target.vocab_size:
        problems.append(
            f"the head's vocabulary {vocab} differs from the target's {target.vocab_size} ({target.vocab_source})"
        )
    return problems


def check_paged_attention(draft: _Draft) -> CheckResult:
    """Convert a copy of the draft to PagedAttention, as the engine does, and inspect every PA op."""
    from dflash.core.paged import to_paged_attention

    name = "paged_attention"
    try:
        info = to_paged_attention(draft.model.clone())
    except DflashError as err:
        return _failed(name, err.message, err.hint or REEXPORT_DRAFT)
    except RuntimeError as exc:  # an OpenVINO graph error the conversion did not anticipate
        return _failed(name, f"PagedAttention conversion failed: {_error_line(exc)}", REEXPORT_DRAFT)
    unwired = [i for i, wired in enumerate(info.token_type_ids_wired) if not wired]
    if unwired:
        return _failed(
            name,
            f"token_type_ids reaches {info.num_layers - len(unwired)} of {info.num_layers} PagedAttention ops "
            f"(not layer {', '.join(map(str, unwired))}): those layers would attend causally inside the block",
            f"the attention masks must be built from token_type_ids in every layer; {REEXPORT_DRAFT}",
        )
    window_problem = _sliding_window_problem(draft.config, info.sliding_windows)
    if window_problem:
        return _failed(
            name,
            window_problem,
            f"the sliding layers' masks must match OpenVINO's sliding-window pattern; {REEXPORT_DRAFT}",
        )
    windows = sorted({w for w in info.sliding_windows if w})
    sliding = f", sliding window {'/'.join(map(str, windows))} kept" if windows else ""
    return _passed(name, f"{info.num_layers} PagedAttention ops, token_type_ids wired into all{sliding}")


def _sliding_window_problem(config: dict[str, Any], windows: list[int]) -> str | None:
    """Compare PA input 10 of each layer with config.json's layer_types / sliding_window."""
    layer_types = config.get("layer_types")
    if not isinstance(layer_types, list) or "sliding_attention" not in layer_types:
        wrong = [i for i, w in enumerate(windows) if w]
        if wrong:
            return f"layer {wrong[0]} has sliding window {windows[wrong[0]]}, but config.json declares no sliding layer"
        return None
    window = config.get("sliding_window")
    if len(layer_types) != len(windows):
        return f"config.json lists {len(layer_types)} layer_types, the draft has {len(windows)} attention layers"
    for i, (kind, got) in enumerate(zip(layer_types, windows)):
        want = window if kind == "sliding_attention" else 0
        if got != want:
            return f"layer {i} ({kind}) has PagedAttention sliding window {got}, config.json says {want or 'none'}"
    return None


# ---------------------------------------------------------------------------------------------
# Entry point


def validate_draft(
    draft_dir: str | Path,
    target_dir: str | Path | None = None,
    *,
    check_paged: bool = True,
) -> ValidationReport:
    """Check the exported draft in `draft_dir` (against the target in `target_dir`, if given).

    Raises InputError only when `draft_dir` is missing or has no openvino_model.xml, or the target
    folder cannot be read; every problem of the draft itself is a failed check in the report.
    `check_paged=False` skips the PagedAttention conversion (the slowest check).
    """
    draft_dir = Path(draft_dir)
    _require_draft_folder(draft_dir)
    target = _read_target(Path(target_dir)) if target_dir is not None else None
    report = ValidationReport(draft_dir=draft_dir, target_dir=Path(target_dir) if target_dir is not None else None)

    draft = _read_draft(draft_dir)
    steps: list[tuple[str, Callable[[], CheckResult]]] = [
        ("per_row_layout", lambda: check_per_row_layout(draft)),
        ("dflash_mode", lambda: check_dflash_mode(draft)),
        ("mask_token_id", lambda: check_mask_token_id(draft, target)),
        ("target_layer_ids", lambda: check_target_layer_ids(draft, target)),
        ("hidden_states_width", lambda: check_hidden_states_width(draft, target)),
    ]
    if target is not None:
        steps.append(("hidden_size_matches_target", lambda: check_hidden_size_matches_target(draft, target)))
    steps += [
        ("block_size", lambda: check_draft_block_size(draft)),
        ("candidate_position_offset", lambda: check_candidate_position_offset(draft)),
        ("markov_head", lambda: check_markov_head(draft, target)),
        ("draft_vocab", lambda: check_draft_vocab(draft, target)),
    ]
    if check_paged:
        steps.append(("paged_attention", lambda: _paged_step(draft, report)))

    # A staging folder, or a folder whose files differ from what its export wrote (truncated weights,
    # a missing file), fails here: OpenVINO may read a truncated .bin and fail only when it compiles.
    incomplete = check_complete(draft_dir)
    if draft.model is None or incomplete:
        detail = incomplete or f"{DRAFT_MODEL_FILE} does not read: {draft.read_error}"
        report.checks.append(
            _failed("ir_reads", detail, f"the .xml/.bin pair is damaged or incomplete; copy it again or {REEXPORT_DRAFT}")
        )
        report.checks += [_skipped(name, "the export is not complete (see ir_reads)", REEXPORT_DRAFT) for name, _ in steps]
        return report
    report.checks.append(_passed("ir_reads", f"{DRAFT_MODEL_FILE} reads ({len(draft.model.get_ops())} ops)"))
    for _, run in steps:
        report.checks.append(run())
    return report


def _paged_step(draft: _Draft, report: ValidationReport) -> CheckResult:
    # The conversion needs the per-row layout; on the old layout it fails for that known reason.
    if not report.check("per_row_layout").passed:
        return _skipped("paged_attention", "the draft lacks the per-row layout (see per_row_layout)", REEXPORT_DRAFT)
    return check_paged_attention(draft)


def _require_draft_folder(draft_dir: Path) -> None:
    if not draft_dir.exists():
        raise InputError(f"no folder {draft_dir}", hint="pass the draft folder that `dflash export` wrote")
    if not draft_dir.is_dir():
        raise InputError(f"{draft_dir} is not a folder", hint="pass the draft folder, not a file in it")
    if not (draft_dir / DRAFT_MODEL_FILE).is_file():
        hint = "pass the draft folder that `dflash export` wrote"
        if (draft_dir / "config.json").is_file():
            hint = f"this looks like a checkpoint, not an export: run `dflash export {draft_dir} <output-dir>` first"
        raise InputError(f"{draft_dir} has no {DRAFT_MODEL_FILE}", hint=hint)


def _span(layers: list[int]) -> str:
    if layers and layers == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}..{layers[-1]}"
    return ",".join(map(str, layers))


def _error_line(exc: BaseException) -> str:
    """One line of an exception: OpenVINO puts source locations first and the reason last."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__
