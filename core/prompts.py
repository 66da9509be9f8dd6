"""Prompts files: `.txt` (one prompt per line) or `.jsonl` (`prompt`, chat `messages`, or `turns`).

A malformed line is reported with its line number, so a user can fix the file.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import InputError
from .tokenization import Prompt


def read_prompts_file(path: str | Path) -> list[Prompt]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read prompts file {path}: {exc}", "pass a readable UTF-8 .txt or .jsonl file") from exc
    if path.suffix == ".jsonl":
        prompts = [_jsonl_prompt(line, n, path) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    elif path.suffix in (".txt", ""):
        prompts = [line for line in text.splitlines() if line.strip()]
    else:
        raise InputError(f"unknown prompts file type {path.suffix!r}", "use .txt (one prompt per line) or .jsonl")
    if not prompts:
        raise InputError(f"{path} holds no prompts", "add one prompt per line (.txt) or one JSON object per line (.jsonl)")
    return prompts


def _jsonl_prompt(line: str, number: int, path: Path) -> Prompt:
    where = f"{path}:{number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: not valid JSON ({exc.msg})", "each line must be one JSON object") from exc
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object", 'write {"prompt": "..."} or {"messages": [...]}')
    if isinstance(record.get("prompt"), str) and record["prompt"].strip():
        return record["prompt"]
    if "messages" in record:
        return _messages(record["messages"], where)
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise InputError(f"{where}: `turns` must be a non-empty list of strings", "fix that line")
        # Only the first turn: later turns need the model's answers to the earlier ones.
        return [{"role": "user", "content": turns[0]}]
    raise InputError(f"{where}: no non-empty `prompt`, `messages` or `turns` field", 'write {"prompt": "..."}')


def _messages(messages: object, where: str) -> list[dict]:
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    )
    if not ok:
        raise InputError(
            f"{where}: `messages` must be a non-empty list of {{role, content}} objects",
            'write "messages": [{"role": "user", "content": "..."}]',
        )
    return messages
