"""Average the weights of draft checkpoints that share a starting point (a "model soup").

Two runs warm-started from the same draft, on different data, land near each other in weight space;
their average often keeps most of what each learned (Wortsman et al. 2022, "Model soups"). Measured
here: the sixth run gained on chat and lost on HumanEval against the fifth, from which it started; the
average of the two (docs/benchmarks.md, "A soup of the fifth and sixth runs") is compared with both
in the engine.

    python -m dflash.training.average OUT_DIR CHECKPOINT CHECKPOINT [...] [--weights 0.5 0.5]

The checkpoints must have the same config.json and the same tensors (names, shapes, dtypes); the
average is computed in float32 and stored in each tensor's dtype. OUT_DIR gets the first checkpoint's
other files (config.json, draft_vocab.json) and `average.json`, which names the sources and weights.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

WEIGHTS_FILE = "model.safetensors"
COPIED = ("config.json", "draft_vocab.json")


def average_checkpoints(sources: Sequence[str | Path], out_dir: str | Path, weights: Sequence[float] | None = None) -> Path:
    """Write the weighted average of `sources` (draft checkpoint folders) to `out_dir`; return it."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    sources = [Path(s) for s in sources]
    if len(sources) < 2:
        raise ValueError("average at least two checkpoints")
    weights = [1.0 / len(sources)] * len(sources) if weights is None else [float(w) for w in weights]
    if len(weights) != len(sources) or any(w < 0 for w in weights) or not np.isclose(sum(weights), 1.0):
        raise ValueError(f"one non-negative weight per checkpoint, summing to 1 (got {weights})")
    configs = [json.loads((s / "config.json").read_text()) for s in sources]
    if any(c != configs[0] for c in configs[1:]):
        raise ValueError("the checkpoints' config.json differ: only drafts of the same shape can be averaged")
    total: dict[str, np.ndarray] = {}
    dtypes: dict[str, np.dtype] = {}
    metadata = None
    for source, weight in zip(sources, weights):
        with safe_open(str(source / WEIGHTS_FILE), framework="numpy") as f:
            metadata = metadata or f.metadata()
            names = set(f.keys())
            if total and names != set(total):
                raise ValueError(f"{source} holds other tensors than {sources[0]}")
            for name in names:
                tensor = f.get_tensor(name)
                if name in total and (tensor.shape != total[name].shape or tensor.dtype != dtypes[name]):
                    raise ValueError(f"{name}: {source} has {tensor.dtype}{list(tensor.shape)}, "
                                     f"{sources[0]} {dtypes[name]}{list(total[name].shape)}")  # fmt: skip
                dtypes[name] = tensor.dtype
                total[name] = total.get(name, 0.0) + weight * tensor.astype(np.float32)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({name: value.astype(dtypes[name]) for name, value in total.items()}, str(out_dir / WEIGHTS_FILE),
              metadata=metadata)  # fmt: skip
    for name in COPIED:
        if (sources[0] / name).is_file():
            shutil.copyfile(sources[0] / name, out_dir / name)
    (out_dir / "average.json").write_text(json.dumps({"sources": [str(s) for s in sources], "weights": weights}, indent=2) + "\n")
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("checkpoints", type=Path, nargs="+")
    parser.add_argument("--weights", type=float, nargs="+", help="one per checkpoint, summing to 1 (default: equal)")
    args = parser.parse_args(argv)
    try:
        out = average_checkpoints(args.checkpoints, args.out_dir, args.weights)
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"averaged {len(args.checkpoints)} checkpoints into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
