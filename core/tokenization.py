"""Prompts to token ids: plain text, token ids, or chat messages through the tokenizer's template."""

from __future__ import annotations

import json
import numbers
from collections.abc import Sequence
from pathlib import Path
from typing import Union

from .errors import InputError

Message = dict  # {"role": ..., "content": ...}
Prompt = Union[str, Sequence[int], Sequence[Message]]


def load_tokenizer(model_dir: str | Path):
    """The Hugging Face tokenizer saved beside the exported model."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as exc:
        raise InputError(
            f"cannot load the tokenizer of {model_dir}: {str(exc).splitlines()[0]}",
            "export the model with `dflash export`, which saves its tokenizer files",
        ) from exc


def stop_token_ids_of(model_dir: str | Path, tokenizer) -> list[int]:
    """EOS ids from generation_config.json (int or list), plus the tokenizer's EOS."""
    ids: list[int] = []
    path = Path(model_dir) / "generation_config.json"
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        ids += [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def tokenize_prompt(tokenizer, prompt: Prompt, *, chat: bool) -> tuple[str | None, list[int]]:
    """(prompt text, token ids). Chat: a string becomes one user message; messages go through the template."""
    if isinstance(prompt, str):
        if not chat:
            return prompt, list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
        prompt = [{"role": "user", "content": prompt}]
    elif len(prompt) == 0:
        return "", []
    elif all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
        # numbers.Integral: numpy integers (an array of ids, or a list of them) are token ids too.
        return None, [int(t) for t in prompt]
    if not getattr(tokenizer, "chat_template", None):
        raise InputError(
            "the tokenizer has no chat template, so chat messages cannot be formatted",
            "pass plain prompts (--no-chat)",
        )
    text = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)
    return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])
