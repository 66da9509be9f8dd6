"""The small pure parts of the engine: incremental detokenization, stop rules, sampling, prompts.

They run on the tiny byte-level BPE tokenizer (no model, no OpenVINO): multi-byte characters are
split over several byte tokens there, which is what incremental detokenization must handle.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflash.core.config import SamplingParams
from dflash.core.detokenizer import IncrementalDetokenizer
from dflash.core.errors import InputError
from dflash.core.request import RequestStatus
from dflash.core.sampler import Sampler, _filtered_probs, greedy
from dflash.core.stopping import StopChecker
from dflash.core.tokenization import stop_token_ids_of, tokenize_prompt
from dflash.exporters.tiny import CHAT_TEMPLATE, build_tokenizer

MULTIBYTE = "héllo wörld € 😀 done"
EOS = 2  # <|im_end|> in the tiny tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def decode(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


# ---- incremental detokenization ----------------------------------------------------------------------


def stream_tokens(tokenizer, ids, prompt_ids=()) -> tuple[list[str], IncrementalDetokenizer]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    return [detokenizer.add([token]) for token in ids], detokenizer


def test_multibyte_characters_wait_for_their_last_byte(tokenizer):
    ids = tokenizer(MULTIBYTE).input_ids
    assert len(ids) > len(MULTIBYTE.split()) * 2, "the characters should be split into byte tokens"
    deltas, detokenizer = stream_tokens(tokenizer, ids)
    assert "".join(deltas) == MULTIBYTE == detokenizer.text
    assert not any("\ufffd" in delta for delta in deltas)
    assert "" in deltas  # some tokens complete no character on their own
    assert detokenizer.flush() == ""


def test_flush_emits_a_trailing_incomplete_character(tokenizer):
    ids = tokenizer("a€").input_ids[:-1]  # "a" then 2 of the 3 bytes of "€"
    deltas, detokenizer = stream_tokens(tokenizer, ids)
    assert "".join(deltas) == "a"
    tail = detokenizer.flush()
    assert "\ufffd" in tail
    assert detokenizer.text == decode(tokenizer, ids)


def test_long_streams_match_a_full_decode(tokenizer):
    """Past the window the detokenizer forgets old tokens; the text must not change."""
    text = (MULTIBYTE + " The quick brown fox. ") * 12
    ids = tokenizer(text).input_ids
    assert len(ids) > 200
    deltas, detokenizer = stream_tokens(tokenizer, ids)
    assert "".join(deltas) + detokenizer.flush() == text


def test_prompt_context_and_special_tokens(tokenizer):
    prompt = tokenizer("Hello, world!").input_ids
    output = tokenizer(" How are you?").input_ids + [EOS]
    deltas, detokenizer = stream_tokens(tokenizer, output, prompt)
    assert "".join(deltas) == " How are you?"  # the prompt is context, not output text
    assert deltas[-1] == ""  # special tokens are skipped
    assert detokenizer.flush() == ""


def test_several_tokens_at_once(tokenizer):
    ids = tokenizer(MULTIBYTE).input_ids
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.add(ids[i : i + 3]) for i in range(0, len(ids), 3)]
    assert "".join(pieces) + detokenizer.flush() == MULTIBYTE


# ---- stop rules ----------------------------------------------------------------------------------


def test_eos_stops_unless_ignored():
    params = SamplingParams(max_new_tokens=10)
    assert StopChecker(params, [EOS]).check([5, EOS], "") == (RequestStatus.FINISHED_STOPPED, f"stop token {EOS}")
    assert StopChecker(SamplingParams(max_new_tokens=10, ignore_eos=True), [EOS]).check([5, EOS], "") is None
    # An EOS earlier in the output does not matter, only the newest token.
    assert StopChecker(params, [EOS]).check([EOS, 5], "") is None


def test_stop_token_ids_stop_even_with_ignore_eos():
    params = SamplingParams(max_new_tokens=10, ignore_eos=True, stop_token_ids=[7])
    checker = StopChecker(params, [EOS])
    assert checker.check([1, 7], "")[0] == RequestStatus.FINISHED_STOPPED
    assert checker.first_stop([1, EOS, 3, 7, 7]) == 3
    assert checker.first_stop([1, 3]) is None


def test_max_new_tokens_and_priority():
    checker = StopChecker(SamplingParams(max_new_tokens=3, stop_token_ids=[7]), [EOS])
    assert checker.check([1, 4], "") is None
    assert checker.check([1, 4, 3], "") == (RequestStatus.FINISHED_LENGTH, "length")
    # A stop token on the last allowed token is a stop, not a length finish.
    assert checker.check([1, 4, 7], "")[0] == RequestStatus.FINISHED_STOPPED


def test_stop_strings_and_trimming():
    checker = StopChecker(SamplingParams(stop_strings=["END", "\n\n"]), [EOS])
    assert checker.check([1], "some text, E") is None
    assert checker.check([1], "some text, END and more") == (RequestStatus.FINISHED_STOPPED, "stop string 'END'")
    assert checker.trim_text("a\n\nb END c") == "a"  # the earliest stop string cuts
    assert checker.trim_text("no stop here") == "no stop here"
    assert checker.num_held_back_chars == 2  # "EN" could still become "END"
    assert StopChecker(SamplingParams(), [EOS]).num_held_back_chars == 0


# ---- sampling ------------------------------------------------------------------------------------


LOGITS = np.array([0.5, 3.0, 1.0, 2.9, -1.0, 0.0], dtype=np.float32)


def test_greedy_is_argmax():
    sampler = Sampler()
    assert sampler.sample("r", LOGITS, SamplingParams()) == 1
    assert greedy(np.stack([LOGITS, -LOGITS])).tolist() == [1, 4]


def test_top_k_and_top_p_filters():
    def kept(**params) -> list[int]:
        probs = _filtered_probs(LOGITS.astype(np.float64), SamplingParams(temperature=1.0, **params))
        assert probs.sum() == pytest.approx(1.0)
        return np.flatnonzero(probs).tolist()

    assert kept(top_k=2) == [1, 3]
    # 3.0 and 2.9 hold ~0.66 of the mass together: top_p 0.5 keeps both, 0.4 keeps only the first.
    assert kept(top_p=0.5) == [1, 3]
    assert kept(top_p=0.4) == [1]
    assert kept() == list(range(len(LOGITS)))


def test_top_k_1_is_greedy_at_any_temperature():
    sampler = Sampler()
    params = SamplingParams(temperature=5.0, top_k=1, seed=0)
    assert {sampler.sample("r", LOGITS, params) for _ in range(20)} == {1}


def test_seeds_make_sampling_reproducible():
    params = SamplingParams(temperature=2.0, seed=42)
    draws = {}
    for name in ("a", "b"):
        sampler = Sampler()
        draws[name] = [sampler.sample("r", LOGITS, params) for _ in range(40)]
    assert draws["a"] == draws["b"]
    assert len(set(draws["a"])) > 2  # it really samples
    other = Sampler()
    assert [other.sample("r", LOGITS, SamplingParams(temperature=2.0, seed=7)) for _ in range(40)] != draws["a"]
    # Each request has its own generator: interleaving another request changes nothing.
    mixed = Sampler()
    interleaved = []
    for _ in range(40):
        interleaved.append(mixed.sample("r", LOGITS, params))
        mixed.sample("other", LOGITS, SamplingParams(temperature=2.0, seed=1))
    assert interleaved == draws["a"]
    # forget() drops the generator: the same request id starts its seed over.
    mixed.forget("r")
    assert [mixed.sample("r", LOGITS, params) for _ in range(40)] == draws["a"]


# ---- prompts and EOS ids ----------------------------------------------------------------------------


def test_stop_token_ids_of_generation_config(tokenizer, tmp_path):
    assert stop_token_ids_of(tmp_path, tokenizer) == [EOS]  # no generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert stop_token_ids_of(tmp_path, tokenizer) == [9, EOS]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, 11]}))
    assert stop_token_ids_of(tmp_path, tokenizer) == [EOS, 11]


def test_tokenize_prompt_forms(tokenizer):
    text, ids = tokenize_prompt(tokenizer, "Hello, world!", chat=False)
    assert text == "Hello, world!" and ids == tokenizer("Hello, world!").input_ids
    assert tokenize_prompt(tokenizer, [5, 6, 7], chat=False) == (None, [5, 6, 7])
    assert tokenize_prompt(tokenizer, np.array([5, 6, 7]), chat=True) == (None, [5, 6, 7])
    assert tokenize_prompt(tokenizer, np.array([], dtype=np.int64), chat=False) == ("", [])
    assert tokenize_prompt(tokenizer, "", chat=False)[1] == []
    assert tokenize_prompt(tokenizer, [], chat=True) == ("", [])

    messages = [{"role": "user", "content": "Hello, world!"}]
    expected_text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert expected_text.endswith("<|im_start|>assistant\n") and tokenizer.chat_template == CHAT_TEMPLATE
    for prompt in (messages, "Hello, world!"):
        text, ids = tokenize_prompt(tokenizer, prompt, chat=True)
        assert text == expected_text
        assert ids == tokenizer(expected_text, add_special_tokens=False).input_ids
        assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_chat_without_a_template_is_an_input_error():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(InputError, match="no chat template"):
        tokenize_prompt(tokenizer, "Hello", chat=True)
