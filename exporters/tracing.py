"""From PyTorch to OpenVINO: tracing a module and naming the ports of the converted model (shared by
the draft backbone and the Markov head exporters)."""

from __future__ import annotations

import warnings

import openvino as ov
import torch


def trace_and_convert(module: torch.nn.Module, example: tuple, inputs: list):
    """TorchScript-trace `module` on `example` and convert it with `inputs` as (shape, type) per input.

    Tracing here rather than inside `convert_model` skips the trace re-run check, which doubles the
    cost and only warns about the data-dependent shapes the mask computes on purpose.
    """
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarnings about shape arithmetic, jit deprecation notes
        traced = torch.jit.trace(module.eval(), example, check_trace=False)
        return ov.convert_model(traced, example_input=example, input=inputs)


def name_ports(ov_model, input_names: list[str], output_names: list[str]) -> None:
    """Give each input its tensor name and the same friendly name: SDPAToPagedAttention recognises
    `inputs_embeds` by the Parameter's friendly name, and a traced Parameter's is arbitrary."""
    for port, name in zip(ov_model.inputs, input_names, strict=True):
        port.get_tensor().set_names({name})
        port.get_node().set_friendly_name(name)
    for port, name in zip(ov_model.outputs, output_names, strict=True):
        port.get_tensor().set_names({name})
