"""The target model on PagedAttention: load, transform, compile, and run one packed inference per step.

The runner never decides who runs: it gets the step's sequences (past length, new rows, block table)
and their token ids, and returns logits for the rows that sample plus, when a draft needs them, the
target hidden states of every row. A hybrid target (Qwen3.5: linear-attention layers beside attention
ones) also gets its `la.*` inputs, packed by its cache manager (core/hybrid_cache.py), and owns the
state tables they index (core/state_pool.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import openvino as ov

from .config import compile_properties
from .errors import InputError
from .graph import HIDDEN_STATES_OUTPUT, SAMPLED_ROWS_INPUT, add_hidden_states_output, insert_logits_gather
from .paged import (
    KVCacheLayout,
    RequestTensors,
    SequenceSlice,
    allocate_kv_caches,
    pack_paged_inputs,
    packed_positions,
    read_kv_cache_layout,
    to_paged_attention,
)
from .state_pool import StateTables, state_table_names

MODEL_FILE = "openvino_model.xml"


@dataclass
class StepInputs:
    """One packed inference: sequences in order, their new rows' token ids, the rows that sample."""

    seqs: list[SequenceSlice]
    token_ids: np.ndarray  # [num_tokens] i64
    sample_rows: np.ndarray  # [num_sampled] i64, indices into the packed rows
    state_inputs: dict[str, np.ndarray] = field(default_factory=dict)  # la.* of a hybrid target, else empty


@dataclass
class StepOutputs:
    """What one target inference returns. `logits` is a view of the request's output tensor, valid
    until the next inference (read it, or copy what must outlive the step); `hidden_states` is a copy."""

    logits: np.ndarray  # [num_sampled, vocab] f32
    hidden_states: np.ndarray | None  # [num_tokens, k * hidden] f32, when hidden layers were requested


def pack_target_rows(scheduled: Sequence[tuple], block_table: Callable[[str], list[int]],
                     state_inputs: Callable[[list], dict[str, np.ndarray]] | None = None) -> StepInputs:  # fmt: skip
    """The scheduled rows of every request, in order, as one PagedAttention call.

    scheduled: (ScheduledRequest, Request) pairs; a request's rows are its committed tokens and then
    its candidates from `num_computed_tokens_before` on, and the last `num_sampled_rows` of them sample.
    state_inputs: the cache manager's packing of linear-attention state (a hybrid target's `la.*`).
    """
    seqs, token_ids, sample_rows = [], [], []
    for s, request in scheduled:
        start = s.num_computed_tokens_before
        first_row = len(token_ids)
        token_ids.extend(request.token_ids_with_spec(start, start + s.num_new_tokens))
        if s.samples:
            last_row = first_row + s.num_new_tokens
            sample_rows.extend(range(last_row - s.num_sampled_rows, last_row))
        seqs.append(SequenceSlice(start, s.num_new_tokens, block_table(s.req_id)))
    return StepInputs(
        seqs=seqs,
        token_ids=np.asarray(token_ids, dtype=np.int64),  # [num_tokens]
        sample_rows=np.asarray(sample_rows, dtype=np.int64),  # [num_sampled]
        state_inputs=state_inputs([s for s, _ in scheduled]) if state_inputs is not None else {},
    )


_HALF_PRECISIONS = {"bf16": ov.Type.bf16, "bfloat16": ov.Type.bf16, "f16": ov.Type.f16, "fp16": ov.Type.f16}


def half_inference_precision(device: str, ov_config: dict[str, str] | None) -> ov.Type | None:
    """The 16-bit precision `device` will infer in under `ov_config` (bf16 or f16), else None (f32)."""
    hint = (ov_config or {}).get("INFERENCE_PRECISION_HINT")
    if hint is not None:
        return _HALF_PRECISIONS.get(str(hint).lower())
    try:
        default = ov.Core().get_property(device, "INFERENCE_PRECISION_HINT")
    except RuntimeError:  # a device without the property (AUTO, HETERO): keep the f32 tap
        return None
    return default if default in (ov.Type.bf16, ov.Type.f16) else None


def widen_to_f32(values: np.ndarray, element_type: ov.Type) -> np.ndarray:
    """An output tensor's data as a new f32 array. OpenVINO hands bf16 data over as float16-typed
    numpy memory: its bits are bf16, the upper half of an f32's."""
    if element_type == ov.Type.bf16:
        return (values.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32)


def read_ov_model(model_dir: str | Path) -> ov.Model:
    path = Path(model_dir) / MODEL_FILE
    if not path.is_file():
        raise InputError(f"{model_dir} has no {MODEL_FILE}", "export the model first with `dflash export`")
    return ov.Core().read_model(path)


# The engine prepares the draft on another thread while it prepares the target (loading.py). OpenVINO's
# Python bindings can deadlock when two threads call them at once: one, holding the GIL, waits for a C++
# static that the other is initializing, which waits for the GIL (seen as a `dflash generate` that hung
# in `_fold_constant` on both threads). Graph work, tensors and requests go through the bindings one
# thread at a time; compile_model, which releases the GIL and is most of the time, runs in parallel.
BINDINGS_LOCK = threading.Lock()


class PagedModel:
    """A compiled PagedAttention model, its KV caches and one infer request (shared by both runners).

    Every call writes its inputs into the request's own tensors and reads its outputs from them
    (`RequestTensors`); `infer_seconds` adds up the time spent in the inferences alone.
    """

    def __init__(self, model: ov.Model, *, device: str, ov_config: dict[str, str] | None):
        """Compile `model` (prepared under BINDINGS_LOCK, which the caller no longer holds)."""
        self.compiled = ov.Core().compile_model(model, device, compile_properties(ov_config))
        with BINDINGS_LOCK:
            self.layout: KVCacheLayout = read_kv_cache_layout(self.compiled)
            self.kv_block_size = self.layout.kv_block_size
            self.num_blocks = 0
            self.infer_seconds = 0.0
            self._request = self.compiled.create_infer_request()
            self._tensors = RequestTensors(self._request, self.compiled)

    @property
    def bytes_per_block(self) -> int:
        return self.layout.bytes_per_block

    @property
    def precision(self) -> str:
        """What the plugin compiled, read back (never assumed): e.g. "f32 inference, u8 KV cache"."""
        inference = self.compiled.get_property("INFERENCE_PRECISION_HINT")
        return f"{inference.to_string()} inference, {self.layout.layers[0].key_type.to_string()} KV cache"

    def allocate_cache(self, num_blocks: int) -> None:
        """Allocate the KV caches once; the plugin writes into them in place."""
        with BINDINGS_LOCK:
            for name, tensor in allocate_kv_caches(self.layout, num_blocks).items():
                self._request.set_tensor(name, tensor)
        self.num_blocks = num_blocks

    def _infer(self, seqs: list[SequenceSlice], rows: dict[str, np.ndarray], sample_rows: np.ndarray) -> None:
        """One packed inference: paging inputs from `seqs`, then the per-row inputs and the sampled rows."""
        for name, values in pack_paged_inputs(seqs, self.kv_block_size).items():
            self._tensors.write(name, values)
        self._tensors.write("position_ids", packed_positions(seqs))
        for name, values in rows.items():
            self._tensors.write(name, values)
        self._tensors.write(SAMPLED_ROWS_INPUT, sample_rows)
        start = time.perf_counter()
        self._request.start_async()  # then wait: infer() would also copy every output into new arrays
        self._request.wait()
        self.infer_seconds += time.perf_counter() - start

    def _output(self, name: str) -> np.ndarray:
        """An output as [rows, width], a view of the request's tensor (valid until the next inference).
        Spelled out because a step may sample no row at all, and reshape(0, -1) of an empty array is an error."""
        data = self._tensors.read(name)
        return data.reshape(data.shape[0], data.shape[-1])


class TargetRunner(PagedModel):
    """The target: logits of the sampled rows and, for a draft, the hidden states of every row."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "CPU",
        ov_config: dict[str, str] | None = None,
        hidden_layer_ids: Sequence[int] = (),
    ):
        with BINDINGS_LOCK:
            model = read_ov_model(model_dir)
            layer_outputs = []
            if hidden_layer_ids:
                from dflash.core.hidden_states import hidden_state_outputs

                # Resolved on the exported graph; the producers keep their names through the transformation.
                layer_outputs = hidden_state_outputs(model, hidden_layer_ids)
            info = to_paged_attention(model)
            state_tables = state_table_names(info.other_inputs, model)  # [] unless a hybrid target
            insert_logits_gather(model)
            if layer_outputs:
                add_hidden_states_output(model, layer_outputs, half_inference_precision(device, ov_config))
        super().__init__(model, device=device, ov_config=ov_config)
        with BINDINGS_LOCK:
            # bf16/f16 where the plugin infers in 16 bits (add_hidden_states_output says why); widened for the draft
            self.hidden_states_type = self.compiled.output(HIDDEN_STATES_OUTPUT).get_element_type() if layer_outputs else None
            self.state_tables = StateTables(self.compiled, state_tables) if state_tables else None

    @property
    def has_hidden_states(self) -> bool:
        """Compiled for a draft: every step also returns the hidden states of the layers it reads."""
        return self.hidden_states_type is not None

    @property
    def is_hybrid(self) -> bool:
        """Linear-attention layers beside the attention ones: state blocks besides the KV blocks."""
        return self.state_tables is not None

    def allocate_state(self, num_blocks: int) -> None:
        """Allocate a hybrid target's state tables once (zeroed), as `allocate_cache` does the KV caches."""
        with BINDINGS_LOCK:
            self.state_tables.allocate(self._request, num_blocks)

    def run(self, step: StepInputs) -> StepOutputs:
        rows = {"input_ids": step.token_ids, **step.state_inputs} if step.state_inputs else {"input_ids": step.token_ids}
        self._infer(step.seqs, rows, step.sample_rows)
        # The draft keeps hidden rows across steps: a copy in f32 (the logits are read before the next inference).
        hidden = widen_to_f32(self._output(HIDDEN_STATES_OUTPUT), self.hidden_states_type) if self.has_hidden_states else None
        return StepOutputs(logits=self._output("logits"), hidden_states=hidden)
