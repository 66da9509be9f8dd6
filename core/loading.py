"""Loading an engine's models: the target on PagedAttention, and the draft (with its Markov head)
as the second pipeline, each with a KV block pool sized as the engine's config says (a hybrid target
also gets its pool of linear-attention state blocks: core/hybrid_cache.py)."""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .block_pool import BlockPool
from .config import EngineConfig
from .draft_format import read_draft_metadata
from .draft_runner import DraftRunner
from .drafter import NoDrafter
from .errors import InputError
from .hybrid_cache import HybridCacheManager
from .kv_cache_manager import KVCacheManager
from .markov import load_markov_head
from .model_runner import TargetRunner, read_ov_model
from .speculative import DFlashDrafter
from .state_pool import StatePool
from .tokenization import load_tokenizer


@dataclass
class Pipelines:
    """The target's runner and KV pool, and the drafter (NoDrafter for the target alone)."""

    runner: TargetRunner
    kv_cache_manager: KVCacheManager
    drafter: DFlashDrafter | NoDrafter
    model_config: dict  # the target's config.json ({} if unreadable)
    tokenizer: object  # the target's (core/tokenization.load_tokenizer)


def load_pipelines(model_dir: Path, draft_dir: str | Path | None, config: EngineConfig) -> Pipelines:
    model_config = read_model_config(model_dir)
    draft_model = read_ov_model(draft_dir) if draft_dir is not None else None
    # A DSpark head is loaded before anything is compiled, so a missing one fails fast.
    markov = None
    if draft_model is not None and config.use_markov_head:
        markov = load_markov_head(draft_dir, draft_model, device=config.device, ov_config=config.ov_config,
                                  vocab_size=model_config.get("vocab_size"))  # fmt: skip
    metadata = read_draft_metadata(draft_model) if draft_model is not None else None
    # The draft is prepared and compiled, and the tokenizer read, on other threads while the target is:
    # the two compilations overlap (OpenVINO releases the GIL while it compiles), the graph work before
    # them takes turns (model_runner.BINDINGS_LOCK). A later run's start is mostly these compilations.
    with ThreadPoolExecutor(max_workers=2) as pool:
        tokenizer = pool.submit(load_tokenizer, model_dir)
        draft_runner = None if draft_model is None else pool.submit(_compiled_draft, draft_model, model_dir, config)
        runner = TargetRunner(
            model_dir,
            device=config.device,
            ov_config=config.ov_config,
            hidden_layer_ids=metadata.target_layer_ids if metadata is not None else (),
        )
        if runner.is_hybrid:  # linear-attention state blocks beside the KV blocks; no prefix caching
            config = _without_prefix_caching(config)
            kv_cache_manager = _make_hybrid_cache(runner, config, max_verify_rows=1 + metadata.max_candidates if metadata else 0)
        else:
            kv_cache_manager = _make_kv_cache(runner, config, draft=False)
        draft_runner = None if draft_runner is None else draft_runner.result()
        tokenizer = tokenizer.result()
    drafter: DFlashDrafter | NoDrafter = NoDrafter()
    if draft_runner is not None:
        drafter = DFlashDrafter(draft_runner, _make_kv_cache(draft_runner, config, draft=True),
                                markov=markov, markov_top_k=config.markov_head_top_k,
                                proposals=config.draft_proposals)  # fmt: skip
    return Pipelines(runner, kv_cache_manager, drafter, model_config, tokenizer)


def _compiled_draft(draft_model, model_dir: Path, config: EngineConfig) -> DraftRunner:
    """The draft runner with its KV caches allocated (zeroing them is a tenth of a second or more):
    all of it on the loading thread, beside the target's compilation."""
    runner = DraftRunner(draft_model, model_dir, device=config.device, ov_config=config.ov_config)
    runner.allocate_cache(config.cache_config(runner.kv_block_size, draft=True).resolve_num_blocks(runner.bytes_per_block))
    return runner


def _make_kv_cache(runner, config: EngineConfig, *, draft: bool) -> KVCacheManager:
    """A block pool sized as the config says, the runner's caches allocated to match (unless they are)."""
    cache = config.cache_config(runner.kv_block_size, draft=draft)
    if not runner.num_blocks:
        runner.allocate_cache(cache.resolve_num_blocks(runner.bytes_per_block))
    return KVCacheManager(BlockPool(runner.num_blocks, cache.kv_block_size, cache.enable_prefix_caching))


def _without_prefix_caching(config: EngineConfig) -> EngineConfig:
    """A hybrid target's config: prefix caching off (by default), or refused when asked for."""
    if config.enable_prefix_caching:
        raise InputError(
            "prefix caching is not supported for hybrid linear-attention targets (Qwen3.5) yet",
            "run without it (--no-prefix-caching, EngineConfig(enable_prefix_caching=False)); docs/hybrid-targets.md",
        )
    return dataclasses.replace(config, enable_prefix_caching=False)


def _make_hybrid_cache(runner: TargetRunner, config: EngineConfig, *, max_verify_rows: int) -> HybridCacheManager:
    """KV blocks as for any target, and the state pool, its tables allocated to match."""
    kv = _make_kv_cache(runner, config, draft=False)
    num_state_blocks = config.state_pool_blocks(runner.state_tables.bytes_per_block, max_verify_rows)
    runner.allocate_state(num_state_blocks)
    return HybridCacheManager(kv.pool, StatePool(num_state_blocks, zero=runner.state_tables.zero))


def read_model_config(model_dir: Path) -> dict:
    """The exported config.json (for max_position_embeddings and vocab_size); {} if unreadable."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}
