"""PagedAttention: convert a stateful SDPA model to a PagedAttention (PA) model, and feed it.

OpenVINO's `paged_attention_transformation` replaces every ScaledDotProductAttention of a stateful
model by a `PagedAttentionExtension` op that reads and writes its keys/values in caller-owned block
caches (`key_cache.{i}`, `value_cache.{i}`). After it, the model works on a flat batch of T rows
packed from several sequences ("batch = tokens"), described by five i32 inputs:

    past_lens             [num_seqs]     rows already cached per sequence
    subsequence_begins    [num_seqs + 1] where each sequence's new rows start in the packed batch
    block_indices         [num_blocks]   physical cache blocks, per sequence in logical order
    block_indices_begins  [num_seqs + 1] where each sequence's blocks start in `block_indices`
    max_context_len       []             max over sequences of past_len + new rows

This module does only that: the conversion (`to_paged_attention`), what it produced
(`PagedModelInfo`), the cache layout a compiled model asks for (`read_kv_cache_layout`,
`allocate_kv_caches`) and the packing of those inputs (`pack_paged_inputs`, `fit_to_input`) into an
infer request's own tensors (`RequestTensors`).
Which rows run, and which blocks they own, is the engine's business.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import openvino as ov

from dflash.core.errors import ExportError, ModelFormatError

PAGED_OP = "PagedAttentionExtension"
SDPA_OP = "ScaledDotProductAttention"

# Input ports of PagedAttentionExtension (openvino 2026.4.1 has 28) that this module reads.
PA_KEY_CACHE = 3
PA_VALUE_CACHE = 4
PA_SLIDING_WINDOW = 10
PA_TOKEN_TYPE_IDS = 25

# The inputs the transformation adds besides the caches; `pack_paged_inputs` builds all of them.
PAGING_INPUTS = ("past_lens", "subsequence_begins", "block_indices", "block_indices_begins", "max_context_len")
TOKEN_TYPE_IDS = "token_type_ids"


# ---------------------------------------------------------------------------------------------
# Conversion


@dataclass(frozen=True)
class PagedLayerInfo:
    """One PagedAttention op of a converted model (one attention layer)."""

    key_cache: str  # name of the model input holding this layer's key cache, "key_cache.{i}"
    value_cache: str
    token_type_ids_wired: bool  # PA input 25 is fed by the `token_type_ids` model input
    sliding_window: int  # PA input 10; 0 = full attention
    num_kv_heads: int
    key_head_size: int
    value_head_size: int


@dataclass(frozen=True)
class PagedModelInfo:
    """What `paged_attention_transformation` made of a model."""

    layers: list[PagedLayerInfo]  # in the order of the cache inputs (key_cache.0, key_cache.1, ...)
    other_inputs: list[str]  # model inputs besides the paging inputs and caches: input_ids, hidden_states, ...

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def token_type_ids_wired(self) -> list[bool]:
        return [layer.token_type_ids_wired for layer in self.layers]

    @property
    def sliding_windows(self) -> list[int]:
        return [layer.sliding_window for layer in self.layers]


def to_paged_attention(model: ov.Model) -> PagedModelInfo:
    """Convert a stateful SDPA model to PagedAttention in place and describe the result.

    Raises ModelFormatError when the model is not stateful or has no SDPA op to convert, and
    ExportError when OpenVINO's transformation fails or leaves some attention unconverted.
    """
    from openvino._offline_transformations import paged_attention_transformation

    if _count_ops(model, PAGED_OP):
        raise ModelFormatError(
            "model is already converted to PagedAttention",
            hint="pass the stateful model as exported (openvino_model.xml), not a converted one",
        )
    if not model.get_variables():
        raise ModelFormatError(
            "model is not stateful: it has no KV-cache state variables",
            hint="export it with the stateful text-generation-with-past task (dflash export does)",
        )
    num_sdpa = _count_ops(model, SDPA_OP)
    if num_sdpa == 0:
        raise ModelFormatError(
            "model has no ScaledDotProductAttention op to convert to PagedAttention",
            hint="export it with SDPA attention (the default of dflash export / optimum-intel)",
        )
    try:
        paged_attention_transformation(model)
    except RuntimeError as err:  # OpenVINO reports graph failures as RuntimeError
        first_line = str(err).strip().splitlines()[-1] if str(err).strip() else repr(err)
        raise ExportError(
            f"PagedAttention conversion failed: {first_line}",
            hint="the model's attention does not match OpenVINO's SDPA pattern; re-export it with dflash export",
        ) from err

    num_paged = _count_ops(model, PAGED_OP)
    if num_paged != num_sdpa or _count_ops(model, SDPA_OP):
        raise ExportError(
            f"PagedAttention conversion converted {num_paged} of {num_sdpa} attention ops",
            hint="some attention layers do not match OpenVINO's SDPA pattern; re-export the model",
        )
    return describe_paged_model(model)


def describe_paged_model(model: ov.Model) -> PagedModelInfo:
    """Describe a model that `paged_attention_transformation` has already converted."""
    paged_ops = [op for op in model.get_ordered_ops() if op.get_type_name() == PAGED_OP]
    if not paged_ops:
        raise ModelFormatError(
            "model has no PagedAttention op", hint="convert it with to_paged_attention first"
        )
    layers = [_describe_layer(op) for op in paged_ops]
    layers.sort(key=lambda layer: _cache_index(layer.key_cache))

    cache_names = {name for layer in layers for name in (layer.key_cache, layer.value_cache)}
    other = [
        port.get_any_name()
        for port in model.inputs
        if port.get_any_name() not in cache_names and port.get_any_name() not in PAGING_INPUTS
    ]
    return PagedModelInfo(layers=layers, other_inputs=other)


def _describe_layer(op: ov.Node) -> PagedLayerInfo:
    rt_info = op.get_rt_info()

    def head_attr(key: str) -> int:
        # The transformation records head counts and sizes on each PA op.
        return int(rt_info[key].value) if key in rt_info.keys() else 0

    return PagedLayerInfo(
        key_cache=_producer_name(op, PA_KEY_CACHE),
        value_cache=_producer_name(op, PA_VALUE_CACHE),
        token_type_ids_wired=_reaches_parameter(op.input_value(PA_TOKEN_TYPE_IDS), TOKEN_TYPE_IDS),
        sliding_window=_sliding_window(op),
        num_kv_heads=head_attr("num_k_heads"),
        key_head_size=head_attr("k_head_size"),
        value_head_size=head_attr("v_head_size"),
    )


def _producer_name(op: ov.Node, port: int) -> str:
    return op.input_value(port).get_any_name()


def _cache_index(name: str) -> int:
    # "key_cache.12" -> 12; the transformation numbers layers in graph order.
    return int(name.rsplit(".", 1)[-1])


def _count_ops(model: ov.Model, type_name: str) -> int:
    return sum(1 for op in model.get_ops() if op.get_type_name() == type_name)


def _reaches_parameter(source: ov.Output, name: str) -> bool:
    """Whether a model Parameter called `name` is among the producers upstream of `source`."""
    stack, seen = [source.get_node()], set()
    while stack:
        node = stack.pop()
        if node.get_instance_id() in seen:
            continue
        seen.add(node.get_instance_id())
        if node.get_type_name() == "Parameter" and name in node.output(0).get_names():
            return True
        stack.extend(value.get_node() for value in node.input_values())
    return False


def _sliding_window(op: ov.Node) -> int:
    """PA input 10 as a number: a Constant, or a constant subgraph (e.g. Multiply(-8, -1)) folded here."""
    value = _fold_constant(op.input_value(PA_SLIDING_WINDOW))
    if value is None:
        raise ExportError(
            f"sliding window of {op.get_friendly_name()} is not a constant",
            hint="re-export the model; OpenVINO needs a constant window per layer",
        )
    return int(np.asarray(value).reshape(-1)[0]) if np.asarray(value).size else 0


def _fold_constant(source: ov.Output) -> np.ndarray | None:
    """Evaluate a parameter-free subgraph on the host; None when it depends on a model input."""
    node = source.get_node()
    if node.get_type_name() == "Constant":
        return node.get_data()
    if node.get_type_name() in ("Parameter", "ReadValue"):
        return None
    inputs = []
    for value in node.input_values():
        folded = _fold_constant(value)
        if folded is None:
            return None
        inputs.append(ov.Tensor(np.ascontiguousarray(folded)))
    if any(node.get_output_partial_shape(i).is_dynamic for i in range(node.get_output_size())):
        return None
    outputs = [
        ov.Tensor(node.get_output_element_type(i), node.get_output_shape(i))
        for i in range(node.get_output_size())
    ]
    if not node.evaluate(outputs, inputs):
        return None
    return outputs[source.get_index()].data.copy()


# ---------------------------------------------------------------------------------------------
# KV cache layout of a compiled model


@dataclass(frozen=True)
class KVCacheLayerLayout:
    """The caches of one layer, as the compiled model wants them: [num_blocks, *key_block_shape]."""

    key_name: str
    value_name: str
    key_type: ov.Type
    value_type: ov.Type
    key_block_shape: tuple[int, ...]  # [kv_heads, kv_block_size (+ 8 for u8 by-channel keys), head_size]
    value_block_shape: tuple[int, ...]  # [kv_heads, kv_block_size, head_size (+ scale/zero-point when quantized)]
    key_head_size: int
    value_head_size: int

    @property
    def num_kv_heads(self) -> int:
        return self.value_block_shape[0]

    @property
    def kv_block_size(self) -> int:
        # The value cache: a quantized key cache stores per-channel scales on the block axis.
        return self.value_block_shape[1]

    @property
    def bytes_per_block(self) -> int:
        key_bits = int(np.prod(self.key_block_shape)) * self.key_type.bitwidth
        value_bits = int(np.prod(self.value_block_shape)) * self.value_type.bitwidth
        return (key_bits + value_bits + 7) // 8


@dataclass(frozen=True)
class KVCacheLayout:
    """The block caches a compiled PagedAttention model needs, one entry per layer."""

    layers: list[KVCacheLayerLayout]
    kv_block_size: int  # tokens per block, the same for every layer

    @property
    def bytes_per_block(self) -> int:
        """Memory one block id costs across all layers (keys and values)."""
        return sum(layer.bytes_per_block for layer in self.layers)


def read_kv_cache_layout(compiled: ov.CompiledModel) -> KVCacheLayout:
    """Read cache element types and shapes from a compiled PA model (they depend on device and hints).

    The CPU uses [num_blocks, kv_heads, kv_block_size, head_size] with kv_block_size 32 today, but a u8 key
    cache has kv_block_size + 8 rows (per-channel scale and zero-point), so the block size is read from
    the value cache.
    """
    names = {name for port in compiled.inputs for name in port.get_names()}
    num_layers = sum(1 for name in names if name.startswith("key_cache."))
    if num_layers == 0:
        raise ModelFormatError(
            "compiled model has no key_cache inputs", hint="convert it with to_paged_attention before compiling"
        )
    layers = [_read_layer_layout(compiled, i) for i in range(num_layers)]
    kv_block_sizes = {layer.kv_block_size for layer in layers}
    if len(kv_block_sizes) != 1:
        raise ModelFormatError(
            f"compiled model mixes cache block sizes {sorted(kv_block_sizes)}",
            hint="this engine needs one block size for all layers",
        )
    return KVCacheLayout(layers=layers, kv_block_size=kv_block_sizes.pop())


def _read_layer_layout(compiled: ov.CompiledModel, index: int) -> KVCacheLayerLayout:
    key = compiled.input(f"key_cache.{index}")
    value = compiled.input(f"value_cache.{index}")
    key_shape, value_shape = key.get_partial_shape(), value.get_partial_shape()
    if key_shape.rank.get_length() != 4 or key_shape[1:].is_dynamic or value_shape[1:].is_dynamic:
        raise ModelFormatError(
            f"cache shapes of layer {index} are not set by the compiled model: {key_shape}, {value_shape}",
            hint="compile the PagedAttention model on a device that supports it (CPU, GPU)",
        )
    key_block = tuple(d.get_length() for d in key_shape[1:])
    value_block = tuple(d.get_length() for d in value_shape[1:])
    return KVCacheLayerLayout(
        key_name=f"key_cache.{index}",
        value_name=f"value_cache.{index}",
        key_type=key.get_element_type(),
        value_type=value.get_element_type(),
        key_block_shape=key_block,
        value_block_shape=value_block,
        key_head_size=key_block[2],  # quantized keys keep their scales on the block axis
        value_head_size=_value_head_size(compiled, value.get_element_type(), value_block[2]),
    )


def _value_head_size(compiled: ov.CompiledModel, elem_type: ov.Type, last_dim: int) -> int:
    """Undo the CPU's by-token value quantization: each group of a row carries an f32 scale and zero-point."""
    if elem_type.is_real():
        return last_dim
    extra_per_group = 64 // elem_type.bitwidth  # 2 x f32 = 64 bits, in elements of the cache type
    group = int(compiled.get_property("VALUE_CACHE_GROUP_SIZE") or 0)
    if group == 0:  # one group per head
        return last_dim - extra_per_group
    return last_dim * group // (group + extra_per_group)


def allocate_kv_caches(layout: KVCacheLayout, num_blocks: int) -> dict[str, ov.Tensor]:
    """Allocate zeroed caches of `num_blocks` blocks per layer, keyed by model input name.

    Allocate once and `request.set_tensor(name, tensor)` each: the plugin writes new keys/values into
    these tensors in place, so they must live as long as the request.
    """
    caches = {}
    for layer in layout.layers:
        for name, elem_type, block_shape in (
            (layer.key_name, layer.key_type, layer.key_block_shape),
            (layer.value_name, layer.value_type, layer.value_block_shape),
        ):
            tensor = ov.Tensor(elem_type, ov.Shape([num_blocks, *block_shape]))
            np.frombuffer(tensor.data.data, dtype=np.uint8)[:] = 0  # bytes, so sub-byte types work too
            caches[name] = tensor
    return caches


# ---------------------------------------------------------------------------------------------
# Packing one call


@dataclass(frozen=True)
class SequenceSlice:
    """One sequence's share of a PagedAttention call."""

    past_len: int  # rows of this sequence already in the cache; cached rows beyond it get overwritten
    num_new_rows: int  # rows this call adds, at positions past_len .. past_len + num_new_rows - 1
    block_table: list[int]  # physical block ids in logical order; may hold more than this call needs

    def num_blocks(self, kv_block_size: int) -> int:
        return -(-(self.past_len + self.num_new_rows) // kv_block_size)


def pack_paged_inputs(seqs: list[SequenceSlice], kv_block_size: int) -> dict[str, np.ndarray]:
    """Build the five paging inputs (all i32) for sequences whose new rows are packed in this order."""
    if not seqs:
        raise ValueError("a PagedAttention call needs at least one sequence")
    past_lens, row_begins, block_indices, block_begins = [], [0], [], [0]
    for seq in seqs:
        if seq.num_new_rows <= 0 or seq.past_len < 0:
            raise ValueError(f"bad sequence slice {seq}: needs past_len >= 0 and num_new_rows > 0")
        needed = seq.num_blocks(kv_block_size)
        if len(seq.block_table) < needed:
            raise ValueError(
                f"block table of {len(seq.block_table)} blocks cannot hold "
                f"{seq.past_len + seq.num_new_rows} rows of block size {kv_block_size}"
            )
        past_lens.append(seq.past_len)
        row_begins.append(row_begins[-1] + seq.num_new_rows)
        block_indices.extend(seq.block_table[:needed])
        block_begins.append(len(block_indices))
    return {
        "past_lens": np.array(past_lens, dtype=np.int32),  # [num_seqs]
        "subsequence_begins": np.array(row_begins, dtype=np.int32),  # [num_seqs + 1]
        "block_indices": np.array(block_indices, dtype=np.int32),  # [num_blocks_used]
        "block_indices_begins": np.array(block_begins, dtype=np.int32),  # [num_seqs + 1]
        "max_context_len": np.array(max(s.past_len + s.num_new_rows for s in seqs), dtype=np.int32),  # []
    }


def packed_positions(seqs: list[SequenceSlice]) -> np.ndarray:
    """Absolute positions of the packed rows, past_len onward per sequence. # [num_tokens] i64"""
    return np.array([p for s in seqs for p in range(s.past_len, s.past_len + s.num_new_rows)], dtype=np.int64)


def fit_to_input(port: ov.ConstOutput | ov.Output, rows: np.ndarray) -> np.ndarray:
    """Reshape a packed [T, ...] array to the rank `port` expects and cast it to its element type.

    After the transformation the row inputs disagree on rank: input_ids and position_ids are [T],
    inputs_embeds [T, H], while inputs the transformation leaves alone keep their exported rank with
    batch = T, e.g. hidden_states [T, 1, k*H] and token_type_ids [T, 1]. Size-1 axes are added (or
    removed) right after the row axis.
    """
    rank = port.get_partial_shape().rank.get_length()
    shaped = _fit_rank(rows, rank)
    if shaped is None:
        raise ValueError(f"cannot fit rows of shape {rows.shape} to {port.get_any_name()} of rank {rank}")
    elem_type = port.get_element_type()
    dtype = shaped.dtype if elem_type.is_dynamic() else elem_type.to_dtype()
    return np.ascontiguousarray(shaped, dtype=dtype)


def _fit_rank(rows: np.ndarray, rank: int) -> np.ndarray | None:
    """`rows` with size-1 axes added or removed after the row axis to make `rank`; None if it cannot."""
    shaped = rows
    while shaped.ndim < rank:
        shaped = np.expand_dims(shaped, 1)
    while shaped.ndim > rank:
        if shaped.shape[1] != 1:
            return None
        shaped = shaped.squeeze(1)
    return shaped


class RequestTensors:
    """An infer request's own tensors: inputs reshaped and filled in place, outputs read in place.

    Handing infer() fresh numpy arrays makes OpenVINO convert and bind each of them on every call,
    which costs more than packing them; the request's own tensors keep their memory from call to
    call (it grows when a call needs more), so a call only sets each shape and copies the values in.
    Values are fitted to each input's rank and cast to its element type as `fit_to_input` does.
    The tensor objects are looked up once: the plugin resizes them in place (a lookup by name scans
    every port, the caches included, and costs more than the packing). An input whose shape did not
    change since the previous call is written through the numpy view of that call.
    """

    def __init__(self, request: ov.InferRequest, compiled: ov.CompiledModel):
        self._request = request
        self._ranks = {port.get_any_name(): port.get_partial_shape().rank.get_length() for port in compiled.inputs}
        self._tensors: dict[str, ov.Tensor] = {}
        self._input_views: dict[str, np.ndarray] = {}  # each input's memory as of its latest shape

    def _tensor(self, name: str) -> ov.Tensor:
        tensor = self._tensors.get(name)
        if tensor is None:
            tensor = self._tensors[name] = self._request.get_tensor(name)
        return tensor

    def write(self, name: str, values: np.ndarray) -> None:
        shaped = _fit_rank(values, self._ranks[name])
        if shaped is None:
            raise ValueError(f"cannot fit rows of shape {values.shape} to {name} of rank {self._ranks[name]}")
        view = self._input_views.get(name)
        if view is None or view.shape != shaped.shape:  # a new shape may move the tensor's memory
            tensor = self._tensor(name)
            tensor.shape = shaped.shape
            view = self._input_views[name] = tensor.data
        view[...] = shaped

    def read(self, name: str) -> np.ndarray:
        """An output of the latest inference, as a view (valid until the next inference)."""
        return self._tensor(name).data
