"""The option vocabulary shared by commands, as `Annotated` aliases."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from dflash.core.config import DEFAULT_KV_CACHE_GIB  # noqa: F401 - the default of --kv-cache-size


class DraftKind(str, Enum):
    """The two draft families: z-lab DFlash and DeepSpec DSpark."""

    dflash = "dflash"
    dspark = "dspark"


class AssistantSchedule(str, Enum):
    """How many candidates a request drafts per step: the same every step, transformers' heuristic, or
    the candidates whose measured acceptance pays for their measured cost (core/adaptive.py)."""

    constant = "constant"
    heuristic = "heuristic"
    adaptive = "adaptive"


class DraftProposals(str, Enum):
    """How the draft proposes for sampling requests (core.config.EngineConfig.draft_proposals)."""

    argmax = "argmax"
    sampled = "sampled"


class WeightFormat(str, Enum):
    fp32 = "fp32"
    fp16 = "fp16"
    int8 = "int8"
    int4 = "int4"


JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout and nothing else.")]
QuietOpt = Annotated[
    bool, typer.Option("--quiet", "-q", help="No progress or informational messages on stderr.")
]
DebugOpt = Annotated[
    bool,
    typer.Option("--debug", help="Show the full traceback on errors (same as DFLASH_DEBUG=1)."),
]
WeightFormatOpt = Annotated[
    WeightFormat,
    typer.Option("--weight-format", help="Weight precision of the exported model (int8/int4 through NNCF)."),
]
DraftVocabSizeOpt = Annotated[
    Optional[int],
    typer.Option(
        "--draft-vocab-size",
        min=0,
        help="Tokens the draft may propose: the N the target emits most often, by the checkpoint's draft_vocab.json "
        "(a smaller lm_head: cheaper draft rows, output unchanged). Default: the number that file gives; 0: the whole vocabulary.",
        show_default=False,
    ),
]
DraftWeightFormatOpt = Annotated[
    Optional[WeightFormat],
    typer.Option(
        "--draft-weight-format",
        help="Weight precision of the draft; defaults to --weight-format.",
        show_default=False,
    ),
]
TrustRemoteCodeOpt = Annotated[
    bool,
    typer.Option("--trust-remote-code", help="Allow custom modelling code from the checkpoint's repository."),
]
ExistingDir = Annotated[
    Path,
    typer.Argument(exists=True, file_okay=False, dir_okay=True, readable=True, resolve_path=True),
]


# ---- the models (generate, bench) ----------------------------------------------------------------------

DEFAULT_PAIR_HELP = "Without TARGET_DIR: the embedded SmolLM2-135M-Instruct pair, exported on first use."
DraftOpt = Annotated[
    Optional[Path],
    typer.Option("--draft", help="An exported DFlash/DSpark draft: speculative decoding beside the target.", show_default=False),
]
DefaultDraftOpt = Annotated[
    DraftKind, typer.Option("--default-draft", help="Without TARGET_DIR: which trained default draft runs beside SmolLM2 "
                            "(DSpark: its Markov head accepts more at the same number of candidates).")
]
SCHEDULE_HELP = (
    "adaptive: per request, the candidates whose measured acceptance pays for the measured cost of drafting "
    "(none if nothing pays); constant: always --num-assistant-tokens; heuristic: +2 candidates after a step "
    "that accepted them all, -1 otherwise."
)
MarkovTopKHelp = "DSpark drafts: 0 the dense Markov walk (exact; what dflash export asks for), K > 0 a Top-K lattice of each row's K best tokens (accepts less); default: the export's choice."
ChatOpt = Annotated[
    Optional[bool],
    typer.Option("--chat/--no-chat", help="Apply the tokenizer's chat template (default: when it has one).", show_default=False),
]

# ---- the engine (generate, bench): one EngineConfig from them, engine_config() below ----------------------

DeviceOpt = Annotated[str, typer.Option("--device", help="OpenVINO device (CPU, GPU, ...).")]
KvCacheSizeOpt = Annotated[float, typer.Option("--kv-cache-size", min=0.001, help="The target's KV cache in GiB.")]
DraftKvCacheSizeOpt = Annotated[
    Optional[float],
    typer.Option("--draft-kv-cache-size", min=0.001, help="The draft's KV cache in GiB.", show_default="as --kv-cache-size"),
]
StateBlocksOpt = Annotated[
    Optional[int],
    typer.Option(
        "--state-blocks",
        min=1,
        help="Hybrid (Qwen3.5) targets: linear-attention state blocks, one per running request plus one per "
        "verified row.",
        show_default="room for every running request to verify",
    ),
]
MaxNumBatchedTokensOpt = Annotated[int, typer.Option("--max-num-batched-tokens", min=1, help="Token budget of one engine step.")]
PrefixCachingOpt = Annotated[
    Optional[bool],
    typer.Option(
        "--prefix-caching/--no-prefix-caching",
        help="Reuse the KV of shared prompt prefixes (not supported for hybrid linear-attention targets yet).",
        show_default="on; off for hybrid targets",
    ),
]
ScheduleMemoryOpt = Annotated[
    bool,
    typer.Option(
        "--schedule-memory/--no-schedule-memory",
        help="Keep what the adaptive schedule measured of this machine's steps in the user cache folder: "
        "the next run prices drafting from its first step instead of exploring.",
    ),
]
DynamicSplitFuseOpt = Annotated[
    bool, typer.Option("--dynamic-split-fuse/--no-dynamic-split-fuse", help="Mix prompt chunks and generation rows in one step.")
]
DraftProposalsOpt = Annotated[
    DraftProposals,
    typer.Option(
        "--draft-proposals",
        help="Under sampling (--temperature > 0): argmax proposes the draft's deterministic candidates, sampled draws "
        "them from its distributions. Both are verified by speculative sampling (output distributed as the target's own).",
    ),
]
OvConfigOpt = Annotated[
    Optional[list[str]],
    typer.Option(
        "--ov-config",
        help="An OpenVINO property KEY=VALUE (repeatable), e.g. INFERENCE_PRECISION_HINT=f32 for exact parity.",
        show_default=False,
    ),
]


def engine_config(*, device: str, ov_config: list[str] | None, kv_cache_size: float,
                  draft_kv_cache_size: float | None, max_num_batched_tokens: int, max_num_seqs: int,
                  prefix_caching: bool | None = None, dynamic_split_fuse: bool = True, markov_top_k: int | None = None,
                  draft_proposals: str = "argmax", state_blocks: int | None = None, schedule_memory: bool = False):  # fmt: skip
    """The EngineConfig of the engine options (a malformed --ov-config is a usage error, exit 2).
    schedule_memory: keep the adaptive schedule's measurements in the user cache folder."""
    from dflash.core.config import EngineConfig
    from dflash.exporters.default_pair import cache_dir

    return EngineConfig(
        device=device,
        ov_config=parse_ov_config(ov_config),
        kv_cache_size_gib=kv_cache_size,
        draft_kv_cache_size_gib=draft_kv_cache_size,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=prefix_caching,
        dynamic_split_fuse=dynamic_split_fuse,
        markov_head_top_k=markov_top_k,
        draft_proposals=draft_proposals,
        num_state_blocks=state_blocks,
        schedule_memory=str(cache_dir() / "schedule") if schedule_memory else None,
    )


# ---- sampling (generate, bench): the fields of core.config.SamplingParams -------------------------------

TemperatureOpt = Annotated[
    float,
    typer.Option("--temperature", min=0.0, help="0: greedy; above 0: sample at this temperature."),
]
TopPOpt = Annotated[
    float, typer.Option("--top-p", min=0.01, max=1.0, help="Sample from the smallest set of tokens holding this probability mass.")
]
TopKOpt = Annotated[int, typer.Option("--top-k", min=0, help="Sample among the K most likely tokens (0: all).")]
SeedOpt = Annotated[
    Optional[int], typer.Option("--seed", help="Seed of sampling, for repeatable samples.", show_default="a fresh seed")
]


def sampling_params(*, temperature: float, top_p: float, top_k: int, seed: int | None, **fields):
    """The SamplingParams of the sampling options, with any other fields (max_new_tokens, ...)."""
    from dflash.core.config import SamplingParams

    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, **fields)


def parse_ov_config(items: list[str] | None) -> dict[str, str]:
    """KEY=VALUE strings to a properties dict; a malformed item is a usage error (exit 2)."""
    config = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise typer.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--ov-config")
        config[key.strip()] = value.strip()
    return config
