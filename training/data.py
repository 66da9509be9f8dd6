"""Training data: the target's own greedy answers to prompts, stored as token ids.

A DFlash/DSpark draft learns to predict what its target will say, so its training responses come from
the target itself (as in the DFlash recipe's "target-regenerated responses"): each prompt is wrapped in
the target's chat template, answered greedily, and stored as one JSONL line

    {"prompt_index": 12, "prompt_len": 37, "input_ids": [...prompt ids..., ...response ids...], "finished": true}

`input_ids[:prompt_len]` is the templated prompt, the rest the response up to and including the first
stop token (`finished` false when `max_new_tokens` cut it short). Greedy data makes the draft's
teacher-forced accuracy exactly the acceptance it will get under greedy speculative decoding.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from dflash.core.errors import InputError

from .fastgen import cut_at_stops
from .prompts import builtin_prompts, read_prompts  # noqa: F401 - the prompt sources, re-exported
from .target import Target

ProgressCallback = Callable[[int, int, int], None]  # (prompts done, prompts total, response tokens so far)


@dataclass(frozen=True)
class Example:
    """One training sequence: templated prompt followed by the target's response."""

    input_ids: tuple[int, ...]
    prompt_len: int
    group: str = field(default="", compare=False)  # what the hold-out keeps together: the prompt (or source file); "" = the prompt's ids
    source: str = field(default="chat", compare=False)  # "chat": a prompt and the target's answer; "text": real text after a short lead-in

    @property
    def prompt_key(self) -> str:
        return self.group or prompt_group(self.input_ids[: self.prompt_len])

    @property
    def response_len(self) -> int:
        return len(self.input_ids) - self.prompt_len


@dataclass
class GenerationStats:
    """What `generate_dataset` did."""

    sequences: int
    prompt_tokens: int
    response_tokens: int
    finished: int  # responses that reached a stop token
    seconds: float
    stopped_early: bool  # the time limit ended generation before every prompt was answered

    @property
    def tokens_per_second(self) -> float:
        return self.response_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "sequences": self.sequences,
            "prompt_tokens": self.prompt_tokens,
            "response_tokens": self.response_tokens,
            "finished": self.finished,
            "seconds": round(self.seconds, 2),
            "tokens_per_second": round(self.tokens_per_second, 1),
            "stopped_early": self.stopped_early,
        }


def prompt_group(prompt_ids: Sequence[int]) -> str:
    """A stable key of a prompt's token ids: sequences with the same key share a prompt."""
    import hashlib

    return "p:" + hashlib.sha1(",".join(map(str, prompt_ids)).encode()).hexdigest()[:16]


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of `prompt` as a single user turn in the chat template, ready for the assistant's answer.

    The template is rendered to text and then tokenized without extra special tokens, which gives the
    same ids on every transformers version (apply_chat_template's tokenize=True output type changed).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise InputError(
            "the target's tokenizer has no chat template",
            hint="train against an instruct/chat model, or pass --data with your own token ids",
        )
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def stop_token_ids(target: Target) -> set[int]:
    """The ids that end a response: the generation config's eos ids and the tokenizer's eos."""
    ids: set[int] = set()
    generation = getattr(target.model, "generation_config", None)
    for source in (getattr(generation, "eos_token_id", None), target.tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    if not ids:
        raise InputError("the target defines no eos token", hint="set eos_token_id in its generation_config.json")
    return ids


def pad_token_id(target: Target) -> int:
    """The tokenizer's pad id, else its eos (a pad only fills left padding and finished rows)."""
    pad = target.tokenizer.pad_token_id
    return pad if pad is not None else min(stop_token_ids(target))


@torch.no_grad()
def generate_responses(
    target: Target,
    prompt_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    check_every: int = 16,
    temperature: float = 0.0,
    ignore_eos: bool = False,
    generator: torch.Generator | None = None,
    impl: str = "auto",
) -> list[tuple[list[int], bool]]:
    """Greedy answers of one batch of left-padded prompts; returns (response, finished) per prompt.

    `impl`: "static" decodes over a preallocated KV cache (fastgen.py: the fast path on a GPU), "hf"
    through transformers' forward and cache (below); "auto" takes "static" on cuda for a target it
    supports.

    A plain decoding loop over the model's KV cache rather than `generate`: the same greedy tokens,
    but "is every row finished?" is asked only every `check_every` steps, so the host does not wait
    for the device at each step (a 135M model's decoding is launch-bound). A response is cut after
    its first stop token (kept: the draft must learn to predict it too), unless `ignore_eos`: then
    every response runs to `max_new_tokens`, as `dflash bench` decodes. `temperature` > 0 samples
    (diverse answers to the same prompt; the trainer's labels stay the target's own argmax).
    """
    from .fastgen import static_generate, supports_static_decoding

    pad = pad_token_id(target)
    if impl == "auto":
        impl = "static" if target.device.type == "cuda" and supports_static_decoding(target.model) else "hf"
    if impl == "static":
        return static_generate(target.model, prompt_ids, max_new_tokens, pad_id=pad, stop_ids=sorted(stop_token_ids(target)),
                               temperature=temperature, ignore_eos=ignore_eos, generator=generator, check_every=check_every)
    stops = torch.tensor(sorted(stop_token_ids(target)), device=target.device)
    width = max(len(ids) for ids in prompt_ids)
    input_ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for row, ids in enumerate(prompt_ids):
        input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, width - len(ids) :] = 1
    input_ids, attention_mask = input_ids.to(target.device), attention_mask.to(target.device)
    # Positions count real tokens only, so a left-padded row sees the positions it would see alone.
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)

    out = target.model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True, logits_to_keep=1
    )
    finished = torch.zeros(len(prompt_ids), dtype=torch.bool, device=target.device)
    tokens = []
    for step in range(max_new_tokens):
        logits = out.logits[:, -1]
        if temperature > 0:
            probs = (logits.float() / temperature).softmax(-1)
            token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        else:
            token = logits.argmax(-1)
        token = token.masked_fill(finished, pad)
        tokens.append(token)
        if not ignore_eos:
            finished |= torch.isin(token, stops)
        if step == max_new_tokens - 1 or ((step + 1) % check_every == 0 and bool(finished.all())):
            break
        attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
        out = target.model(
            input_ids=token[:, None], attention_mask=attention_mask, position_ids=positions,
            past_key_values=out.past_key_values, use_cache=True,
        )
    return cut_at_stops(tokens, stops, ignore_eos)


def generate_dataset(
    target: Target,
    prompts: Sequence[str],
    out_file: str | Path,
    *,
    max_new_tokens: int = 256,
    batch_size: int = 32,
    max_prompt_tokens: int = 512,
    time_limit_s: float | None = None,
    on_progress: ProgressCallback | None = None,
    temperature: float = 0.0,
    ignore_eos: bool = False,
    seed: int = 0,
    exclude: Callable[[Sequence[int]], bool] | None = None,
) -> GenerationStats:
    """Answer `prompts` greedily with the target and write the JSONL dataset to `out_file`.

    Prompts are batched by length (less padding); each batch is written as soon as it is done, so a
    time limit (checked between batches, from the last batch's duration) leaves a usable file.
    Prompts longer than `max_prompt_tokens` are skipped, and so are prompts `exclude(ids)` rejects
    (decontamination). Each record carries its prompt's group key (hold-out by prompt).
    """
    if not prompts:
        raise InputError("no prompts to generate training data from", hint="pass --generate-data N with N > 0")
    generator = torch.Generator(device=target.device).manual_seed(seed) if temperature > 0 else None
    encoded = [(index, encode_prompt(target.tokenizer, prompt)) for index, prompt in enumerate(prompts)]
    encoded = [(index, ids) for index, ids in encoded if len(ids) <= max_prompt_tokens]
    if exclude is not None:
        encoded = [(index, ids) for index, ids in encoded if not exclude(ids)]
    # Length-sorted within windows of a few batches (little padding), the windows in the given order: a
    # time limit then leaves a sample of every kind of prompt, not only the longest ones.
    window = batch_size * 4
    encoded = [item for first in range(0, len(encoded), window)
               for item in sorted(encoded[first : first + window], key=lambda item: len(item[1]), reverse=True)]

    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    stats = GenerationStats(0, 0, 0, 0, 0.0, False)
    last_batch_s = 0.0
    with out_file.open("w") as sink:
        for first in range(0, len(encoded), batch_size):
            elapsed = time.monotonic() - start
            if time_limit_s is not None and first > 0 and elapsed + last_batch_s > time_limit_s:
                stats.stopped_early = True
                break
            batch = encoded[first : first + batch_size]
            batch_start = time.monotonic()
            responses = generate_responses(target, [ids for _, ids in batch], max_new_tokens, temperature=temperature,
                                           ignore_eos=ignore_eos, generator=generator)
            last_batch_s = time.monotonic() - batch_start
            for (index, ids), (response, finished) in zip(batch, responses):
                record = {"prompt_index": index, "prompt_len": len(ids), "input_ids": ids + response, "finished": finished,
                          "group": prompt_group(ids), "source": "chat"}
                sink.write(json.dumps(record) + "\n")
                stats.sequences += 1
                stats.prompt_tokens += len(ids)
                stats.response_tokens += len(response)
                stats.finished += int(finished)
            sink.flush()
            if on_progress:
                on_progress(min(first + batch_size, len(encoded)), len(encoded), stats.response_tokens)
    stats.seconds = time.monotonic() - start
    return stats


def read_dataset(path: str | Path, *, max_length: int | None = None, min_response: int = 2) -> list[Example]:
    """Read a dataset JSONL into examples, cut to `max_length` tokens; too-short responses are dropped.

    A response needs at least `min_response` tokens: an anchor plus one token to predict.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"no dataset file {path}", hint="pass --data FILE (JSONL of token ids) or --generate-data N")
    examples = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            ids = [int(i) for i in record["input_ids"]]
            prompt_len = int(record["prompt_len"])
        except (ValueError, KeyError, TypeError) as exc:
            raise InputError(
                f"{path}:{number} is not a dataset record ({exc})",
                hint='each line needs "input_ids" (token ids) and "prompt_len" (how many of them are the prompt)',
            ) from exc
        if not 0 < prompt_len <= len(ids):
            raise InputError(f"{path}:{number}: prompt_len {prompt_len} outside 1..{len(ids)}", hint="fix the record")
        if max_length is not None:
            ids = ids[:max_length]
        if len(ids) - prompt_len >= min_response:
            group = str(record.get("group") or prompt_group(ids[:prompt_len]))
            examples.append(Example(tuple(ids), prompt_len, group, str(record.get("source", "chat"))))
    if not examples:
        raise InputError(
            f"{path} holds no sequence with a response of at least {min_response} tokens",
            hint="generate more data, or raise --max-length",
        )
    return examples


def write_dataset(path: str | Path, examples: Iterable[Example]) -> Path:
    """Write examples in the dataset JSONL format (for tests and hand-made data)."""
    path = Path(path)
    with path.open("w") as sink:
        for index, example in enumerate(examples):
            record = {"prompt_index": index, "prompt_len": example.prompt_len, "input_ids": list(example.input_ids),
                      "group": example.prompt_key, "source": example.source}
            sink.write(json.dumps(record) + "\n")
    return path
