"""What the adaptive schedule measured of this machine's steps, kept between runs.

The adaptive schedule (core/adaptive.py) prices drafting on step costs it measures as it goes, and
explores until it has them: a fresh engine drafts whole blocks, half blocks, one candidate and none
in turn for its first steps, and prices drafting on whatever those steps showed. That is most of a
short request: one HumanEval prompt of 128 tokens at c=1 ran 1.35x the target alone with a fresh
schedule, 1.76x with one that had run before (the default pair, 2-core CPU). Every `dflash generate`
is a fresh process, so the CLI keeps the schedule's state (`AdaptiveSchedule.state()`) in a file of
the user cache, one per (target, draft, device, properties, machine), read when an engine starts and
written when it goes idle (`EngineConfig.schedule_memory`).

A file that cannot be read or does not fit is ignored (the schedule starts from nothing) and replaced
at the next write; writes go to a temporary file renamed over the old one, so two processes never
leave half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
from pathlib import Path

from .adaptive import AdaptiveSchedule


class ScheduleMemory:
    """The file one engine's adaptive schedule is read from and written to."""

    def __init__(self, path: Path):
        self.path = path
        self._saved_at: tuple[int, int] | None = None  # the schedule's (decisions, steps) at the last write

    @classmethod
    def for_engine(cls, folder: str | Path, target_dir: Path, draft_dir: Path, config) -> ScheduleMemory:
        """The file of this pair, device, OpenVINO properties and machine in `folder`."""
        return cls(Path(folder) / f"{memory_key(target_dir, draft_dir, config)}.json")

    def load(self, schedule: AdaptiveSchedule) -> bool:
        """Restore `schedule` from the file; False (and nothing changed) if there is none that fits."""
        try:
            schedule.restore(json.loads(self.path.read_text()))  # all or nothing
        except (OSError, ValueError):
            return False
        return True

    def save(self, schedule: AdaptiveSchedule) -> None:
        """Write the schedule's state, if it decided or measured anything since the last write. A
        folder that cannot be written is not an error (nothing is kept)."""
        progress = (schedule.num_decisions, schedule.num_observed_steps)
        if progress == self._saved_at:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, suffix=".tmp", delete=False) as f:
                json.dump(schedule.state(), f)
            os.replace(f.name, self.path)
        except OSError:
            return
        self._saved_at = progress


def memory_key(target_dir: Path, draft_dir: Path, config) -> str:
    """A name for what the step costs depend on: both models' files, the device and properties the
    engine compiles them with, the Markov head's setting, OpenVINO's version and the processor."""
    import openvino

    key = {
        "target": _fingerprint(target_dir),
        "draft": _fingerprint(draft_dir),
        "device": config.device,
        "ov_config": sorted((str(k), str(v)) for k, v in config.ov_config.items()),
        "markov": [config.use_markov_head, config.markov_head_top_k],
        "openvino": openvino.__version__,
        "machine": [platform.machine(), _processor_name(), os.cpu_count()],
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _fingerprint(model_dir: Path) -> list:
    """The folder and its IR files' names, sizes and modification times (a re-export is another pair)."""
    model_dir = Path(model_dir).resolve()
    files = sorted(p for p in model_dir.glob("*") if p.suffix in (".xml", ".bin"))
    return [str(model_dir), [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]]


def _processor_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
