"""The option vocabulary shared by commands, as `Annotated` aliases."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer


class DraftKind(str, Enum):
    """The two draft families: z-lab DFlash and DeepSpec DSpark."""

    dflash = "dflash"
    dspark = "dspark"


class AssistantSchedule(str, Enum):
    """How many candidates a request drafts per step: the same every step, transformers' heuristic, or
    the candidates whose measured acceptance pays for their measured cost (core/adaptive.py)."""

    constant = "constant"
    heuristic = "heuristic"
    adaptive = "adaptive"


class WeightFormat(str, Enum):
    fp32 = "fp32"
    fp16 = "fp16"
    int8 = "int8"
    int4 = "int4"


JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print machine-readable JSON on stdout and nothing else.")
]
QuietOpt = Annotated[
    bool, typer.Option("--quiet", "-q", help="No progress or informational messages on stderr.")
]
DebugOpt = Annotated[
    bool,
    typer.Option("--debug", help="Show the full traceback on errors (same as DFLASH_DEBUG=1)."),
]
WeightFormatOpt = Annotated[
    WeightFormat,
    typer.Option("--weight-format", help="Weight precision of the exported model (int8/int4 through NNCF)."),
]
DraftWeightFormatOpt = Annotated[
    Optional[WeightFormat],
    typer.Option(
        "--draft-weight-format",
        help="Weight precision of the draft; defaults to --weight-format.",
        show_default=False,
    ),
]
TrustRemoteCodeOpt = Annotated[
    bool,
    typer.Option("--trust-remote-code", help="Allow custom modelling code from the checkpoint's repository."),
]
ExistingDir = Annotated[
    Path,
    typer.Argument(exists=True, file_okay=False, dir_okay=True, readable=True, resolve_path=True),
]

OvConfigOpt = Annotated[
    Optional[list[str]],
    typer.Option(
        "--ov-config",
        help="An OpenVINO property KEY=VALUE (repeatable), e.g. INFERENCE_PRECISION_HINT=f32 for exact parity.",
        show_default=False,
    ),
]


# ---- sampling (generate, bench): the fields of core.config.SamplingParams -------------------------------

TemperatureOpt = Annotated[
    float,
    typer.Option("--temperature", min=0.0, help="0: greedy; above 0: sample at this temperature (with a draft: speculative sampling)."),
]
TopPOpt = Annotated[
    float, typer.Option("--top-p", min=0.01, max=1.0, help="Sample from the smallest set of tokens holding this probability mass.")
]
TopKOpt = Annotated[int, typer.Option("--top-k", min=0, help="Sample among the K most likely tokens (0: all).")]
SeedOpt = Annotated[
    Optional[int], typer.Option("--seed", help="Seed of sampling, for repeatable samples (default: a fresh seed).", show_default=False)
]


def sampling_params(*, temperature: float, top_p: float, top_k: int, seed: int | None, **fields):
    """The SamplingParams of the sampling options, with any other fields (max_new_tokens, ...)."""
    from dflash.core.config import SamplingParams

    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, **fields)


def parse_ov_config(items: list[str] | None) -> dict[str, str]:
    """KEY=VALUE strings to a properties dict; a malformed item is a usage error (exit 2)."""
    config = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise typer.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--ov-config")
        config[key.strip()] = value.strip()
    return config
