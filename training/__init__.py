"""Training DFlash and DSpark drafts from a target's own outputs (`dflash train`).

Modules, in the order a run uses them:
- `prompts`: the built-in prompt generator (no benchmark set) and prompt files;
- `target`: the frozen target (loading, hidden-state features, mask-token choice, layer ids);
- `data`: the target's greedy answers to prompts as a JSONL of token ids with the prompt boundary;
- `model`: the batched many-block forward through the exporter's own `DraftModel`, the Markov head;
- `trainer`: anchors, blocks, the position-weighted loss, the optimisation loop, evaluation;
- `checkpoint`: z-lab (DFlash) and DeepSpec (DSpark) checkpoints that `dflash export` reads.

`training/DEVICE.md` and `training/device_run.sh` train the SmolLM2-135M drafts on a GPU machine.
"""

from dflash.core.telemetry import openvino_telemetry_off

openvino_telemetry_off()  # before any module of this package imports openvino (core/telemetry.py)
