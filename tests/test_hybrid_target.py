"""Hybrid linear-attention targets (tiny random Qwen3.5: 3 GatedDeltaNet layers + 1 full attention).

Export with the project's target exporter, the stateful IR against transformers' own Qwen3.5
forward, and the PagedAttention model driven by hand through its `la.*` inputs and state tables:
one-shot and chunked prefill, two sequences in one call, and speculative verification with one
checkpoint per verified row (the state after k rows lands in checkpoint k; the committed block is left
as it was). These tests pin the OpenVINO behaviour the engine builds on (docs/hybrid-targets.md);
tests/test_hybrid_engine.py tests the engine itself.

optimum-intel 2.2.0 exports qwen3_5_text only with transformers 5.2.x: the export tests skip elsewhere.
Exact comparisons run with f32 compute and caches.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import openvino as ov
import pytest
import transformers

from dflash.core.errors import ModelFormatError
from dflash.core.hidden_states import hidden_state_outputs, read_hidden_state_locators
from dflash.core.paged import SequenceSlice, allocate_kv_caches, pack_paged_inputs, read_kv_cache_layout, to_paged_attention
from dflash.exporters.hybrid import ROPE_FROM_POSITION_IDS, is_hybrid_config, require_hybrid_export_support

F32 = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
TOL = 1e-4  # f32 logits of order 1; measured differences are below 5e-6
NUM_STATE_BLOCKS = 16

needs_52 = pytest.mark.skipif(
    not transformers.__version__.startswith("5.2."),
    reason=f"optimum-intel 2.2.0 exports qwen3_5_text only with transformers 5.2.x (have {transformers.__version__})",
)
core = ov.Core()


# ---------------------------------------------------------------------------------------------
# Fast: which configs are hybrid, and the one-line refusals


def test_hybrid_configs_are_recognised():
    assert is_hybrid_config({"model_type": "qwen3_5_text", "layer_types": ["linear_attention", "full_attention"]})
    assert is_hybrid_config({"model_type": "qwen3_next"})
    assert is_hybrid_config({"model_type": "qwen3_5", "text_config": {"layer_types": ["linear_attention"]}})
    assert not is_hybrid_config({"model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"]})


def test_unsupported_hybrid_exports_get_one_line(monkeypatch):
    with pytest.raises(ModelFormatError, match="not supported yet"):
        require_hybrid_export_support({"model_type": "qwen3_next"})
    # The module as imported now: an export earlier in the session can leave another object in sys.modules.
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.5.4")
    for model_type in ("qwen3_5_text", "qwen3_5"):  # a qwen3_5 (VLM) checkpoint is exported as its language model
        with pytest.raises(ModelFormatError, match=r"only with transformers 5\.2\.x, this environment has 5\.5\.4") as err:
            require_hybrid_export_support({"model_type": model_type})
        assert "\n" not in err.value.message
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.2.0")
    require_hybrid_export_support({"model_type": "qwen3_5"})


# ---------------------------------------------------------------------------------------------
# Slow: export, stateful parity, the paged model driven by hand


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> tuple[Path, Path]:
    """(Hugging Face folder, fp32 IR) of a tiny Qwen3.5 text target."""
    from dflash.exporters.target import export_target
    from dflash.exporters.tiny import make_tiny_target

    root = tmp_path_factory.mktemp("hybrid")
    src = make_tiny_target(root / "hf", "qwen3_5_text", seed=7)
    return src, export_target(src, root / "ov", weight_format="fp32")


@pytest.fixture(scope="module")
def hf_model(hybrid):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hybrid[0], dtype=torch.float32).eval()


def _hf_logits(hf_model, tokens: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].numpy()


PROMPT = [int(t) for t in np.random.default_rng(1).integers(4, 500, 13)]


@pytest.mark.slow
@needs_52
def test_export_annotates_and_rewires_positions(hybrid):
    model = core.read_model(hybrid[1] / "openvino_model.xml")
    assert sorted(read_hidden_state_locators(model)) == [0, 1, 2, 3]
    assert model.get_rt_info(ROPE_FROM_POSITION_IDS).astype(str) == "True"
    ops = Counter(op.get_type_name() for op in model.get_ops())
    assert ops["ScaledDotProductAttention"] == 1 and ops["Loop"] == 3  # GatedDeltaNet's recurrence


@pytest.mark.slow
@needs_52
def test_stateful_export_matches_transformers(hybrid, hf_model):
    model = core.read_model(hybrid[1] / "openvino_model.xml")
    model.add_outputs(hidden_state_outputs(model, [0, 1, 2, 3]))
    compiled = core.compile_model(model, "CPU", F32)
    request = compiled.create_infer_request()
    tokens = list(PROMPT)
    feed_ids = np.array([tokens])
    for _ in range(6):
        past = len(tokens) - feed_ids.shape[1]
        out = request.infer({
            "input_ids": feed_ids,
            "attention_mask": np.ones((1, len(tokens)), np.int64),
            "position_ids": np.arange(past, len(tokens))[None],
            "beam_idx": np.zeros(1, np.int32),
        })
        logits = out[compiled.outputs[0]][0]
        reference = _hf_logits(hf_model, tokens)[past:]
        assert np.abs(logits - reference).max() < TOL
        tokens.append(int(logits[-1].argmax()))
        feed_ids = np.array([[tokens[-1]]])


class PagedHybrid:
    """The paged hybrid target with its KV and state tables; one call per `run`."""

    def __init__(self, ir: Path, *, garbage_from: int = NUM_STATE_BLOCKS):
        """State blocks from `garbage_from` on hold random values (a reused block), the others zeros."""
        model = core.read_model(ir / "openvino_model.xml")
        info = to_paged_attention(model)
        self.la_inputs = [name for name in info.other_inputs if name.startswith("la.")]
        self.state_tables = [name for name in info.other_inputs if "state_table" in name]
        self.compiled = core.compile_model(model, "CPU", F32)
        layout = read_kv_cache_layout(self.compiled)
        self.kv_block_size = layout.kv_block_size
        self.request = self.compiled.create_infer_request()
        for name, tensor in allocate_kv_caches(layout, 8).items():
            self.request.set_tensor(name, tensor)
        rng = np.random.default_rng(0)
        for name in self.state_tables:
            port = self.compiled.input(name)
            shape = [NUM_STATE_BLOCKS] + [d.get_length() for d in port.get_partial_shape()[1:]]
            tensor = ov.Tensor(port.get_element_type(), ov.Shape(shape))
            tensor.data[:] = 0
            tensor.data[garbage_from:] = rng.standard_normal([shape[0] - garbage_from, *shape[1:]])
            self.request.set_tensor(name, tensor)

    def run(self, seqs: list[tuple[list[int], int, list[int], list[int], int]]) -> np.ndarray:
        """seqs: (tokens, past_len, kv block table, la.block_indices of the sequence, la.cache_interval)."""
        feed = pack_paged_inputs([SequenceSlice(past, len(t), kv) for t, past, kv, _, _ in seqs], self.kv_block_size)
        feed["input_ids"] = np.concatenate([t for t, *_ in seqs]).astype(np.int64)
        feed["position_ids"] = np.concatenate([np.arange(past, past + len(t)) for t, past, *_ in seqs])
        la_blocks, la_begins = [], [0]
        for _, _, _, blocks, _ in seqs:
            la_blocks += blocks
            la_begins.append(len(la_blocks))
        feed["la.block_indices"] = np.array(la_blocks, np.int32)
        feed["la.block_indices_begins"] = np.array(la_begins, np.int32)
        feed["la.past_lens"] = np.array([past for _, past, *_ in seqs], np.int32)
        feed["la.cache_interval"] = np.array([interval for *_, interval in seqs], np.int32)
        out = self.request.infer(feed)
        return out[self.compiled.outputs[0]].reshape(feed["input_ids"].shape[0], -1)


@pytest.mark.slow
@needs_52
def test_paged_conversion_adds_linear_attention_inputs(hybrid):
    model = core.read_model(hybrid[1] / "openvino_model.xml")
    info = to_paged_attention(model)
    ops = Counter(op.get_type_name() for op in model.get_ops())
    assert (ops["PagedAttentionExtension"], ops["PagedGatedDeltaNet"], ops["PagedCausalConv1D"]) == (1, 3, 3)
    assert [n for n in info.other_inputs if n.startswith("la.")] == [
        "la.block_indices", "la.block_indices_begins", "la.past_lens", "la.cache_interval",
    ]
    shapes = {n: str(model.input(n).get_partial_shape()) for n in info.other_inputs if "state_table" in n}
    # conv: [blocks, conv channels = 2*key heads*key dim + value heads*value dim, kernel]; delta: [blocks, heads, k, v]
    assert shapes == {
        **{f"conv_state_table.{i}": "[?,128,4]" for i in range(3)},
        **{f"gated_delta_state_table.{i}": "[?,4,16,16]" for i in range(3)},
    }
    # The layer locators survive the transformation, and it compiles on CPU.
    assert len(hidden_state_outputs(model, [0, 1, 2, 3])) == 4
    core.compile_model(model, "CPU", F32)


@pytest.mark.slow
@needs_52
def test_paged_prefill_chunks_and_packing_match_transformers(hybrid, hf_model):
    paged = PagedHybrid(hybrid[1])
    reference = _hf_logits(hf_model, PROMPT)
    # One-shot prefill: the sequence reads and writes state block 0 ([b, b], cache_interval 0).
    assert np.abs(paged.run([(PROMPT, 0, [0], [0, 0], 0)]) - reference).max() < TOL
    tokens = list(PROMPT)
    for _ in range(4):  # decode
        tokens.append(int(_hf_logits(hf_model, tokens)[-1].argmax()))
        logits = paged.run([([tokens[-1]], len(tokens) - 1, [0], [0, 0], 0)])
        assert np.abs(logits[-1] - _hf_logits(hf_model, tokens)[-1]).max() < TOL
    # Chunked prefill, 5 + 8 rows, in state block 1 and KV block 1.
    chunks = np.concatenate([paged.run([(PROMPT[:5], 0, [1], [1, 1], 0)]), paged.run([(PROMPT[5:], 5, [1], [1, 1], 0)])])
    assert np.abs(chunks - reference).max() < TOL
    # Two sequences in one call, each with its own KV and state block.
    other = [int(t) for t in np.random.default_rng(2).integers(4, 500, 7)]
    both = paged.run([(PROMPT, 0, [2], [2, 2], 0), (other, 0, [3], [3, 3], 0)])
    assert np.abs(both[:13] - reference).max() < TOL
    assert np.abs(both[13:] - _hf_logits(hf_model, other)).max() < TOL


@pytest.mark.slow
@needs_52
def test_past_len_zero_reads_the_state_block(hybrid, hf_model):
    """la.past_lens 0 does not reset the recurrent state: a state block must be zeroed before reuse."""
    paged = PagedHybrid(hybrid[1], garbage_from=0)
    assert np.abs(paged.run([(PROMPT, 0, [0], [0, 0], 0)]) - _hf_logits(hf_model, PROMPT)).max() > 0.1


@pytest.mark.slow
@needs_52
def test_verification_checkpoints_hold_the_state_after_each_row(hybrid, hf_model):
    """Verify K rows reading the committed block c and writing checkpoints t1..tK (cache_interval 1):
    checkpoint k holds the state after k rows, c is left as it was. Promoting checkpoint acc+1 is
    what makes rejected rows leave no trace. Checkpoint blocks need no zeroing (they hold random values
    here), and a verification shares its call with another sequence's prefill (cache_interval 0)."""
    paged = PagedHybrid(hybrid[1], garbage_from=8)
    paged.run([(PROMPT, 0, [0], [0, 0], 0)])  # committed state of the prompt in block 0
    candidates = [int(t) for t in np.random.default_rng(3).integers(4, 500, 4)]
    checkpoints = [10, 11, 12, 13]
    verify = [(candidates, len(PROMPT), [0], [0, *checkpoints], 1)]
    other = [int(t) for t in np.random.default_rng(4).integers(4, 500, 6)]
    logits = paged.run([*verify, (other, 0, [1], [1, 1], 0)])
    assert np.abs(logits[:4] - _hf_logits(hf_model, PROMPT + candidates)[len(PROMPT):]).max() < TOL
    assert np.abs(logits[4:] - _hf_logits(hf_model, other)).max() < TOL
    for k, block in enumerate(checkpoints, start=1):
        paged.run(verify)  # the previous continuation overwrote a candidate's KV row
        accepted = PROMPT + candidates[:k]
        nxt = paged.run([([7], len(accepted), [0], [block, block], 0)])
        assert np.abs(nxt[-1] - _hf_logits(hf_model, [*accepted, 7])[-1]).max() < TOL, f"checkpoint {k}"
    # The committed block still holds the prompt's state: nothing was accepted from it.
    nxt = paged.run([([7], len(PROMPT), [0], [0, 0], 0)])
    assert np.abs(nxt[-1] - _hf_logits(hf_model, [*PROMPT, 7])[-1]).max() < TOL


@pytest.mark.slow
@needs_52
def test_engine_refuses_a_hybrid_target_without_rope_from_position_ids(hybrid, tmp_path):
    """optimum-intel's own export (no position rewiring) would give every packed row the last row's
    position: the engine refuses it in one line instead of generating wrong tokens."""
    import shutil

    from dflash.core.model_runner import TargetRunner

    copy = tmp_path / "no-rewiring"
    shutil.copytree(hybrid[1], copy)
    xml = copy / "openvino_model.xml"
    xml.write_text(xml.read_text().replace("dflash/rope_from_position_ids", "dflash/rope_removed"))
    with pytest.raises(ModelFormatError, match="takes its rotary positions from its KV length") as err:
        TargetRunner(copy)
    assert "\n" not in err.value.message
    assert TargetRunner(hybrid[1]).is_hybrid  # the export as it is runs


@pytest.mark.slow
@needs_52
def test_genai_continuous_batching_on_the_export_matches_transformers(hybrid, hf_model):
    """openvino-genai's ContinuousBatchingPipeline (the autoregressive peer) on the same IR: greedy
    tokens equal transformers' generate. On optimum-intel's IR without the position rewiring, its first
    token after an 8-token prompt already differs (docs/hybrid-targets.md)."""
    import openvino_genai as ov_genai
    import torch

    scheduler = ov_genai.SchedulerConfig()
    scheduler.num_kv_blocks, scheduler.max_num_batched_tokens, scheduler.enable_prefix_caching = 32, 256, False
    pipeline = ov_genai.ContinuousBatchingPipeline(str(hybrid[1]), scheduler, "CPU", F32)
    config = ov_genai.GenerationConfig()
    config.max_new_tokens, config.ignore_eos, config.do_sample = 16, True, False
    prompts = [PROMPT, PROMPT[:4]]
    results = pipeline.generate([ov.Tensor(np.asarray([p], dtype=np.int64)) for p in prompts], [config] * 2)
    for prompt, result in zip(prompts, results):
        with torch.no_grad():
            expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert list(result.m_generation_ids[0]) == expected[0, len(prompt):].tolist()


@pytest.mark.slow
@needs_52
def test_state_pool_drives_a_verification_and_promotion(hybrid, hf_model):
    """core/state_pool.py on the real tables: reused (random) blocks, a partial acceptance, the pool full again."""
    from dflash.core.state_pool import StatePool

    paged = PagedHybrid(hybrid[1], garbage_from=0)

    def zero(block: int) -> None:
        for name in paged.state_tables:
            paged.request.get_tensor(name).data[block] = 0

    pool = StatePool(NUM_STATE_BLOCKS, zero=zero)
    pool.allocate("a")
    paged.run([(PROMPT, 0, [0], *pool.la_block_indices("a"))])
    rows = [int(t) for t in np.random.default_rng(5).integers(4, 500, 5)]  # seed + 4 candidates
    pool.reserve_checkpoints("a", len(rows))
    paged.run([(rows, len(PROMPT), [0], *pool.la_block_indices("a"))])
    pool.promote("a", 3)  # seed + 2 accepted candidates; the bonus token is the next step's seed
    committed = PROMPT + rows[:3]
    logits = paged.run([([7], len(committed), [0], *pool.la_block_indices("a"))])
    assert np.abs(logits[-1] - _hf_logits(hf_model, [*committed, 7])[-1]).max() < TOL
    pool.free("a")
    assert pool.num_free == NUM_STATE_BLOCKS
