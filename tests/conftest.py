"""Fixtures shared by several test modules: tiny targets built and exported once per session.

Every module that needs one of these reads it and never writes into it (tests that plant defects
copy first), so one export serves them all. Module-specific checkpoints (constructed pairs, drafts)
stay in their modules.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash.core.config import EXACT_OV_CONFIG
from dflash.exporters.target import export_target
from dflash.exporters.tiny import make_tiny_target

F32 = EXACT_OV_CONFIG  # f32 compute and KV caches: outputs do not depend on batch composition


@pytest.fixture(autouse=True)
def user_cache(tmp_path_factory, monkeypatch) -> Path:
    """Each test's own user cache folder ($DFLASH_CACHE_DIR): what the CLI keeps there (the adaptive
    schedule's measurements, per pair) stays out of the real one, and no test starts from what another
    test's run of the same pair measured."""
    from dflash.exporters.default_pair import CACHE_ENV

    folder = tmp_path_factory.mktemp("user-cache")
    monkeypatch.setenv(CACHE_ENV, str(folder))
    return folder


@pytest.fixture(scope="session")
def sharp_qwen3(tmp_path_factory) -> tuple[Path, Path]:
    """(Hugging Face folder, fp32 IR) of a tiny qwen3 target with initializer_range 0.2: sharper
    logits, so greedy continuations are varied rather than one token repeated."""
    root = tmp_path_factory.mktemp("sharp-qwen3")
    hf = make_tiny_target(root / "hf", "qwen3", seed=3, initializer_range=0.2)
    return hf, export_target(hf, root / "ov", weight_format="fp32")


@pytest.fixture(scope="session")
def tiny_target_src(tmp_path_factory) -> Path:
    """The default tiny qwen3 checkpoint (4 layers, hidden 64, vocabulary 512)."""
    return make_tiny_target(tmp_path_factory.mktemp("tiny-target") / "target_src")


@pytest.fixture(scope="session")
def tiny_target_fp16(tiny_target_src) -> Path:
    """`tiny_target_src` exported with fp16 weights."""
    return export_target(tiny_target_src, tiny_target_src.parent / "target_fp16", weight_format="fp16")


@pytest.fixture(scope="session")
def tiny_target_torch(tiny_target_src):
    """`tiny_target_src` loaded in PyTorch on the CPU for training (dflash.training.target)."""
    import torch

    from dflash.training.target import load_target

    return load_target(tiny_target_src, torch.device("cpu"))
