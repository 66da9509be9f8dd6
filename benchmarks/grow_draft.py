"""A draft checkpoint grown to more layers, to price a deeper draft on the CPU before training one.

    python benchmarks/grow_draft.py exporters/default_drafts/smollm2-135m-dflash-b16 drafts/grown5-dflash --layers 5
    dflash export drafts/grown5-dflash drafts/ov/grown5-dflash

The layers are grown as `dflash train --init-from` grows them (`dflash.training.trainer.grow_layers`): the
new layers add nothing, so the grown draft accepts what the source does. OpenVINO shares identical
constants, which would hide the new layers' cost, so by default their copied weights get 1% noise and
their zeroed output projections noise of 1e-5 (still nothing a bf16 step would notice);
`--exact` writes the grown weights unchanged (the deeper draft `dflash train` would start from).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash.exporters.draft_checkpoint import load_draft_weights
from dflash.exporters.draft_config import load_draft_config
from dflash.training.trainer import grow_layers, source_layer_positions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("output", type=Path)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--exact", action="store_true", help="no noise on the new layers")
    args = parser.parse_args()

    config = load_draft_config(args.source)
    if args.layers <= config.num_hidden_layers:
        parser.error(f"--layers {args.layers}: the source already has {config.num_hidden_layers}")
    have = config.num_hidden_layers
    weights = grow_layers(load_draft_weights(args.source, config), have, args.layers)
    if not args.exact:
        sources = source_layer_positions(have, args.layers)
        generator = torch.Generator().manual_seed(0)
        for name, tensor in weights.items():
            if name.startswith("layers.") and int(name.split(".")[1]) not in sources and tensor.dim() == 2:
                noise = torch.randn(tensor.shape, generator=generator)
                weights[name] = tensor * (1 + 0.01 * noise) if tensor.any() else 1e-5 * noise
    args.output.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.half().contiguous() for name, tensor in weights.items()}, str(args.output / "model.safetensors"))
    raw = json.loads((args.source / "config.json").read_text())
    raw["num_hidden_layers"] = args.layers
    if "layer_types" in raw:
        raw["layer_types"] = [raw["layer_types"][0]] * args.layers
    (args.output / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    for extra in ("draft_vocab.json",):
        if (args.source / extra).is_file():
            shutil.copy(args.source / extra, args.output / extra)
    print(f"{args.output}: {have} -> {args.layers} layers")


if __name__ == "__main__":
    main()
