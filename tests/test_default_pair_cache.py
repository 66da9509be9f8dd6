"""The default pair's export cache follows the shipped draft checkpoints (issue 11: the drafts are retrained).

A user who exported the previous default drafts must get the new ones after an upgrade, not the cached
IR of the old ones: the draft's cache folder is named by a fingerprint of the checkpoint's files, so a
new checkpoint is exported into a folder of its own. No export runs here (the export step is recorded).
"""

from __future__ import annotations

import json
import os
import time

from dflash.exporters import default_pair


def _fake_ensure(calls):
    def ensure(folder, export, step, version=default_pair._VERSION):
        stamp = folder / default_pair._STAMP
        if not (stamp.is_file() and json.loads(stamp.read_text()).get("version") == version):
            calls.append(folder.name)  # what a real first use would export
            folder.mkdir(parents=True, exist_ok=True)
            stamp.write_text(json.dumps({"version": version}))
        return folder

    return ensure


def test_a_new_draft_checkpoint_is_exported_again(tmp_path, monkeypatch):
    drafts = tmp_path / "drafts"
    source = drafts / default_pair.DRAFTS["dflash"]
    source.mkdir(parents=True)
    (source / "config.json").write_text('{"block_size": 16}')
    (source / "model.safetensors").write_bytes(b"old weights")
    monkeypatch.setattr(default_pair, "DRAFTS_DIR", drafts)
    monkeypatch.setenv(default_pair.CACHE_ENV, str(tmp_path / "cache"))
    calls: list[str] = []
    monkeypatch.setattr(default_pair, "_ensure", _fake_ensure(calls))

    old = default_pair.ensure_default_pair("dflash").draft_dir
    assert calls == [f"{default_pair.TARGET_NAME}-{default_pair.TARGET_WEIGHT_FORMAT}", old.name]
    assert default_pair.ensure_default_pair("dflash").draft_dir == old and len(calls) == 2  # cached: no export

    (source / "model.safetensors").write_bytes(b"new weights")  # the retrained draft, same config and size
    new = default_pair.ensure_default_pair("dflash").draft_dir
    assert new != old and calls[-1] == new.name and len(calls) == 3
    (source / "training_info.json").write_text("{}")  # its report is part of the fingerprint too
    assert default_pair.ensure_default_pair("dflash").draft_dir != new


def test_the_shipped_drafts_have_distinct_fingerprints():
    prints = {kind: default_pair._fingerprint(default_pair.DRAFTS_DIR / name) for kind, name in default_pair.DRAFTS.items()}
    assert len(set(prints.values())) == len(prints)
    assert all(len(p) == 16 for p in prints.values())


def test_the_fingerprint_is_remembered_until_a_file_changes(tmp_path, monkeypatch):
    source = tmp_path / "draft"
    source.mkdir()
    (source / "config.json").write_text("{}")
    (source / "model.safetensors").write_bytes(b"weights")
    installed = time.time_ns() - 60 * 10**9  # files installed a minute ago
    for file in source.iterdir():
        os.utime(file, ns=(installed, installed))
    hashed = []
    real = default_pair._fingerprint
    monkeypatch.setattr(default_pair, "_fingerprint", lambda folder: hashed.append(folder) or real(folder))
    first = default_pair._remembered_fingerprint(source, tmp_path / "cache")
    assert default_pair._remembered_fingerprint(source, tmp_path / "cache") == first and len(hashed) == 1
    (source / "model.safetensors").write_bytes(b"other weights")  # another size
    assert default_pair._remembered_fingerprint(source, tmp_path / "cache") == real(source) != first
    assert len(hashed) == 2
    # The same size again, at once, on a clock whose tick gives it the time just recorded: the memo,
    # written within a second of that time, is not trusted.
    recorded = (source / "model.safetensors").stat().st_mtime_ns
    (source / "model.safetensors").write_bytes(b"newer weights")
    os.utime(source / "model.safetensors", ns=(recorded, recorded))
    assert default_pair._remembered_fingerprint(source, tmp_path / "cache") == real(source)
