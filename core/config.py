"""Engine configuration: one small frozen dataclass per concern, validated on construction.

Each component receives only its own config (the cache config for the KV pool, the scheduler config for
the scheduler, sampling params per request). Invalid values raise `ValueError` with a message that
names the field, never `assert` (asserts vanish under `python -O` and say nothing useful).
The dataclasses are frozen: change a value with `dataclasses.replace`, which validates again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

GIB = 1 << 30
ASSISTANT_SCHEDULES = ("constant", "heuristic", "adaptive")
DRAFT_PROPOSALS = ("argmax", "sampled")  # how a draft proposes for sampling requests (EngineConfig.draft_proposals)


def _require_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _require_non_negative_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


# OpenVINO properties for exact, batch-independent inference on the CPU: f32 compute and f32 KV caches.
EXACT_OV_CONFIG = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}


def is_exact_inference(ov_config: dict[str, str] | None) -> bool:
    """The caller asked for f32 inference (INFERENCE_PRECISION_HINT=f32): exact, batch-independent outputs."""
    return str((ov_config or {}).get("INFERENCE_PRECISION_HINT", "")).lower() in ("f32", "float32")


def compile_properties(ov_config: dict[str, str] | None) -> dict[str, str]:
    """The OpenVINO properties models are compiled with: the caller's, made exact when they ask for f32.

    With int8/int4 weights the CPU plugin quantizes activations on the fly (dynamic quantization),
    which makes a row's result depend on how many rows share the MatMul; so f32 alone does not give
    batch-independent outputs. Under f32, dynamic quantization is off unless the caller sets
    DYNAMIC_QUANTIZATION_GROUP_SIZE.
    """
    config = dict(ov_config or {})
    if is_exact_inference(config):
        config.setdefault("DYNAMIC_QUANTIZATION_GROUP_SIZE", "0")
    return config


def num_blocks_for_size(kv_cache_size_gib: float, bytes_per_block: int) -> int:
    """How many whole KV blocks fit into `kv_cache_size_gib` GiB.

    `bytes_per_block` covers one block across every layer, keys and values (and any quantization
    scales): the model runner computes it from the cache layout the compiled model reports.
    """
    if not kv_cache_size_gib > 0:
        raise ValueError(f"kv_cache_size_gib must be > 0, got {kv_cache_size_gib!r}")
    _require_positive_int("bytes_per_block", bytes_per_block)
    num_blocks = math.floor(kv_cache_size_gib * GIB / bytes_per_block)
    if num_blocks < 1:
        raise ValueError(
            f"a KV cache of {kv_cache_size_gib} GiB holds no block of {bytes_per_block} bytes; "
            "raise kv_cache_size_gib"
        )
    return num_blocks


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The KV cache of one model (target or draft: each has its own).

    The size is given either as a block count (`num_blocks`) or in GiB (`kv_cache_size_gib`), not both.
    `kv_block_size` is what the compiled model's cache layout reports (never assumed).
    """

    kv_block_size: int
    num_blocks: int | None = None
    kv_cache_size_gib: float | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _require_positive_int("kv_block_size", self.kv_block_size)
        if self.num_blocks is not None:
            _require_positive_int("num_blocks", self.num_blocks)
        if self.kv_cache_size_gib is not None and not self.kv_cache_size_gib > 0:
            raise ValueError(f"kv_cache_size_gib must be > 0, got {self.kv_cache_size_gib!r}")
        if self.num_blocks is not None and self.kv_cache_size_gib is not None:
            raise ValueError("set num_blocks or kv_cache_size_gib, not both")

    def resolve_num_blocks(self, bytes_per_block: int) -> int:
        """The number of blocks to allocate: `num_blocks` as given, else derived from the GiB size."""
        if self.num_blocks is not None:
            return self.num_blocks
        if self.kv_cache_size_gib is None:
            raise ValueError("the KV cache size is unset: give num_blocks or kv_cache_size_gib")
        return num_blocks_for_size(self.kv_cache_size_gib, bytes_per_block)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits of one engine step.

    max_num_batched_tokens: rows one packed inference may hold (prompt chunks plus [seed; candidates]).
    max_num_seqs: requests that may hold KV blocks at once (running, including mid-prefill).
    dynamic_split_fuse: True mixes prompt chunks with generation rows in one step and chunks long
        prompts; False runs a step of whole prompts or a step of generation rows, never both.
    max_model_len: the longest sequence (prompt + new tokens) a request may reach; None = no limit
        beyond the KV cache.
    """

    max_num_batched_tokens: int = 256
    max_num_seqs: int = 64
    dynamic_split_fuse: bool = True
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        _require_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _require_positive_int("max_num_seqs", self.max_num_seqs)
        if self.max_model_len is not None:
            _require_positive_int("max_model_len", self.max_model_len)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request generates.

    temperature 0 is greedy decoding (top_p, top_k and seed are then unused). top_k 0 = no top-k cut.
    stop_token_ids and stop_strings end the request (checked by the engine, not the scheduler);
    ignore_eos keeps generating past the tokenizer's EOS. num_assistant_tokens: candidates the draft
    proposes per step for this request at most; None = all the draft's block yields, 0 = no drafting.
    num_assistant_tokens_schedule: "adaptive" (the default) drafts, up to that number, the candidates
    whose measured acceptance pays for the measured cost of drafting, none when nothing pays
    (core/adaptive.py); "constant" always drafts that number; "heuristic" (transformers' assisted
    generation schedule) starts there, adds 2 after a step that accepted every candidate and takes 1
    away (not below 1) after one that did not, within the draft's block.
    Sequences given as lists are stored as tuples so the params stay immutable.
    max_new_tokens defaults to a finite 256 because the scheduler checks at admission that
    prompt + max_new_tokens fits the KV cache.
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    num_assistant_tokens: int | None = None
    num_assistant_tokens_schedule: str = "adaptive"

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        _require_non_negative_int("max_new_tokens", self.max_new_tokens)
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        _require_non_negative_int("top_k", self.top_k)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        for token_id in self.stop_token_ids:
            _require_non_negative_int("stop_token_ids entry", token_id)
        for text in self.stop_strings:
            if not isinstance(text, str) or not text:
                raise ValueError(f"stop_strings entries must be non-empty strings, got {text!r}")
        if self.num_assistant_tokens is not None:
            _require_non_negative_int("num_assistant_tokens", self.num_assistant_tokens)
        if self.num_assistant_tokens_schedule not in ASSISTANT_SCHEDULES:
            raise ValueError(
                f"num_assistant_tokens_schedule must be one of {', '.join(ASSISTANT_SCHEDULES)}, "
                f"got {self.num_assistant_tokens_schedule!r}"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


DEFAULT_KV_CACHE_GIB = 0.25


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs besides the model folders.

    kv_cache_size_gib / num_kv_blocks: the target's KV cache, in GiB or in blocks (not both; default
        0.25 GiB). draft_kv_cache_size_gib / num_draft_kv_blocks: the draft's (default: as the target's).
    enable_prefix_caching: reuse the KV of shared prompt prefixes; None (the default) = on, except for
        hybrid linear-attention targets (Qwen3.5), which do not support it yet (True is refused for them).
    num_state_blocks: a hybrid target's linear-attention state pool, in blocks (one holds a sequence's
        recurrent and convolution state in every such layer). Each running request holds one, plus
        one per verified row while its candidates are verified. Default: max_num_seqs x (2 + the
        draft's candidates per block), or max_num_seqs without a draft, but at most what fits in as
        much memory as the KV cache (never fewer than one request needs to verify a whole block).
    markov_head_top_k: for DSpark drafts with a Markov head, 0 walks the dense Markov bias (exact; what
        `dflash export` asks for), K > 0 the Top-K lattice of each row's K best tokens (core/markov.py);
        None: the export's choice (rt_info). use_markov_head=False runs the draft as plain DFlash.
    draft_proposals: how the draft proposes for sampling requests (temperature > 0): "argmax" its
        deterministic candidates (each row's argmax, or the Markov walk), "sampled" candidates drawn from
        its distributions after the request's temperature/top-k/top-p. Both are verified by speculative
        sampling, so both give the target's own distribution; they differ in acceptance.
    schedule_memory: a folder where the adaptive schedule keeps what it measured of this machine's steps
        (one file per pair, device, properties and processor), read when the engine starts and written
        when it goes idle, so that a later engine prices drafting from its first step instead of
        exploring (core/schedule_memory.py). None (the default here): nothing is kept; the CLI keeps it
        in the user cache folder.
    The scheduler's limits (max_num_batched_tokens, max_num_seqs, dynamic_split_fuse) are SchedulerConfig's.
    """

    device: str = "CPU"
    ov_config: dict[str, str] = field(default_factory=dict)
    kv_cache_size_gib: float | None = None
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool | None = None
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 64
    dynamic_split_fuse: bool = True
    draft_kv_cache_size_gib: float | None = None
    num_draft_kv_blocks: int | None = None
    num_state_blocks: int | None = None
    markov_head_top_k: int | None = None
    use_markov_head: bool = True
    draft_proposals: str = "argmax"
    schedule_memory: str | Path | None = None

    def __post_init__(self) -> None:
        for name in ("kv_cache_size_gib", "draft_kv_cache_size_gib"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        for name in ("num_kv_blocks", "num_draft_kv_blocks", "num_state_blocks"):
            if getattr(self, name) is not None:
                _require_positive_int(name, getattr(self, name))
        if self.markov_head_top_k is not None:
            _require_non_negative_int("markov_head_top_k", self.markov_head_top_k)
        if self.draft_proposals not in DRAFT_PROPOSALS:
            raise ValueError(f"draft_proposals must be one of {', '.join(DRAFT_PROPOSALS)}, got {self.draft_proposals!r}")
        self.scheduler_config(None)  # validates the scheduler's limits

    def scheduler_config(self, max_model_len: int | None) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            dynamic_split_fuse=self.dynamic_split_fuse,
            max_model_len=max_model_len,
        )

    def cache_config(self, kv_block_size: int, *, draft: bool = False) -> CacheConfig:
        """The target's (or the draft's) KV cache for a model whose compiled cache has `kv_block_size`."""
        num_blocks = self.num_draft_kv_blocks if draft else self.num_kv_blocks
        size_gib = (self.draft_kv_cache_size_gib or self.kv_cache_size_gib) if draft else self.kv_cache_size_gib
        return CacheConfig(
            kv_block_size=kv_block_size,
            num_blocks=num_blocks,
            kv_cache_size_gib=None if num_blocks else (size_gib or DEFAULT_KV_CACHE_GIB),
            enable_prefix_caching=self.enable_prefix_caching is not False,
        )

    def state_pool_blocks(self, bytes_per_block: int, max_verify_rows: int) -> int:
        """Blocks of a hybrid target's state pool (`num_state_blocks`, or the default described above)."""
        if self.num_state_blocks is not None:
            return self.num_state_blocks
        per_request = 1 + max_verify_rows  # the committed block, a checkpoint per verified row
        memory_cap = math.floor((self.kv_cache_size_gib or DEFAULT_KV_CACHE_GIB) * GIB / bytes_per_block)
        return max(per_request, min(self.max_num_seqs * per_request, memory_cap))
