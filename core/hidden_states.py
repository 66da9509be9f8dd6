"""Where each decoder layer's output lives in a target IR: the `hidden_states_decoder_layers` rt_info.

A DFlash/DSpark draft reads target hidden states, so the engine must add the outputs of chosen
decoder layers to the target graph. The exported target carries, as rt_info, one locator per layer:

    {"layers": {"<L>": {"producer": "<friendly name>", "output_index": <int>}}}   keys 0..N-1

Layer L is the output of decoder layer L (Hugging Face `hidden_states[L + 1]`); the last layer is the
post-final-norm value that feeds the lm_head. The format is optimum-intel's (2.2.0 writes it for the
qwen3 family only); dflash writes it for every target it exports.

Locators are friendly names, not graph positions: NNCF weight compression and the PagedAttention
transformation rewrite weights and attention but keep the activation ops and their names, so a
locator found on the pristine graph still resolves on the transformed one.

Two ways to find the layers:
- with the source PyTorch model (even a weightless meta-device skeleton), optimum-intel's own
  discovery, which knows the decoder-layer class from transformers;
- from the graph alone (`locate_hidden_states`): the decoder stack is the `__module.<path>.<i>` scope
  family the PyTorch frontend names ops after; layer L's output is the one hidden-width value that
  flows from scope L into scope L + 1, and the last layer's is the lm_head MatMul's activation input.
  The engine falls back to this when an IR has no annotation.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import openvino as ov

from dflash.core.errors import ExportError, ModelFormatError
from dflash.core.graph import find_lm_head

if TYPE_CHECKING:
    import torch

RT_INFO_KEY = "hidden_states_decoder_layers"

# layer id -> (producer friendly name, output index)
Locators = dict[int, tuple[str, int]]

# `__module.model.layers.3.self_attn.q_proj/aten::linear/MatMul` -> stack `__module.model.layers`, index 3.
# The first numeric path component is the decoder index (nested numbers such as MoE experts come later).
_SCOPE = re.compile(r"^(?P<stack>__module\.[^/]*?)\.(?P<index>\d+)(?=[./]|$)")

# Ops between the final norm and the lm_head that only pick rows or cast (logits_to_keep slicing).
_LM_HEAD_INPUT_OPS = {"Convert", "Slice", "StridedSlice"}

_REEXPORT_HINT = "re-export the target with `dflash export`, which annotates every decoder layer"


def annotate_hidden_states(
    model: ov.Model, num_layers: int, *, source_model: torch.nn.Module | None = None
) -> None:
    """Write the `hidden_states_decoder_layers` rt_info for the `num_layers` decoder layers of `model`.

    With `source_model` (the PyTorch model the IR was converted from; a meta-device skeleton is
    enough), optimum-intel's own discovery is tried first; the graph-only locator is the fallback.
    Raises ExportError when neither can locate every layer.
    """
    expected = list(range(num_layers))
    failures = []
    locators = None
    if source_model is not None:
        try:
            locators = _discover_with_optimum(model, source_model)
            if sorted(locators) != expected:
                failures.append(f"optimum-intel found {len(locators)} layers, the config says {num_layers}")
                locators = None
        except Exception as exc:  # noqa: BLE001 - any discovery failure leaves the graph locator to try
            failures.append(f"optimum-intel: {exc}")
    if locators is None:
        try:
            locators = locate_hidden_states(model, num_layers)
        except ModelFormatError as exc:
            failures.append(exc.message)
    if locators is None:
        raise ExportError(
            f"cannot locate the output of every decoder layer in the exported graph ({'; '.join(failures)})",
            "this architecture's graph layout is not supported for DFlash targets yet; "
            "report it with the model id",
        )
    write_hidden_state_locators(model, locators)


def write_hidden_state_locators(model: ov.Model, locators: Locators) -> None:
    """Store `locators` as the rt_info (compact JSON, keys in layer order)."""
    layers = {
        str(layer): {"producer": producer, "output_index": int(index)}
        for layer, (producer, index) in sorted(locators.items())
    }
    model.set_rt_info(json.dumps({"layers": layers}, separators=(",", ":")), RT_INFO_KEY)


def read_hidden_state_locators(model: ov.Model) -> Locators:
    """The layer locators of `model`: from its rt_info, or located from the graph when it has none.

    Raises ModelFormatError for a malformed annotation, or when the graph has none and the layers
    cannot be located.
    """
    if not model.has_rt_info(RT_INFO_KEY):
        return locate_hidden_states(model)
    raw = model.get_rt_info(RT_INFO_KEY)
    text = raw.astype(str) if isinstance(raw, ov.OVAny) else str(raw)
    try:
        layers = json.loads(text)["layers"]
        locators = {
            int(layer): (str(entry["producer"]), int(entry["output_index"]))
            for layer, entry in layers.items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelFormatError(
            f"the target's {RT_INFO_KEY} rt_info is malformed ({exc})", _REEXPORT_HINT
        ) from exc
    if sorted(locators) != list(range(len(locators))) or not locators:
        raise ModelFormatError(
            f"the target's {RT_INFO_KEY} rt_info has layers {sorted(locators)}, not 0..N-1", _REEXPORT_HINT
        )
    return locators


def num_decoder_layers(model: ov.Model) -> int:
    """How many decoder layers the target has (from its annotation, or located from the graph)."""
    return len(read_hidden_state_locators(model))


def hidden_state_outputs(model: ov.Model, layer_ids: Sequence[int]) -> list[ov.Output]:
    """The ov.Output of each layer in `layer_ids`, in that order, resolved by friendly name.

    Works on the exported IR and after NNCF compression or `paged_attention_transformation`; read
    the locators before transforming if the annotation might be dropped by your own passes.
    Raises ModelFormatError for a layer the target does not have or a producer that does not resolve
    to exactly one node.
    """
    locators = read_hidden_state_locators(model)
    nodes_by_name: dict[str, list[ov.Node]] = defaultdict(list)
    for op in model.get_ops():
        nodes_by_name[op.get_friendly_name()].append(op)

    outputs = []
    for layer in layer_ids:
        if layer not in locators:
            raise ModelFormatError(
                f"the target has no decoder layer {layer} (it has {len(locators)}: 0..{len(locators) - 1})",
                "use a draft trained for this target; its target_layer_ids must be layers of this target",
            )
        producer, index = locators[layer]
        nodes = nodes_by_name.get(producer, [])
        if len(nodes) != 1 or index >= nodes[0].get_output_size():
            found = f"{len(nodes)} nodes" if len(nodes) != 1 else f"a node without output {index}"
            raise ModelFormatError(
                f"hidden state of layer {layer} ({producer}:{index}) resolves to {found}", _REEXPORT_HINT
            )
        outputs.append(nodes[0].output(index))
    return outputs


def locate_hidden_states(model: ov.Model, num_layers: int | None = None) -> Locators:
    """Locate every decoder layer's output from the graph alone (no rt_info, no PyTorch model).

    `num_layers` pins the depth; without it, the depth is the decoder stack's contiguous layer count.
    Raises ModelFormatError when the layers cannot be located unambiguously.
    """
    final = _lm_head_input(model)
    hidden_size = _hidden_width(final)
    if hidden_size is None:
        raise ModelFormatError("the lm_head input has no static hidden width", _REEXPORT_HINT)

    name_counts = Counter(op.get_friendly_name() for op in model.get_ops())
    resolved = []
    for stack, layers in _decoder_stacks(model).items():
        depth = _contiguous_depth(layers)
        # A stack of another depth is not this decoder (or the caller's depth is wrong): a shorter
        # prefix of it would pair its last boundaries with the wrong final norm.
        if depth == 0 or (num_layers is not None and depth != num_layers):
            continue
        boundaries = [_boundary(layers[layer], stack, layer + 1, hidden_size) for layer in range(depth - 1)]
        if all(b is not None for b in boundaries):
            resolved.append(boundaries + [final])
    if len(resolved) != 1:
        raise ModelFormatError(
            f"found {len(resolved)} decoder stacks whose layer outputs resolve, expected exactly one",
            _REEXPORT_HINT,
        )

    locators = {
        layer: (out.get_node().get_friendly_name(), out.get_index()) for layer, out in enumerate(resolved[0])
    }
    ambiguous = [name for name, _ in locators.values() if name_counts[name] != 1]
    if ambiguous or len(set(locators.values())) != len(locators):
        raise ModelFormatError(
            f"decoder layer outputs have non-unique names ({', '.join(ambiguous) or 'shared producers'})",
            _REEXPORT_HINT,
        )
    return locators


def _discover_with_optimum(model: ov.Model, source_model: Any) -> Locators:
    """optimum-intel 2.2.0's hidden-state discovery, applied to any family (it gates it to qwen3 itself)."""
    from optimum.exporters.openvino.utils_annotations import discover_hidden_state_rt_info

    decoder_config = source_model.config.get_text_config()
    annotation = discover_hidden_state_rt_info(source_model, model, decoder_config)
    return {
        int(layer): (entry["producer"], int(entry["output_index"]))
        for layer, entry in annotation["layers"].items()
    }


def _lm_head_input(model: ov.Model) -> ov.Output:
    """The post-final-norm value: the activation input of the MatMul that produces the logits."""
    matmul, port = find_lm_head(model)
    hidden = matmul.input_value(port)
    while hidden.get_node().get_type_name() in _LM_HEAD_INPUT_OPS:
        hidden = hidden.get_node().input_value(0)
    return hidden


def _rank(output: ov.Output) -> int | None:
    rank = output.get_partial_shape().rank
    return rank.get_length() if rank.is_static else None


def _hidden_width(output: ov.Output) -> int | None:
    shape = output.get_partial_shape()
    if _rank(output) != 3 or shape[2].is_dynamic:
        return None
    return shape[2].get_length()


def _scope(name: str) -> tuple[str, int] | None:
    match = _SCOPE.match(name)
    return (match["stack"], int(match["index"])) if match else None


def _decoder_stacks(model: ov.Model) -> dict[str, dict[int, list[ov.Node]]]:
    """Ops grouped by numbered module scope: stack path -> layer index -> ops in that layer."""
    stacks: dict[str, dict[int, list[ov.Node]]] = defaultdict(lambda: defaultdict(list))
    for op in model.get_ordered_ops():
        scope = _scope(op.get_friendly_name())
        if scope is not None:
            stacks[scope[0]][scope[1]].append(op)
    return stacks


def _contiguous_depth(layers: dict[int, list[ov.Node]]) -> int:
    depth = 0
    while depth in layers:
        depth += 1
    return depth


def _boundary(ops: list[ov.Node], stack: str, next_layer: int, hidden_size: int) -> ov.Output | None:
    """The one hidden-width value produced in a layer and consumed by the next layer of `stack`."""
    crossing = []
    for op in ops:
        for output in op.outputs():
            if _hidden_width(output) != hidden_size:
                continue
            consumers = (target.get_node().get_friendly_name() for target in output.get_target_inputs())
            if any(_scope(name) == (stack, next_layer) for name in consumers):
                crossing.append(output)
    return crossing[0] if len(crossing) == 1 else None
