"""`dflash validate`'s library: every check passes on good drafts and each planted defect fails
exactly the check meant to catch it, on real OpenVINO IRs of tiny models.

The good drafts and the target are exported once per module; each defect is a copied folder with one
thing changed (an rt_info value, the Markov head file, the graph, config.json), so nothing is
re-exported per test. The old-layout draft comes from optimum-intel 2.2.0's own DFlash export.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openvino as ov
import pytest
import torch
from openvino import opset13

from dflash.core.errors import InputError
from dflash.exporters import draft as draft_exporter
from dflash.exporters import markov_head as markov_exporter
from dflash.exporters import validate as validate_module
from dflash.exporters.draft import export_draft
from dflash.exporters.draft_checkpoint import make_tiny_draft
from dflash.exporters.markov_head import MarkovHead, save_markov_head
from dflash.exporters.tiny import make_tiny_target
from dflash.exporters.validate import CheckResult, ValidationReport, validate_draft

XML = "openvino_model.xml"
HEAD_XML = "openvino_markov_head_model.xml"
ALL_CHECKS = [
    "ir_reads",
    "per_row_layout",
    "dflash_mode",
    "mask_token_id",
    "target_layer_ids",
    "hidden_states_width",
    "hidden_size_matches_target",
    "block_size",
    "candidate_position_offset",
    "markov_head",
    "draft_vocab",
    "paged_attention",
]
MARKOV_RANK = 8
SLIDING_WINDOW = 4


# --------------------------------------------------------------------------------------------------
# Models, built once per module


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("validate")


@pytest.fixture(scope="module")
def target_src(tiny_target_src) -> Path:
    """The tiny qwen3 checkpoint: 4 layers, hidden 64, vocabulary 512 (conftest.py)."""
    return tiny_target_src


@pytest.fixture(scope="module")
def target(tiny_target_fp16) -> Path:
    return tiny_target_fp16


@pytest.fixture(scope="module")
def dflash_draft(root, target_src) -> Path:
    """A z-lab DFlash draft with a sliding-window layer 0 and a full-attention layer 1."""
    checkpoint = make_tiny_draft(
        root / "dflash_ckpt",
        target_src,
        kind="dflash",
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=SLIDING_WINDOW,
    )
    return export_draft(checkpoint, root / "dflash", weight_format="fp16")


@pytest.fixture(scope="module")
def dspark_draft(root, target_src) -> Path:
    """A DSpark draft with a vanilla Markov head, int8 backbone weights."""
    checkpoint = make_tiny_draft(root / "dspark_ckpt", target_src, kind="dspark", markov_rank=MARKOV_RANK)
    return export_draft(checkpoint, root / "dspark", weight_format="int8")


@pytest.fixture(scope="module")
def old_layout_draft(root, target_src) -> Path:
    """A draft exported by optimum-intel 2.2.0's own DFlash path: no token_type_ids, no block_size.

    `optimum-cli --trust-remote-code` cannot do this here (transformers' check_imports demands
    diffusers/einops for optimum's model_patcher.py), so the model class is subclassed outside
    `optimum.*` and exported with `export_from_model`, the workaround the export notes describe.
    """
    from optimum.exporters.openvino import export_from_model
    from optimum.exporters.openvino.model_patcher import Qwen3DFlashForCausalLM

    class OldDFlashDraft(Qwen3DFlashForCausalLM):
        pass

    checkpoint = make_tiny_draft(root / "old_ckpt", target_src, kind="dflash")
    model = OldDFlashDraft.from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = root / "old_layout"
    export_from_model(model, out, task="text-generation-with-past")
    return out


def _names(report: ValidationReport) -> list[str]:
    return [check.name for check in report.checks]


def _failed(report: ValidationReport) -> set[str]:
    return {check.name for check in report.failed}


# --------------------------------------------------------------------------------------------------
# Defects: copies of a good draft with one thing changed


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_backbone(src: Path, dst: Path, edit) -> Path:
    """Copy `src` to `dst`, apply `edit(model)` to the backbone read from `src`, save it in `dst`.

    Reading from the source and writing the copy keeps the weights file being written from also
    being the memory-mapped one being read.
    """
    _copy(src, dst)
    model = ov.Core().read_model(src / XML)
    edit(model)
    ov.save_model(model, dst / XML, compress_to_fp16=False)
    return dst


def _with_rt_info(src: Path, dst: Path, **values: str) -> Path:
    def edit(model):
        for key, value in values.items():
            path = [key] if key == "dflash_mode" else ["dflash", key]
            model.set_rt_info(value, path)

    return _rewrite_backbone(src, dst, edit)


def _masks_without_token_type_ids(model: ov.Model) -> None:
    """Feed every user of token_type_ids an all-ones tensor instead: the input stays, but no mask
    depends on it any more, as in a draft whose attention ignores the row types."""
    param = next(p for p in model.get_parameters() if "token_type_ids" in p.output(0).get_names())
    positions = next(p for p in model.get_parameters() if "position_ids" in p.output(0).get_names())
    ones = opset13.broadcast(opset13.constant(1, ov.Type.i64), opset13.shape_of(positions))
    for consumer in list(param.output(0).get_target_inputs()):
        consumer.replace_source_output(ones.output(0))
    model.validate_nodes_and_infer_types()


# name -> (good draft fixture, rt_info values written into the copy, the one check that fails,
#          a fragment of its detail). Each copy is validated against the exported target.
RT_DEFECTS = {
    "not_dflash_mode": ("dflash_draft", dict(dflash_mode="False"), "dflash_mode", "'False'"),
    "mask_beyond_vocab": ("dflash_draft", dict(mask_token_id="600"), "mask_token_id", "(512 from the target's logits)"),
    "mask_not_int": ("dflash_draft", dict(mask_token_id="mask"), "mask_token_id", "not an integer"),
    "duplicate_layers": ("dflash_draft", dict(target_layer_ids="2,2"), "target_layer_ids", "repeat layer 2"),
    "negative_layer": ("dflash_draft", dict(target_layer_ids="-1,2"), "target_layer_ids", "negative layer -1"),
    "layer_beyond_depth": (
        "dflash_draft", dict(target_layer_ids="0,7"), "target_layer_ids", "layers 0..3 (the target's hidden_states"
    ),
    "layer_count_vs_width": ("dflash_draft", dict(target_layer_ids="0,1,2"), "hidden_states_width", "expected 192"),
    "block_size_1": ("dflash_draft", dict(block_size="1"), "block_size", "block_size 1"),
    "offset_2": ("dflash_draft", dict(candidate_position_offset="2"), "candidate_position_offset", "offset 2"),
    "unsupported_head_type": ("dspark_draft", dict(markov_head_type="gated"), "markov_head", "'gated'"),
    "rank_vs_head": ("dspark_draft", dict(markov_rank="4"), "markov_head", "rank 8, but markov_rank is 4"),
}


# --------------------------------------------------------------------------------------------------
# Good drafts


@pytest.mark.parametrize("which", ["dflash_draft", "dspark_draft"])
def test_good_draft_passes_every_check_against_its_target(request, which, target):
    draft = request.getfixturevalue(which)
    report = validate_draft(draft, target)

    assert _names(report) == ALL_CHECKS
    assert report.ok, [(c.name, c.detail) for c in report.failed]
    assert all(check.fix is None for check in report.checks)
    markov = report.check("markov_head").detail
    if which == "dspark_draft":
        assert f"rank {MARKOV_RANK}" in markov and "512" in markov
        assert report.check("candidate_position_offset").detail.startswith("candidate_position_offset 0")
    else:
        assert markov == "no Markov head (markov_rank 0)"
        # The sliding layer kept its window through the PagedAttention conversion.
        assert f"sliding window {SLIDING_WINDOW}" in report.check("paged_attention").detail


def test_good_draft_without_target_skips_only_the_target_comparison(dspark_draft):
    report = validate_draft(dspark_draft)

    assert report.ok
    assert report.target_dir is None
    assert _names(report) == [name for name in ALL_CHECKS if name != "hidden_size_matches_target"]
    assert "2 layers x draft hidden size 64" in report.check("hidden_states_width").detail


def test_check_paged_false_leaves_out_the_conversion(dflash_draft, target):
    report = validate_draft(dflash_draft, target, check_paged=False)
    assert report.ok
    assert "paged_attention" not in _names(report)


# --------------------------------------------------------------------------------------------------
# Planted defects: exactly the intended check fails


@pytest.mark.parametrize("defect", list(RT_DEFECTS))
def test_rt_info_defect_fails_exactly_its_check(request, tmp_path, target, defect):
    which, values, check, fragment = RT_DEFECTS[defect]
    draft = _with_rt_info(request.getfixturevalue(which), tmp_path / defect, **values)

    report = validate_draft(draft, target)

    assert _failed(report) == {check}, [(c.name, c.detail) for c in report.failed]
    failed = report.check(check)
    assert fragment in failed.detail
    assert failed.fix and "\n" not in failed.detail


def test_missing_markov_head_file(tmp_path, dspark_draft, target):
    draft = _copy(dspark_draft, tmp_path / "draft")
    (draft / HEAD_XML).unlink()
    (draft / HEAD_XML.replace(".xml", ".bin")).unlink()

    report = validate_draft(draft, target)

    assert _failed(report) == {"markov_head"}
    assert f"markov_rank {MARKOV_RANK} but {HEAD_XML} is missing" in report.check("markov_head").detail


@pytest.mark.parametrize(
    "vocab, rank, fragment",
    [
        (512, 4, "W1/W2 have rank 4, but markov_rank is 8"),
        (300, MARKOV_RANK, "vocabulary 300 differs from the target's 512"),
    ],
)
def test_markov_head_shapes_must_match_rank_and_target_vocab(tmp_path, dspark_draft, target, vocab, rank, fragment):
    draft = _copy(dspark_draft, tmp_path / "draft")
    head = MarkovHead(torch.randn(vocab, rank), torch.randn(vocab, rank))
    save_markov_head(head, draft)  # overwrites the exported head

    report = validate_draft(draft, target)

    assert _failed(report) == {"markov_head"}
    assert fragment in report.check("markov_head").detail


def test_target_of_another_hidden_size(root, dflash_draft):
    wrong = make_tiny_target(root / "wide_target", hidden_size=96)

    report = validate_draft(dflash_draft, wrong)

    # The graft check and the width of hidden_states (2 x 96 expected) are both wrong, nothing else.
    assert _failed(report) == {"hidden_size_matches_target", "hidden_states_width"}
    assert "draft hidden size 64 differs from the target's 96" in report.check("hidden_size_matches_target").detail
    assert "expected 192" in report.check("hidden_states_width").detail


def test_masks_that_ignore_token_type_ids(tmp_path, dflash_draft, target):
    draft = _rewrite_backbone(dflash_draft, tmp_path / "draft", _masks_without_token_type_ids)

    report = validate_draft(draft, target)

    assert _failed(report) == {"paged_attention"}
    assert "token_type_ids reaches 0 of 2 PagedAttention ops" in report.check("paged_attention").detail


def test_sliding_layer_without_window(tmp_path, dflash_draft, target):
    # config.json now declares layer 1 sliding too, but its attention was exported as full attention.
    draft = _copy(dflash_draft, tmp_path / "draft")
    config = json.loads((draft / "config.json").read_text())
    config["layer_types"] = ["sliding_attention", "sliding_attention"]
    (draft / "config.json").write_text(json.dumps(config))

    report = validate_draft(draft, target)

    assert _failed(report) == {"paged_attention"}
    assert "layer 1 (sliding_attention) has PagedAttention sliding window 0" in report.check("paged_attention").detail


def test_unreadable_ir_fails_ir_reads_and_skips_the_rest(tmp_path, dflash_draft, target):
    draft = _copy(dflash_draft, tmp_path / "draft")
    (draft / XML.replace(".xml", ".bin")).unlink()

    report = validate_draft(draft, target)

    assert _names(report) == ALL_CHECKS
    assert not report.check("ir_reads").passed
    assert all(check.detail.startswith("skipped: ") for check in report.checks[1:])
    assert all(not check.passed for check in report.checks)


# --------------------------------------------------------------------------------------------------
# optimum-intel 2.2.0's old layout


def test_old_optimum_layout_gets_the_reexport_hint(old_layout_draft, target):
    report = validate_draft(old_layout_draft, target)

    layout = report.check("per_row_layout")
    assert not layout.passed
    assert "no token_type_ids input" in layout.detail and "optimum-intel <= 2.2" in layout.detail
    assert "dflash export" in layout.fix
    # It cannot be converted to PagedAttention, and 2.2.0 wrote no block size; the rest of its
    # metadata is fine.
    assert report.check("paged_attention").detail.startswith("skipped: ")
    assert _failed(report) == {"per_row_layout", "block_size", "paged_attention"}


def test_cli_exits_1_with_the_reexport_hint_on_the_old_layout(old_layout_draft):
    from typer.testing import CliRunner

    from dflash.cli.app import app

    result = CliRunner().invoke(app, ["validate", str(old_layout_draft), "--json"])

    assert result.exit_code == 1, result.output
    payload = json.loads(result.stdout)
    layout = next(check for check in payload["checks"] if check["name"] == "per_row_layout")
    assert layout["passed"] is False and "dflash export" in layout["fix"]


# --------------------------------------------------------------------------------------------------
# Unreadable input and the report schema


def test_unreadable_folders_raise_input_error(tmp_path, target_src, dflash_draft):
    with pytest.raises(InputError) as missing:
        validate_draft(tmp_path / "nope")
    assert missing.value.exit_code == 2

    # A checkpoint folder (config.json, no IR): the hint says to export it first.
    with pytest.raises(InputError) as checkpoint:
        validate_draft(target_src)
    assert "openvino_model.xml" in checkpoint.value.message and "dflash export" in checkpoint.value.hint

    with pytest.raises(InputError):
        validate_draft(dflash_draft, tmp_path / "no-target")


def test_json_schema(tmp_path, dflash_draft, target):
    draft = _with_rt_info(dflash_draft, tmp_path / "draft", block_size="1")
    report = validate_draft(draft, target)

    payload = json.loads(json.dumps(report.to_json()))  # plain JSON types only

    assert set(payload) == {"draft", "target", "ok", "checks"}
    assert payload["draft"] == str(draft) and payload["target"] == str(target)
    assert payload["ok"] is False
    assert [check["name"] for check in payload["checks"]] == ALL_CHECKS
    for check in payload["checks"]:
        assert set(check) == {"name", "passed", "detail", "fix"}
        assert isinstance(check["passed"], bool) and isinstance(check["detail"], str)
        assert (check["fix"] is None) == check["passed"]
    assert validate_draft(dflash_draft).to_json()["target"] is None


def test_report_dataclasses():
    good = CheckResult("a", True, "fine", None)
    bad = CheckResult("b", False, "broken", "do this")
    report = ValidationReport(Path("d"), None, [good, bad])
    assert not report.ok and report.failed == [bad]
    assert report.check("a") is good
    assert ValidationReport(Path("d"), None, [good]).ok


def test_contract_names_match_the_exporter():
    # One torch-free module (core/draft_format.py) holds the contract for the exporter and validate.
    assert validate_module.DRAFT_MODEL_FILE == draft_exporter.DRAFT_MODEL_FILE
    assert validate_module.MARKOV_HEAD_FILE == markov_exporter.MARKOV_HEAD_FILE
    assert validate_module.MARKOV_HEAD_INPUTS == markov_exporter.DENSE_INPUTS + markov_exporter.TOPK_INPUTS
    assert validate_module.MARKOV_HEAD_OUTPUTS == (markov_exporter.DENSE_OUTPUT, markov_exporter.TOPK_OUTPUT)


def test_validating_and_the_engine_do_not_import_torch():
    import subprocess
    import sys

    code = "import sys, dflash.exporters.validate, dflash.core.engine; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
