"""Graph edits the engine makes to an exported model before compiling it.

- `insert_logits_gather`: a Gather before the lm_head MatMul, so logits are computed only for the rows
  that sample (a prompt chunk of 500 rows needs one row of logits, not 500 x vocabulary).
- `add_hidden_states_output`: the target's decoder-layer outputs that a DFlash draft reads, concatenated
  in `target_layer_ids` order as one extra result.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from .errors import ModelFormatError

SAMPLED_ROWS_INPUT = "sampled_tokens_indices"
HIDDEN_STATES_OUTPUT = "target_hidden_states"

# Ops between the lm_head MatMul and the `logits` result that keep the row layout
# (precision casts, logit scaling or soft-capping by a constant).
_LOGITS_TAIL_OPS = {"Convert", "Multiply", "Divide", "Tanh", "Add"}

_REEXPORT_HINT = "re-export the model with `dflash export`"


def logits_output(model: ov.Model) -> ov.Output:
    for output in model.outputs:
        if "logits" in output.get_names():
            return output
    if len(model.outputs) == 1:
        return model.outputs[0]
    raise ModelFormatError("the model has no `logits` output", _REEXPORT_HINT)


def find_lm_head(model: ov.Model) -> tuple[ov.Node, int]:
    """The MatMul that produces the logits, and which of its inputs is the hidden-state activation."""
    value = logits_output(model).get_node().input_value(0)
    while value.get_node().get_type_name() in _LOGITS_TAIL_OPS:
        non_constant = [v for v in value.get_node().input_values() if v.get_node().get_type_name() != "Constant"]
        if len(non_constant) != 1:
            break
        value = non_constant[0]
    matmul = value.get_node()
    if matmul.get_type_name() != "MatMul":
        raise ModelFormatError("cannot find the lm_head MatMul that produces the logits", _REEXPORT_HINT)
    # The weight operand is a Constant or its decompression chain (rank 2); the activation is not.
    ranks = [v.get_partial_shape().rank for v in matmul.input_values()]
    activation = [i for i, rank in enumerate(ranks) if rank.is_dynamic or rank.get_length() != 2]
    if len(activation) != 1:
        raise ModelFormatError("the lm_head MatMul has no single activation input", _REEXPORT_HINT)
    return matmul, activation[0]


def insert_logits_gather(model: ov.Model) -> str:
    """Compute logits only for the rows listed in a new i64 input `sampled_tokens_indices`.

    Call after `paged_attention_transformation`: rows are then the packed batch axis (axis 0).
    Returns the new input's name.
    """
    matmul, port = find_lm_head(model)
    indices = ops.parameter(ov.PartialShape([-1]), ov.Type.i64, name=SAMPLED_ROWS_INPUT)
    indices.output(0).set_names({SAMPLED_ROWS_INPUT})
    activation = matmul.input_value(port)
    gathered = ops.gather(activation, indices, ops.constant(np.int64(0)))
    matmul.input(port).replace_source_output(gathered.output(0))
    model.add_parameters([indices])
    model.validate_nodes_and_infer_types()
    return SAMPLED_ROWS_INPUT


def add_hidden_states_output(
    model: ov.Model, layer_outputs: Sequence[ov.Output], element_type: ov.Type | None = None
) -> str:
    """One extra result: the given layer outputs concatenated on the last axis. Returns its name.

    element_type: the result's type, when it should not be the graph's (f32). Give the plugin's 16-bit
    inference precision: the CPU plugin keeps every op upstream of an f32 result in f32 up to the
    nearest MatMul, and the residual stream links each tapped layer down to the embedding, so an f32
    tap kept the whole residual stream of a bf16 target in f32 (a reorder around every MatMul, +3% a
    step) and made it compute differently from the same target without the tap.
    """
    if not layer_outputs:
        raise ValueError("no hidden-state layers to expose")
    if element_type is not None:
        layer_outputs = [ops.convert(output, element_type).output(0) for output in layer_outputs]
    value = layer_outputs[0] if len(layer_outputs) == 1 else ops.concat(list(layer_outputs), -1).output(0)
    result = ops.result(value)
    result.output(0).set_names({HIDDEN_STATES_OUTPUT})
    model.add_results([result])
    return HIDDEN_STATES_OUTPUT


# ---- grafting the target's embedding and lm_head onto a draft ---------------------------------------
#
# A DFlash draft has neither: it reads target embeddings and its hidden states go through the
# target's lm_head. Only the WEIGHT subgraphs move over (a Constant, or a Constant with its int8/int4
# decompression chain), so compressed weights stay compressed and no other target op comes along.
# The target model passed in is a throwaway copy (read it again for the graft): its weight
# subgraphs are detached from it and wired into the draft.

DRAFT_TOKEN_INPUT = "input_ids"
DRAFT_LOGITS_OUTPUT = "logits"


def take_weight_subgraph(consumer_input: ov.Input) -> ov.Output:
    """Detach the parameter-free subgraph feeding `consumer_input` from its model and return it."""
    weight = consumer_input.get_source_output()
    _require_parameter_free(weight.get_node())
    # The throwaway model keeps a placeholder, so the subgraph's only consumers are the draft's.
    consumer_input.replace_source_output(ops.constant(np.zeros([1], dtype=np.float32)).output(0))
    return weight


def _require_parameter_free(node: ov.Node) -> None:
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current.get_instance_id() in seen:
            continue
        seen.add(current.get_instance_id())
        if current.get_type_name() in ("Parameter", "ReadValue"):
            raise ModelFormatError("a target weight depends on a model input; cannot graft it", _REEXPORT_HINT)
        stack.extend(value.get_node() for value in current.input_values())


def find_embedding_gather(target: ov.Model) -> ov.Node:
    """The Gather that looks `input_ids` up in the embedding table."""
    ids = next((p for p in target.get_parameters() if "input_ids" in p.output(0).get_names()), None)
    if ids is None:
        raise ModelFormatError("the target has no input_ids input", _REEXPORT_HINT)
    stack = [ids.output(0)]
    while stack:  # forward through casts/reshapes of input_ids to the Gather that uses them as indices
        value = stack.pop()
        for target_input in value.get_target_inputs():
            consumer = target_input.get_node()
            if consumer.get_type_name() == "Gather" and target_input.get_index() == 1:
                return consumer
            if consumer.get_type_name() in ("Convert", "Reshape", "Unsqueeze", "Squeeze"):
                stack.append(consumer.output(0))
    raise ModelFormatError("cannot find the target's embedding lookup", _REEXPORT_HINT)


def graft_embedding(draft: ov.Model, target: ov.Model) -> None:
    """Replace the draft's `inputs_embeds` input by the target's embedding lookup of a new `input_ids`."""
    embeds = next((p for p in draft.get_parameters() if "inputs_embeds" in p.output(0).get_names()), None)
    if embeds is None:
        raise ModelFormatError("the draft has no inputs_embeds input", "re-export the draft with `dflash export`")
    gather = find_embedding_gather(target)
    axis = gather.input_value(2)
    table = take_weight_subgraph(gather.input(0))
    ids = ops.parameter(ov.PartialShape([-1, -1]), ov.Type.i64, name=DRAFT_TOKEN_INPUT)
    ids.output(0).set_names({DRAFT_TOKEN_INPUT})
    lookup = ops.gather(table, ids, ops.constant(np.int64(0)) if axis.get_node().get_type_name() != "Constant" else axis)
    if lookup.get_element_type() != embeds.get_element_type():
        lookup = ops.convert(lookup, embeds.get_element_type())
    for consumer in list(embeds.output(0).get_target_inputs()):
        consumer.replace_source_output(lookup.output(0))
    draft.remove_parameter(embeds)
    draft.add_parameters([ids])
    draft.validate_nodes_and_infer_types()


def graft_lm_head(draft: ov.Model, target: ov.Model, vocab_ids: np.ndarray | None = None) -> None:
    """A `logits` output in place of last_hidden_state: the draft's hidden states through the target's lm_head.

    With `vocab_ids` (target token ids), the logits cover only those tokens, in that order: the lm_head's
    weight rows are cut to them (see `restrict_weight_rows`), so a draft row costs |vocab_ids| x hidden
    multiply-adds instead of the whole vocabulary's.
    """
    matmul, activation_port = find_lm_head(target)
    attrs = matmul.get_attributes()
    weight = take_weight_subgraph(matmul.input(1 - activation_port))
    if vocab_ids is not None:
        if activation_port != 0:
            raise ModelFormatError("the target's lm_head takes its weight first; cannot cut its vocabulary", _REEXPORT_HINT)
        vocab_axis = 0 if attrs["transpose_b"] else 1
        weight = restrict_weight_rows(weight, np.asarray(vocab_ids, dtype=np.int64), vocab_axis)
    hidden = next(o for o in draft.outputs if "last_hidden_state" in o.get_names())
    hidden_source = hidden.get_node().input_value(0)
    operands = (hidden_source, weight) if activation_port == 0 else (weight, hidden_source)
    logits = ops.matmul(*operands, attrs["transpose_a"], attrs["transpose_b"])
    result = ops.result(logits)
    result.output(0).set_names({DRAFT_LOGITS_OUTPUT})
    draft.add_results([result])
    draft.remove_result(hidden.get_node())
    draft.validate_nodes_and_infer_types()


def restrict_weight_rows(weight: ov.Output, ids: np.ndarray, axis: int) -> ov.Output:
    """A copy of a weight subgraph that keeps only `ids` along `axis` (the vocabulary axis).

    The constants are cut, not the decompressed weight: an int8 weight stays int8, its per-row scales and
    zero points are cut alike, and no Gather runs at inference. The copy leaves the original untouched
    (a tied embedding table keeps its whole vocabulary). A chain of other ops (e.g. group-wise int4
    reshapes) gets a Gather of the decompressed rows instead, correct but computed at every inference.
    """
    vocab = weight.get_partial_shape()[axis].get_length()

    def cut(value: ov.Output) -> ov.Output | None:
        node, kind = value.get_node(), value.get_node().get_type_name()
        if kind == "Constant":
            if node.get_element_type().bitwidth < 8 or node.get_element_type() == ov.Type.bf16:
                return None
            data = node.get_data()
            if data.ndim > axis and data.shape[axis] == vocab:
                return ops.constant(np.take(data, ids, axis=axis)).output(0)
            return value  # a scalar or broadcast constant (e.g. one zero point for all rows)
        inputs = [cut(v) for v in node.input_values()]
        if any(v is None for v in inputs):
            return None
        if kind == "Convert":
            return ops.convert(inputs[0], node.get_destination_type()).output(0)
        if kind in ("Subtract", "Multiply", "Add"):
            return getattr(ops, kind.lower())(*inputs).output(0)
        return None

    cut_weight = cut(weight)
    if cut_weight is None:
        return ops.gather(weight, ops.constant(ids), ops.constant(np.int64(axis))).output(0)
    return cut_weight
