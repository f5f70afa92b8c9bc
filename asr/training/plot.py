"""Plot a streaming-ASR training run from its logs: losses and held-out WER against step.

    python -m asr.training.plot runs/asr_train*.log --out docs/results/asr-training.png

Reads the lines `python -m asr.training.train_streaming` prints ("step N ctc X align Y phone Z ..." and
"step N held-out WER {...}"); a resumed run's logs are read in the order given, a later value of a
step replacing an earlier one (a run killed before its checkpoint repeats those steps). A `run.json`
among them adds its validation history. `--span 4459:8707:H100` shades the steps trained elsewhere.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

_LOSS = re.compile(r"^step (\d+) ctc ([\d.]+)(?: align ([\d.]+))?(?: phone ([\d.]+))?")
_WER = re.compile(r"^step (\d+) (?:held-out|panel) WER (\{.*\})")  # panel: recipe 2, 480 ms, by set


def parse(paths: list[Path]) -> tuple[dict[int, dict[str, float]], dict[int, dict[str, float]]]:
    """(losses by step, WER by step and lookahead frames) from the logs, later files winning."""
    losses: dict[int, dict[str, float]] = {}
    wers: dict[int, dict[str, float]] = {}
    for path in paths:
        if path.suffix == ".json":
            import json

            for h in json.loads(path.read_text()).get("history", []):
                got = h.get("panel") or h.get("wer") or {}
                wers.setdefault(int(h["step"]), {}).update({str(k): float(v) for k, v in got.items()})
            continue
        for line in path.read_text(errors="replace").splitlines():
            if m := _LOSS.match(line):
                losses[int(m[1])] = {
                    k: float(v)
                    for k, v in zip(("ctc", "align", "phone"), m.groups()[1:], strict=True)
                    if v is not None
                }
            elif m := _WER.match(line):
                wers.setdefault(int(m[1]), {}).update(
                    {str(k): float(v) for k, v in ast.literal_eval(m[2]).items()}
                )
    return losses, wers


def plot(losses: dict, wers: dict, out: Path, spans: tuple[tuple[int, int, str], ...] = ()) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    steps = sorted(losses)
    for key in ("ctc", "align", "phone"):
        pts = [(s, losses[s][key]) for s in steps if key in losses[s]]
        if pts:
            ax1.plot(*zip(*pts, strict=True), label=f"{key} loss (per utterance)")
    ax1.set_ylabel("loss")
    ax1.grid(alpha=0.3)
    for ctx in sorted({k for w in wers.values() for k in w}, key=lambda k: (not k.isdigit(), k)):
        pts = [(s, 100 * wers[s][ctx]) for s in sorted(wers) if ctx in wers[s]]
        label = f"held-out WER, lookahead {int(ctx) * 80} ms" if ctx.isdigit() else f"panel {ctx} (480 ms)"
        ax2.plot(*zip(*pts, strict=True), marker="o", label=label)
    for ax in (ax1, ax2):
        for a, b, label in spans:
            ax.axvspan(
                a, b, color="tab:green", alpha=0.12, label=f"trained on {label}" if ax is ax1 else None
            )
    ax1.legend(fontsize=8, loc="upper left")
    ax2.set_ylabel("WER %")
    ax2.set_xlabel("training step (batch 32)")
    ax2.legend(fontsize=8, loc="lower left")
    ax2.grid(alpha=0.3)
    where = "2-core CPU" + "".join(f" + {label}" for _, _, label in spans)
    fig.suptitle(f"streaming FastConformer from scratch on synthesised speech ({where})")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=Path("asr-training.png"))
    ap.add_argument("--span", action="append", default=[], help="FROM:TO:LABEL, steps trained elsewhere")
    args = ap.parse_args(argv)
    missing = [p for p in args.logs if not p.is_file()]
    if missing:
        ap.error(f"no such log: {', '.join(map(str, missing))}")
    losses, wers = parse(args.logs)
    if not losses:
        ap.error("no 'step N ctc ...' lines in those logs")
    try:
        spans = tuple((int(a), int(b), label) for a, b, label in (x.split(":", 2) for x in args.span))
    except ValueError:
        ap.error("--span takes FROM:TO:LABEL, e.g. 4459:8707:H100")
    plot(losses, wers, args.out, spans)
    print(f"wrote {args.out} ({len(losses)} loss points, {len(wers)} validations)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
