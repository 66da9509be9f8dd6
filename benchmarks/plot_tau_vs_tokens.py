"""Plot a draft's tau against the target tokens it trained on, over a chain of warm-started runs.

Each run's `training_info.json` (what `dflash train` writes beside the checkpoint) holds its held-out
tau every `--eval-every` steps (on the first 64 held-out sequences of that run's own split); the
runs are chained on one axis (a warm-started run starts where the run it started from ended). Engine
figures (`dflash bench`, held-out prompts) can be marked at the end of a run:

    python benchmarks/plot_tau_vs_tokens.py docs/img/draft-tau-vs-tokens.png \\
        --run "DFlash b16=run1/training_info.json,run2/training_info.json" \\
        --engine "DFlash b16:HumanEval 164 @15:2.57,3.14" --engine "DFlash b16:chat 60 @15:1.49,1.65"

`--engine KIND:LABEL:TAU,TAU,...` gives one tau per run of that KIND's chain (empty: not measured).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def chain(paths: list[str]) -> list[tuple[list[float], list[float], float]]:
    """Per run: (tokens, held-out tau) of its eval points, offset by the runs before it, and its end."""
    runs, offset = [], 0.0
    for path in paths:
        info = json.loads(Path(path).read_text())
        history = info["history"]
        before = (info.get("result") or {}).get("eval_before") or {}
        xs, ys = ([offset], [before["tau"]]) if before.get("tau") else ([], [])
        for entry in history:
            if "eval" in entry:
                xs.append(offset + entry["tokens"])
                ys.append(entry["eval"]["tau"])
        end = offset + history[-1]["tokens"]
        runs.append((xs, ys, end))
        offset = end
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output")
    parser.add_argument("--run", action="append", required=True, help="KIND=INFO1,INFO2,... (a chain of runs)")
    parser.add_argument("--engine", action="append", default=[], help="KIND:LABEL:TAU1,TAU2,... (one per run)")
    parser.add_argument("--run-names", help="NAME1,NAME2,... of the chained runs in the legend (default 1, 2, ...)")
    args = parser.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.run), figsize=(6.5 * len(args.run), 5.6), squeeze=False)
    for ax, spec in zip(axes[0], args.run):
        kind, paths = spec.split("=", 1)
        runs = chain(paths.split(","))
        names = args.run_names.split(",") if args.run_names else [str(i + 1) for i in range(len(runs))]
        for index, (xs, ys, end) in enumerate(runs):
            ax.plot([x / 1e6 for x in xs], ys, "-", color=f"C{index}", alpha=0.8,
                    label=f"run {names[index]}: held-out tau (its own split)")
            ax.axvline(end / 1e6, color="grey", lw=0.5, ls=":")
        for number, engine in enumerate(e for e in args.engine if e.split(":", 1)[0] == kind):
            _, label, values = engine.split(":", 2)
            points = [(runs[i][2] / 1e6, float(v)) for i, v in enumerate(values.split(",")) if v and i < len(runs)]
            ax.plot([p[0] for p in points], [p[1] for p in points], "o--", color=f"C{len(runs) + number}",
                    label=f"engine, {label}")
        ax.set_title(kind)
        ax.set_xlabel("target tokens trained on (millions, runs chained)")
        ax.set_ylabel("tau (mean accepted length)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
