"""The host side of a step, made cheap without changing what it computes (issue 14).

- The runners write their inputs into the infer request's own tensors and read the outputs from
  them (`RequestTensors`), reshaped each call: logits must stay transformers' own while the packed
  batch grows, shrinks, samples no row at all, and changes its number of sequences from call to call.
- Packing puts each request's sampled rows last among its rows.
- Text is decoded only when read: outputs read late, or never, still add up to each result's text,
  which is the tokenizer's own decode of the tokens (transformers).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash.core.config import EXACT_OV_CONFIG, SamplingParams
from dflash.core.engine import EngineConfig, LLMEngine
from dflash.core.model_runner import StepInputs, TargetRunner, pack_target_rows
from dflash.core.paged import SequenceSlice
from dflash.core.request import Request
from dflash.core.scheduler import ScheduledRequest

pytestmark = pytest.mark.slow  # exports a tiny model and runs transformers


@pytest.fixture(scope="module")
def runner(sharp_qwen3) -> TargetRunner:
    runner = TargetRunner(sharp_qwen3[1], ov_config=EXACT_OV_CONFIG)
    runner.allocate_cache(16)
    return runner


@pytest.fixture(scope="module")
def reference(sharp_qwen3) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """transformers' logits of three token sequences, each run alone: {name: (ids [n], logits [n, V])}."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(sharp_qwen3[0], dtype=torch.float32).eval()
    rng = np.random.default_rng(11)
    out = {}
    for name, length in (("a", 70), ("b", 13), ("c", 40)):
        ids = rng.integers(0, hf.config.vocab_size, length)
        with torch.no_grad():
            out[name] = (ids, hf(torch.tensor(ids)[None]).logits[0].numpy())
    return out


def test_reused_input_tensors_give_transformers_logits_across_changing_shapes(runner, reference):
    """The same request tensors serve every call: more rows, fewer rows, no sampled row, one sequence
    then three then one; every sampled row must still be transformers' logits at that position."""
    block_tables = {"a": [0, 1, 2], "b": [3], "c": [4, 5]}
    # Calls: (sequence, first position, rows, sampled rows counted from the end of its rows)
    calls = [
        [("a", 0, 40, 40), ("b", 0, 5, 1)],  # 45 rows, 41 sampled
        [("a", 40, 20, 0)],  # fewer rows, none sampled: the logits output is empty
        [("b", 5, 8, 8), ("c", 0, 40, 2), ("a", 60, 1, 1)],  # three sequences, 49 rows
        [("a", 61, 9, 3)],  # one sequence again, 9 rows
    ]
    for call in calls:
        seqs, token_ids, sample_rows, expected = [], [], [], []
        for name, start, num_rows, num_sampled in call:
            ids, logits = reference[name]
            seqs.append(SequenceSlice(start, num_rows, block_tables[name]))
            first_sampled = len(token_ids) + num_rows - num_sampled
            token_ids.extend(ids[start : start + num_rows])
            sample_rows.extend(range(first_sampled, first_sampled + num_sampled))
            expected.append(logits[start + num_rows - num_sampled : start + num_rows])
        out = runner.run(StepInputs(seqs, np.array(token_ids, dtype=np.int64), np.array(sample_rows, dtype=np.int64)))
        assert out.logits.shape == (len(sample_rows), reference["a"][1].shape[1])
        np.testing.assert_allclose(out.logits, np.concatenate(expected), atol=2e-5, rtol=0)
    assert runner.infer_seconds > 0


def test_packed_rows_sample_the_last_rows_of_each_request():
    requests = [Request(name, list(range(10, 10 + n))) for name, n in (("p", 7), ("q", 3), ("r", 5))]
    requests[1].spec_token_ids = (91, 92)  # q verifies two candidates: its last 3 rows sample
    scheduled = [
        (ScheduledRequest("p", 4, 0, is_prefill_chunk=True, samples=False), requests[0]),  # a chunk: no row samples
        (ScheduledRequest("q", 3, 2, is_prefill_chunk=False, samples=True, num_spec_tokens=2), requests[1]),
        (ScheduledRequest("r", 5, 0, is_prefill_chunk=True, samples=True), requests[2]),
    ]
    inputs = pack_target_rows(scheduled, lambda req_id: [7])
    assert inputs.token_ids.tolist() == [10, 11, 12, 13, 12, 91, 92, 10, 11, 12, 13, 14]
    assert inputs.sample_rows.tolist() == [4, 5, 6, 11]
    assert [(s.past_len, s.num_new_rows) for s in inputs.seqs] == [(0, 4), (2, 3), (0, 5)]


@pytest.fixture(scope="module")
def engine(sharp_qwen3) -> LLMEngine:
    return LLMEngine(sharp_qwen3[1], EngineConfig(ov_config=EXACT_OV_CONFIG, num_kv_blocks=64, max_num_batched_tokens=64))


PROMPTS = ["Hello, world!", "def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog."]


def test_text_read_late_or_never_adds_up_to_the_decoded_tokens(engine):
    """Request 0's outputs are read at once, request 1's every other step and late, request 2's never:
    each result's text is the tokenizer's decode of its tokens, and what was read adds up to it."""
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    req_ids = [engine.add_request(p, params) for p in PROMPTS]
    streamed = {req_id: "" for req_id in req_ids}
    unread = []
    step = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.req_id == req_ids[0]:
                streamed[output.req_id] += output.new_text
            elif output.req_id == req_ids[1]:
                unread.append(output)
        if step % 2 == 1 or not engine.has_unfinished_requests():
            for output in unread:  # read a step or two late
                streamed[output.req_id] += output.new_text
            unread = []
        step += 1
    for req_id in req_ids:
        result = engine.result(req_id)
        decoded = engine.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        assert len(result.token_ids) == 24 and result.text == decoded
        if req_id != req_ids[2]:
            assert streamed[req_id] == result.text
    assert engine.block_pool.num_used_blocks == 0


def test_stop_strings_still_end_the_request_where_one_token_steps_would(engine):
    """Stop strings need the text every step: the request must end at the token that completes the
    string, with the text cut before it, as when decoding the whole output with the tokenizer."""
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    (free,) = [r for r in engine.generate(PROMPTS[:1], params)]
    full = engine.tokenizer.decode(free.token_ids, skip_special_tokens=True)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop and stop in full
    (stopped,) = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=24, ignore_eos=True, stop_strings=[stop]))
    assert stopped.finish_reason == "stop" and stopped.text == full[: full.index(stop)]
    # The tokens end at the first token whose text holds the stop string.
    decoded_prefixes = [engine.tokenizer.decode(free.token_ids[:n], skip_special_tokens=True) for n in range(25)]
    first = next(n for n, text in enumerate(decoded_prefixes) if stop in text)
    assert stopped.token_ids == free.token_ids[:first]
