"""The continuous-batching engine (target alone) with real OpenVINO inference on tiny targets.

Greedy tokens are compared with transformers' `generate` on the source checkpoint, then every
scheduling situation (batch size, staggered arrivals, chunked prefill, split-fuse off, prefix caching,
preemption, max_num_seqs) must give the very same tokens. Every scenario ends with every KV block back
in the pool. Inference runs in f32 with an f32 KV cache so that the comparison can be exact.

Two exports per session: a qwen3 target (most tests) and a llama target whose
max_position_embeddings is small (96), which also serves the "longer than the model's context" test.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import openvino as ov
import pytest
import torch

from dflash.core.config import EXACT_OV_CONFIG, SamplingParams
from dflash.core.engine import EngineConfig, GenerationResult, LLMEngine
from dflash.core.errors import InputError
from dflash.core.request import Request
from dflash.exporters.target import export_target
from dflash.exporters.tiny import _CORPUS, make_tiny_target

pytestmark = pytest.mark.slow  # exports models or runs many engines: left out of the fast subset (-m 'not slow')

F32 = EXACT_OV_CONFIG
NEW_TOKENS = 32
LLAMA_MAX_POSITIONS = 96

# 4, 13, 18, 35, 71 and 138 tokens with the tiny tokenizer; the last two span more than 2 blocks of 32.
PROMPTS = [
    "Hello, world!",
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. OpenVINO runs models on Intel CPUs.",
    "import numpy as np\nx = np.arange(16).reshape(4, 4)\nfor i in range(10):\n    print(i * i)\n",
    " ".join(_CORPUS[:4]),
    " ".join(_CORPUS),
]
LONG = 4  # index of the 71-token prompt
LLAMA_PROMPTS = PROMPTS[:4]  # prompt + NEW_TOKENS fits LLAMA_MAX_POSITIONS

GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)


# ---- fixtures ------------------------------------------------------------------------------------


@dataclass
class Target:
    hf_dir: Path
    ov_dir: Path
    reference: list[list[int]]  # transformers greedy tokens of each prompt, NEW_TOKENS each


def _hf_greedy(hf_dir: Path, prompts: Sequence[str]) -> list[list[int]]:
    """transformers `generate`, greedy, exactly NEW_TOKENS tokens (EOS does not stop it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # ignore_eos, without min_new_tokens' logit masking
    references = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
            references.append(out[0, ids.shape[1] :].tolist())
    assert all(len(ref) == NEW_TOKENS for ref in references)
    return references


def _build(root: Path, family: str, prompts: Sequence[str], **overrides) -> Target:
    # initializer_range 0.2 (not the default 0.05): sharper logits, so greedy continuations are
    # varied rather than one token repeated, which makes token comparisons meaningful.
    hf_dir = make_tiny_target(root / f"hf-{family}", family, seed=3, initializer_range=0.2, **overrides)
    ov_dir = export_target(hf_dir, root / f"ov-{family}", weight_format="fp32")
    return Target(hf_dir, ov_dir, _hf_greedy(hf_dir, prompts))


@pytest.fixture(scope="session")
def qwen3(sharp_qwen3) -> Target:
    hf_dir, ov_dir = sharp_qwen3  # what _build makes for qwen3, shared with other modules (conftest.py)
    return Target(hf_dir, ov_dir, _hf_greedy(hf_dir, PROMPTS))


@pytest.fixture(scope="session")
def llama(tmp_path_factory) -> Target:
    return _build(
        tmp_path_factory.mktemp("engine-llama"), "llama", LLAMA_PROMPTS, max_position_embeddings=LLAMA_MAX_POSITIONS
    )


def make_engine(model_dir: Path, **overrides) -> LLMEngine:
    config = dict(ov_config=F32, num_kv_blocks=128, max_num_batched_tokens=256)
    config.update(overrides)
    return LLMEngine(model_dir, EngineConfig(**config))


@pytest.fixture(scope="module")
def shared_engine(qwen3) -> LLMEngine:
    return make_engine(qwen3.ov_dir)


@pytest.fixture
def engine(shared_engine) -> Iterator[LLMEngine]:
    """A roomy engine shared by the tests that need no special limits (each test leaves it clean;
    after a failed one, whatever it left behind is dropped so that the next test starts afresh)."""
    yield shared_engine
    for req_id in list(shared_engine.scheduler.requests):
        shared_engine.abort_request(req_id)
    shared_engine._tracked.clear()
    shared_engine._pending.clear()


# ---- helpers -------------------------------------------------------------------------------------


def assert_pool_clean(engine: LLMEngine) -> None:
    """Every block back in the pool (prefix-cached blocks are free too) and nothing left running."""
    assert not engine.has_unfinished_requests()
    assert engine.block_pool.num_used_blocks == 0
    engine.block_pool.assert_all_free()
    assert not engine.scheduler.running and not engine.scheduler.waiting


MAX_STEPS = 3000  # far more than any test needs: a scheduler livelock fails instead of hanging


def run_all(
    engine: LLMEngine, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams] = GREEDY
) -> tuple[list[GenerationResult], list[Request]]:
    """Add every prompt, run to the end; results and the scheduler's Request objects, in order."""
    all_params = params if isinstance(params, Sequence) else [params] * len(prompts)
    req_ids = [engine.add_request(p, sp) for p, sp in zip(prompts, all_params, strict=True)]
    requests = [engine.scheduler.get_request(req_id) for req_id in req_ids]
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests(), f"still unfinished after {MAX_STEPS} steps"
    results = [engine.result(req_id) for req_id in req_ids]
    assert_pool_clean(engine)
    return results, requests


def decode(engine: LLMEngine, token_ids: Sequence[int]) -> str:
    return engine.tokenizer.decode(token_ids, skip_special_tokens=True)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ---- greedy parity with transformers -----------------------------------------------------------------


def test_greedy_parity_qwen3(qwen3, engine):
    results = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in results] == qwen3.reference
    for result in results:
        assert result.finish_reason == "length" and result.error is None
        # The final text is the decoding of every generated token (a trailing partial
        # character included).
        assert result.text == decode(engine, result.token_ids)
        assert result.ttft_s is not None and result.tpot_s is not None
    assert_pool_clean(engine)


def test_greedy_parity_llama(llama):
    engine = make_engine(llama.ov_dir, max_num_batched_tokens=16)  # chunked prefill too
    results, _ = run_all(engine, LLAMA_PROMPTS)
    assert [r.token_ids for r in results] == llama.reference


# ---- the same tokens under every scheduling situation ------------------------------------------------

# 16 requests cycling over the prompts, so equal prompts also run side by side.
SIXTEEN = [PROMPTS[i % len(PROMPTS)] for i in range(16)]

SCENARIOS = {
    "batch": {},
    "chunk_every_prompt": {"max_num_batched_tokens": 3},  # below the shortest prompt (4 tokens)
    "no_split_fuse": {"dynamic_split_fuse": False},
    "no_prefix_caching": {"enable_prefix_caching": False},
    "max_num_seqs_3": {"max_num_seqs": 3},
    # 7 blocks of 32 hold the longest request (138 + 32 tokens) but not all of them at once.
    "preempt": {"num_kv_blocks": 7},
    "preempt_no_split_fuse": {"num_kv_blocks": 7, "dynamic_split_fuse": False},
    "preempt_chunked_no_cache": {"num_kv_blocks": 7, "max_num_batched_tokens": 20, "enable_prefix_caching": False},
    "preempt_no_split_fuse_tight_budget": {
        "num_kv_blocks": 7, "dynamic_split_fuse": False, "max_num_batched_tokens": 140, "enable_prefix_caching": False
    },
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_same_tokens_in_every_scenario(qwen3, scenario):
    engine = make_engine(qwen3.ov_dir, **SCENARIOS[scenario])
    results, requests = run_all(engine, SIXTEEN)
    for index, result in enumerate(results):
        assert result.error is None, result.error
        assert result.token_ids == qwen3.reference[index % len(PROMPTS)], f"request {index}"
    if "preempt" in scenario:
        assert sum(r.num_preemptions for r in requests) > 0, "the small cache should have forced preemption"
    else:
        assert all(r.num_preemptions == 0 for r in requests)


def test_chunked_recompute_without_split_fuse_makes_progress(qwen3):
    """Split-fuse off, a tight cache: the long request outgrows its blocks and is preempted with
    more tokens (138 + ~23) than the budget, so its recompute runs in chunks. It used to preempt
    itself again at every chunk while the short request, which holds the other blocks, never got
    a generation step: a livelock. Now the short request runs in those steps and both finish."""
    engine = make_engine(
        qwen3.ov_dir, num_kv_blocks=7, dynamic_split_fuse=False, max_num_batched_tokens=140, enable_prefix_caching=False
    )
    results, requests = run_all(engine, [PROMPTS[3], PROMPTS[5]])
    assert requests[1].num_preemptions > 0
    assert [r.token_ids for r in results] == [qwen3.reference[3], qwen3.reference[5]]


def test_each_prompt_alone(qwen3, engine):
    for prompt, reference in zip(PROMPTS, qwen3.reference):
        assert engine.generate([prompt], GREEDY)[0].token_ids == reference
    assert_pool_clean(engine)


def test_staggered_arrivals(qwen3):
    engine = make_engine(qwen3.ov_dir, max_num_batched_tokens=24)
    req_ids, requests = [], []
    for index, prompt in enumerate(SIXTEEN):
        req_ids.append(engine.add_request(prompt, GREEDY))
        requests.append(engine.scheduler.get_request(req_ids[-1]))
        for _ in range(index % 3):  # 0, 1 or 2 steps between arrivals
            engine.step()
    engine.run_until_done()
    for index, req_id in enumerate(req_ids):
        assert engine.result(req_id).token_ids == qwen3.reference[index % len(PROMPTS)], f"request {index}"
    # Later copies of the long prompts found the blocks of earlier ones (some still running).
    assert any(r.num_prefix_cached_tokens > 0 for r in requests)
    assert_pool_clean(engine)


def test_prefix_cache_hits_give_the_same_tokens(qwen3):
    engine = make_engine(qwen3.ov_dir)
    kv_block_size = engine.runner.kv_block_size
    long_ids = engine.tokenizer(PROMPTS[LONG])["input_ids"]
    assert len(long_ids) > 2 * kv_block_size, "the prompt must span more than 2 blocks"

    (first,), (first_req,) = run_all(engine, [PROMPTS[LONG]])
    assert first_req.num_prefix_cached_tokens == 0
    assert engine.block_pool.num_cached_blocks >= 2

    (again,), (again_req,) = run_all(engine, [PROMPTS[LONG]])
    assert again_req.num_prefix_cached_tokens == (len(long_ids) - 1) // kv_block_size * kv_block_size
    assert again.token_ids == first.token_ids == qwen3.reference[LONG]

    # A different prompt that shares the first blocks hits them, then computes the rest.
    other_ids = engine.tokenizer(PROMPTS[LONG + 1])["input_ids"]
    shared_blocks = common_prefix(long_ids, other_ids) // kv_block_size
    assert shared_blocks >= 1
    (other,), (other_req,) = run_all(engine, [PROMPTS[LONG + 1]])
    assert other_req.num_prefix_cached_tokens == shared_blocks * kv_block_size
    assert other.token_ids == qwen3.reference[LONG + 1]


def test_prefix_cache_at_block_boundaries(qwen3):
    """Prompts of exactly 2 blocks (the last token is recomputed, so 1 block hits), 2 blocks + 1
    (2 hit) and 2 blocks - 1: the same tokens as without prefix caching."""
    engine = make_engine(qwen3.ov_dir)
    uncached = make_engine(qwen3.ov_dir, enable_prefix_caching=False)
    kv_block_size = engine.runner.kv_block_size
    long_ids = engine.tokenizer(PROMPTS[LONG + 1])["input_ids"]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    for length, hit_blocks in ((2 * kv_block_size, 1), (2 * kv_block_size + 1, 2), (2 * kv_block_size - 1, 1)):
        prompt = long_ids[:length]
        (expected,), _ = run_all(uncached, [prompt], params)
        (first,), _ = run_all(engine, [prompt], params)
        (again,), (again_req,) = run_all(engine, [prompt], params)
        assert again_req.num_prefix_cached_tokens == hit_blocks * kv_block_size, length
        assert first.token_ids == again.token_ids == expected.token_ids, length


# ---- sampling ------------------------------------------------------------------------------------


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, top_k=20, seed=seed, ignore_eos=True)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(engine):
    prompt = PROMPTS[1]
    (alone,), _ = run_all(engine, [prompt], sampled(1234))
    (again,), _ = run_all(engine, [prompt], sampled(1234))
    assert alone.token_ids == again.token_ids
    beside, _ = run_all(engine, [PROMPTS[3], prompt, PROMPTS[5], prompt], [GREEDY, sampled(1234), GREEDY, sampled(99)])
    assert beside[1].token_ids == alone.token_ids
    assert beside[3].token_ids != alone.token_ids  # another seed, another sequence
    assert alone.token_ids != engine.generate([prompt], GREEDY)[0].token_ids[:16]  # it does sample


# ---- stop rules ----------------------------------------------------------------------------------


def _stop_token_case(reference: list[int], eos_ids: Sequence[int]) -> tuple[int, int]:
    """A token of the greedy continuation (not among the first 3) and where it first appears."""
    for index in range(3, len(reference) - 3):
        token = reference[index]
        if token not in reference[:index] and not set(eos_ids) & set(reference[: index + 1]):
            return token, index
    raise AssertionError("no usable stop token in the reference continuation")


def test_stop_token_ids(qwen3, engine):
    token, index = _stop_token_case(qwen3.reference[2], engine.eos_token_ids)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, stop_token_ids=[token])
    (result,), _ = run_all(engine, [PROMPTS[2]], params)
    assert result.token_ids == qwen3.reference[2][: index + 1]  # the stop token is kept
    assert result.finish_reason == "stop"
    assert result.stop_reason == f"stop token {token}"


def test_generation_config_eos_stops_unless_ignored(qwen3, tmp_path):
    """A model whose generation_config names an EOS (as a list) stops there; ignore_eos runs on."""
    model_dir = shutil.copytree(qwen3.ov_dir, tmp_path / "eos-model")
    token, index = _stop_token_case(qwen3.reference[3], [2])
    config_path = model_dir / "generation_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = [token]
    config_path.write_text(json.dumps(config))
    engine = make_engine(model_dir)
    assert token in engine.eos_token_ids

    stopped, ignored = run_all(engine, [PROMPTS[3]] * 2, [SamplingParams(max_new_tokens=NEW_TOKENS), GREEDY])[0]
    assert stopped.token_ids == qwen3.reference[3][: index + 1]
    assert stopped.finish_reason == "stop"
    assert ignored.token_ids == qwen3.reference[3]
    assert ignored.finish_reason == "length"


def _stop_string_case(text: str) -> str:
    """3 printable characters from the middle of `text`, first found past its start."""
    for start in range(len(text) // 3, len(text) - 3):
        stop = text[start : start + 3]
        if stop.isprintable() and "\ufffd" not in stop and text.find(stop) >= 3:
            return stop
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("index", [0, 3])
def test_stop_strings_cut_the_text_and_the_stream(qwen3, engine, index):
    full_text = decode(engine, qwen3.reference[index])
    stop = _stop_string_case(full_text)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, stop_strings=["\x00never", stop])
    (result,), _ = run_all(engine, [PROMPTS[index]], params)
    assert result.text == full_text[: full_text.find(stop)]
    assert result.finish_reason == "stop" and result.stop_reason == f"stop string {stop!r}"
    assert len(result.token_ids) < NEW_TOKENS
    assert result.token_ids == qwen3.reference[index][: len(result.token_ids)]
    # Streamed pieces never contain the cut stop string: they add up to the final text.
    assert "".join(engine.stream(PROMPTS[index], params)) == result.text
    assert_pool_clean(engine)


def test_max_new_tokens_gives_length(qwen3, engine):
    (result,), _ = run_all(engine, [PROMPTS[1]], SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert result.token_ids == qwen3.reference[1][:5]
    assert result.finish_reason == "length" and result.stop_reason is None


# ---- bad input -----------------------------------------------------------------------------------


def test_empty_prompt_fails_alone(qwen3, engine):
    results, _ = run_all(engine, ["", PROMPTS[0], [], PROMPTS[2]])
    for bad in (results[0], results[2]):
        assert bad.finish_reason == "error" and "empty" in bad.error
        assert bad.token_ids == [] and bad.text == ""
    assert results[1].token_ids == qwen3.reference[0]
    assert results[3].token_ids == qwen3.reference[2]


def test_token_ids_outside_the_vocabulary_fail(qwen3, engine):
    ids = engine.tokenizer(PROMPTS[1])["input_ids"]
    results, _ = run_all(engine, [[5000, *ids], ids, [-1, *ids]])
    assert results[0].finish_reason == "error" and "vocabulary" in results[0].error
    assert results[2].finish_reason == "error" and "vocabulary" in results[2].error
    assert results[1].token_ids == qwen3.reference[1]


def test_prompt_beyond_the_model_context_fails(llama):
    engine = make_engine(llama.ov_dir)
    assert engine.scheduler.config.max_model_len == LLAMA_MAX_POSITIONS
    too_long = PROMPTS[5]  # 138 tokens: longer than the context by itself
    too_long_with_output = PROMPTS[LONG]  # 71 tokens: fits, but not with 32 new tokens
    results, _ = run_all(engine, [too_long, LLAMA_PROMPTS[1], too_long_with_output])
    for bad in (results[0], results[2]):
        assert bad.finish_reason == "error" and "max_model_len" in bad.error and bad.token_ids == []
    assert results[1].token_ids == llama.reference[1]
    # The same prompt with fewer new tokens fits the context.
    (fits,), _ = run_all(engine, [too_long_with_output], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert fits.error is None and len(fits.token_ids) == 8


def test_prompt_beyond_the_whole_cache_fails(qwen3):
    engine = make_engine(qwen3.ov_dir, num_kv_blocks=2)  # 64 positions
    results, _ = run_all(engine, [PROMPTS[LONG], PROMPTS[0], PROMPTS[5]])
    for bad in (results[0], results[2]):
        assert bad.finish_reason == "error" and "whole cache" in bad.error and bad.token_ids == []
    assert results[1].token_ids == qwen3.reference[0]


def test_prompt_beyond_the_budget_without_split_fuse_fails(qwen3):
    engine = make_engine(qwen3.ov_dir, dynamic_split_fuse=False, max_num_batched_tokens=64)
    results, _ = run_all(engine, [PROMPTS[LONG], PROMPTS[1]])
    assert results[0].finish_reason == "error" and "dynamic_split_fuse" in results[0].error
    assert results[1].token_ids == qwen3.reference[1]


def test_zero_new_tokens_finishes_at_once(engine):
    req_id = engine.add_request(PROMPTS[1], SamplingParams(max_new_tokens=0))
    outputs = engine.step()
    assert [(o.req_id, o.finished, o.new_token_ids) for o in outputs] == [(req_id, True, [])]
    result = engine.result(req_id)
    assert result.finish_reason == "length" and result.token_ids == [] and result.text == ""
    assert_pool_clean(engine)


def test_request_id_reuse_while_running_is_refused(qwen3, engine):
    engine.add_request(PROMPTS[0], GREEDY, req_id="same")
    engine.step()
    with pytest.raises(InputError, match="already in use"):
        engine.add_request(PROMPTS[1], GREEDY, req_id="same")
    engine.run_until_done()
    assert engine.result("same").token_ids == qwen3.reference[0]
    # Once its result is collected the id is free again, and the old request's end is not
    # mistaken for the new one's: exactly one finished output, the last one.
    engine.add_request(PROMPTS[1], GREEDY, req_id="same")
    outputs = []
    engine.run_until_done(outputs.append)
    assert [o.finished for o in outputs if o.req_id == "same"] == [False] * (NEW_TOKENS - 1) + [True]
    assert engine.result("same").token_ids == qwen3.reference[1]
    assert_pool_clean(engine)


def test_result_of_an_unfinished_request_is_refused(engine):
    req_id = engine.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match="not finished"):
        engine.result(req_id)
    engine.run_until_done()
    assert engine.result(req_id).finish_reason == "length"
    assert_pool_clean(engine)


# ---- streaming and chat ------------------------------------------------------------------------------


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_stream_adds_up_to_the_final_text(qwen3, engine, index):
    pieces = list(engine.stream(PROMPTS[index], GREEDY))
    assert len(pieces) > 1
    assert "".join(pieces) == decode(engine, qwen3.reference[index])
    assert_pool_clean(engine)


def test_step_outputs_add_up_to_the_result(qwen3, engine):
    """What a caller streams from step() outputs equals each result's text."""
    streamed: dict[str, str] = {}
    finished: list[str] = []

    def collect(output):
        streamed[output.req_id] = streamed.get(output.req_id, "") + output.new_text
        if output.finished:
            finished.append(output.req_id)

    results = engine.generate(PROMPTS, GREEDY, on_output=collect)
    assert sorted(finished) == sorted(r.req_id for r in results)
    for result in results:
        assert streamed[result.req_id] == result.text
    assert_pool_clean(engine)


def test_stream_of_a_bad_prompt_raises(engine):
    with pytest.raises(InputError, match="empty"):
        list(engine.stream(""))
    assert_pool_clean(engine)


def test_stream_stops_early_and_frees_its_blocks(engine):
    stream = engine.stream(PROMPTS[3], GREEDY)
    next(stream)
    assert engine.block_pool.num_used_blocks > 0
    stream.close()  # the consumer walks away: the request is aborted
    assert_pool_clean(engine)


def test_chat_prompts_use_the_chat_template(engine):
    messages = [{"role": "user", "content": "How are you today?"}]
    expected = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    for prompt in (messages, "How are you today?"):  # a string with chat=True is one user message
        req_id = engine.add_request(prompt, params, chat=True)
        assert engine.scheduler.get_request(req_id).prompt_token_ids == expected
        engine.run_until_done()
        result = engine.result(req_id)
        assert result.prompt_token_ids == expected and len(result.token_ids) == 12
    # The same ids given directly, and the chat stream, give the same text.
    (by_ids,), _ = run_all(engine, [expected], params)
    assert by_ids.token_ids == result.token_ids
    assert "".join(engine.stream(messages, params, chat=True)) == result.text
    assert_pool_clean(engine)


# ---- abort ---------------------------------------------------------------------------------------


def test_abort_mid_run_frees_the_blocks(qwen3, engine):
    req_ids = [engine.add_request(p, GREEDY) for p in PROMPTS[2:5]]
    for _ in range(4):
        engine.step()
    victim = req_ids[1]
    assert engine.kv_cache_manager.num_blocks_of(victim) > 0
    assert engine.abort_request(victim)
    assert engine.kv_cache_manager.num_blocks_of(victim) == 0
    assert not engine.abort_request(victim)  # already finished
    assert not engine.abort_request("no-such-request")
    waiting = engine.add_request(PROMPTS[0], GREEDY)  # aborted before it ever ran
    assert engine.abort_request(waiting)
    outputs = []
    engine.run_until_done(outputs.append)
    finals = {o.req_id: o for o in outputs if o.finished}
    assert finals[victim].finish_reason == finals[waiting].finish_reason == "abort"  # aborts show as outputs
    results = [engine.result(req_id) for req_id in req_ids]
    assert results[0].token_ids == qwen3.reference[2]
    assert results[2].token_ids == qwen3.reference[4]
    aborted = results[1]
    assert aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < NEW_TOKENS
    assert aborted.token_ids == qwen3.reference[3][: len(aborted.token_ids)]
    never_ran = engine.result(waiting)
    assert never_ran.finish_reason == "abort" and never_ran.token_ids == []
    assert_pool_clean(engine)


def test_two_threads_on_one_engine_get_the_tokens_of_one_thread(qwen3, engine):
    """Every public call holds the engine's lock: two threads that each generate their own prompts
    (their requests share steps) get exactly the target's tokens, and the pool ends clean."""
    import threading

    halves = [PROMPTS[:3], PROMPTS[3:6]]
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            results[index] = engine.generate(halves[index], GREEDY)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors and not any(t.is_alive() for t in threads)
    assert [r.token_ids for r in results[0] + results[1]] == qwen3.reference[:6]
    assert_pool_clean(engine)


def test_f32_turns_off_dynamic_quantization(qwen3, shared_engine):
    """Under f32 the CPU plugin must not quantize activations on the fly (it would make int8/int4
    results depend on how many rows share a MatMul); a value the caller sets is kept."""
    compiled = shared_engine.runner.compiled
    assert compiled.get_property("INFERENCE_PRECISION_HINT") == ov.Type.f32
    assert int(compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")) == 0
    explicit = make_engine(qwen3.ov_dir, ov_config={**F32, "DYNAMIC_QUANTIZATION_GROUP_SIZE": "64"}, num_kv_blocks=4)
    assert int(explicit.runner.compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")) == 64


def test_numpy_blas_runs_on_one_thread_inside_a_step_and_as_before_outside(qwen3, engine, monkeypatch):
    """OpenBLAS's idle workers spin on the cores OpenVINO infers on (core/blas_threads.py): inside a
    step (the target's inference included) BLAS is limited to one thread, and the limit set before the
    step is back after it."""
    from threadpoolctl import threadpool_info, threadpool_limits

    def blas_threads() -> set[int]:
        return {pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"}

    seen: list[set[int]] = []
    run = engine.runner.run
    monkeypatch.setattr(engine.runner, "run", lambda step: (seen.append(blas_threads()), run(step))[1])
    with threadpool_limits(limits=2, user_api="blas"):
        assert blas_threads() == {2}
        engine.add_request(PROMPTS[1], GREEDY, req_id="blas")
        engine.run_until_done()
        assert blas_threads() == {2}
    assert seen and all(threads == {1} for threads in seen)
    assert engine.result("blas").token_ids == qwen3.reference[1]
