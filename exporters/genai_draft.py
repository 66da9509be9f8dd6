"""A DFlash checkpoint in the layout openvino-genai 2026.4.1's own DFlash path loads.

openvino-genai's DFlash pipeline (one request at a time, stateful SDPA draft) reads drafts exported by
optimum-intel 2.2.0: a stateful IR that persists only the committed context K/V and drops the seed row
from `last_hidden_state`. dflash's engine cannot run that layout (see docs/draft-format.md), but the
benchmarks run it in GenAI to compare against the same checkpoint.

optimum-intel selects this export from `config.architectures == ["DFlashDraftModel"]` (qwen3 backbone
only). Its CLI needs `--trust-remote-code`, and transformers' import check then demands diffusers and
einops for optimum's model_patcher.py; so the model class is subclassed outside `optimum.*` and exported
with `export_from_model`, which is the documented way around that check.
"""

from __future__ import annotations

from pathlib import Path

from dflash.core.errors import ModelFormatError
from dflash.exporters.draft_config import load_draft_config


def export_genai_stateful_draft(checkpoint: str | Path, output_dir: str | Path, *, compress_to_fp16: bool = True) -> Path:
    """Export the DFlash `checkpoint` folder with optimum-intel's stateful draft exporter into `output_dir`."""
    import openvino as ov
    import torch
    from optimum.exporters.openvino import export_from_model
    from optimum.exporters.openvino.model_patcher import Qwen3DFlashForCausalLM

    checkpoint, output_dir = Path(checkpoint), Path(output_dir)
    config = load_draft_config(checkpoint)
    model_type = config.raw.get("model_type")
    if config.kind != "dflash" or config.markov_rank or model_type != "qwen3":
        raise ModelFormatError(
            f"{checkpoint} is a {config.kind} draft (model_type {model_type}, markov_rank {config.markov_rank})",
            hint="openvino-genai's stateful DFlash path takes z-lab DFlash drafts with a qwen3 backbone only",
        )

    class _DFlashDraft(Qwen3DFlashForCausalLM):  # a class outside optimum.* (see the module docstring)
        pass

    model = _DFlashDraft.from_pretrained(checkpoint, dtype=torch.float32).eval()
    export_from_model(model, output_dir, task="text-generation-with-past")
    if compress_to_fp16:  # optimum keeps a model this small in f32; dflash's default drafts are fp16
        xml = output_dir / "openvino_model.xml"
        ir = ov.Core().read_model(xml)
        tmp = output_dir / "openvino_model.fp16.xml"
        ov.save_model(ir, tmp, compress_to_fp16=True)
        del ir
        tmp.replace(xml)
        tmp.with_suffix(".bin").replace(xml.with_suffix(".bin"))
    return output_dir
