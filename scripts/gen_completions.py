#!/usr/bin/env python3
"""Write completions/dflash.{bash,zsh,fish} from the installed `dflash` program.

    python scripts/gen_completions.py          # regenerate
    python scripts/gen_completions.py --check  # exit 1 if a committed script is stale

The scripts are typer's own: they call back into `dflash` for the candidates, so they follow the
commands and options as the program defines them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

SHELLS = {"bash": "dflash.bash", "zsh": "dflash.zsh", "fish": "dflash.fish"}
COMPLETIONS_DIR = Path(__file__).resolve().parent.parent / "completions"


def dflash_program() -> str:
    beside_python = Path(sys.executable).with_name("dflash")
    found = str(beside_python) if beside_python.exists() else shutil.which("dflash")
    if not found:
        sys.exit("error: the dflash program is not installed (pip install -e .)")
    return found


def render(shell: str) -> str:
    env = dict(os.environ, _DFLASH_COMPLETE=f"source_{shell}")
    done = subprocess.run([dflash_program()], env=env, capture_output=True, text=True, check=True)
    return done.stdout


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    COMPLETIONS_DIR.mkdir(exist_ok=True)
    for shell, name in SHELLS.items():
        path = COMPLETIONS_DIR / name
        text = render(shell)
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print("stale completion scripts: " + ", ".join(stale), file=sys.stderr)
        print("regenerate them with: python scripts/gen_completions.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
