"""Prompts to token ids: plain text, token ids, or chat messages through the tokenizer's template."""

from __future__ import annotations

import json
import numbers
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Union

from .errors import InputError

Message = dict  # {"role": ..., "content": ...}
Prompt = Union[str, Sequence[int], Sequence[Message]]


def load_tokenizer(model_dir: str | Path):
    """The tokenizer saved beside the exported model.

    Read straight from tokenizer.json when the folder allows it (`JsonTokenizer`: ~0.1 s); otherwise
    through transformers' AutoTokenizer, whose imports (torch among them) cost 5-10 s on a small CPU.
    """
    tokenizer = JsonTokenizer.load(model_dir)
    if tokenizer is not None:
        return tokenizer
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as exc:
        raise InputError(
            f"cannot load the tokenizer of {model_dir}: {str(exc).splitlines()[0]}",
            "export the model with `dflash export`, which saves its tokenizer files",
        ) from exc


_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class JsonTokenizer:
    """The part of a transformers fast tokenizer that dflash uses, read from the same files.

    The same Rust tokenizer (`tokenizers`, from tokenizer.json) and the same Jinja chat template,
    rendered in the environment transformers renders it in (`transformers.utils.chat_template_utils`:
    trim_blocks, lstrip_blocks, loop controls, its `tojson`, `raise_exception` and `strftime_now`).
    `load` declines (returns None) every folder whose tokenizer transformers would change at load
    time, so the two never disagree: no tokenizer.json, BOS/EOS added by the config rather than by
    tokenizer.json's post-processor, decoded spaces cleaned up, or a template with transformers'
    own `{% generation %}` tag. tests/test_tokenization.py compares both on the same folders.
    """

    def __init__(self, tokenizer, config: dict, chat_template: str | None):
        self._tokenizer = tokenizer
        self.chat_template = chat_template
        texts = {key: _token_text(config.get(key)) for key in _SPECIAL_TOKEN_KEYS}
        self._special_tokens = {key: text for key, text in texts.items() if text is not None}
        self._template = None

    @classmethod
    def load(cls, model_dir: str | Path) -> JsonTokenizer | None:
        folder = Path(model_dir)
        config_path = folder / "tokenizer_config.json"
        if not (folder / "tokenizer.json").is_file() or not config_path.is_file():
            return None
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError):
            return None
        if config.get("add_bos_token") or config.get("add_eos_token") or config.get("clean_up_tokenization_spaces"):
            return None
        template = _chat_template_of(folder, config)
        if template is not None and re.search(r"\{%-?\s*generation\s*-?%\}", template):
            return None
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception:  # a tokenizer.json this tokenizers release cannot read: transformers decides
            return None
        return cls(tokenizer, config, template)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode([int(t) for t in token_ids], skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]):
        if isinstance(tokens, str):
            return self._tokenizer.token_to_id(tokens)
        return [self._tokenizer.token_to_id(token) for token in tokens]

    def convert_ids_to_tokens(self, ids: int | Sequence[int]):
        if isinstance(ids, numbers.Integral):
            return self._tokenizer.id_to_token(int(ids))
        return [self._tokenizer.id_to_token(int(i)) for i in ids]

    @property
    def eos_token_id(self) -> int | None:
        eos = self._special_tokens.get("eos_token")
        return None if eos is None else self._tokenizer.token_to_id(eos)

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = False,
                            tokenize: bool = True):  # fmt: skip
        if not self.chat_template:
            raise ValueError("the tokenizer has no chat template")
        if self._template is None:
            self._template = _compile_chat_template(self.chat_template)
        text = self._template.render(
            messages=list(messages), tools=None, documents=None, add_generation_prompt=add_generation_prompt,
            **self._special_tokens,
        )  # fmt: skip
        return self(text, add_special_tokens=False)["input_ids"] if tokenize else text


def _token_text(token) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _chat_template_of(folder: Path, config: dict) -> str | None:
    """chat_template.jinja (transformers 5 writes it), else tokenizer_config.json's default template."""
    path = folder / "chat_template.jinja"
    if path.is_file():
        return path.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the one transformers uses by default
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def _compile_chat_template(source: str):
    """The template in transformers' environment (chat_template_utils._cached_compile_jinja_template)."""
    from datetime import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


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
