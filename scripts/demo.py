#!/usr/bin/env python3
"""The main job until the trained default pair ships: build a tiny target and a tiny DFlash draft from
configs (seeded random weights), export the pair with `dflash export` and check it with
`dflash validate`, exactly as a user would run those commands.

    python scripts/demo.py [WORKDIR]      # default: ./demo-out (ignored by git)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def run(*args: str) -> None:
    print("$ " + " ".join(args), flush=True)
    subprocess.run(args, check=True)


def main() -> int:
    workdir = Path(sys.argv[1] if len(sys.argv) > 1 else "demo-out").resolve()
    if workdir.exists():
        shutil.rmtree(workdir)
    from dflash.exporters.draft_checkpoint import make_tiny_draft
    from dflash.exporters.tiny import make_tiny_target

    target_hf = make_tiny_target(workdir / "hf" / "target", "qwen3", seed=0)
    draft_hf = make_tiny_draft(workdir / "hf" / "draft", target_hf, kind="dflash", seed=0)
    print(f"built tiny checkpoints in {workdir / 'hf'}", flush=True)

    dflash = str(Path(sys.executable).with_name("dflash"))
    run(dflash, "export", str(target_hf), str(workdir / "ov"), "--draft", str(draft_hf))
    run(dflash, "validate", str(workdir / "ov" / "draft"), "--target", str(workdir / "ov" / "target"))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.CalledProcessError as exc:
        sys.exit(exc.returncode)
