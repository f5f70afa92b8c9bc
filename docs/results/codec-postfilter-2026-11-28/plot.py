"""postfilter.png: codec round-trip WER by postfilter alpha on each set (the JSONs beside this file).

.venv/bin/python docs/results/codec-postfilter-2026-11-28/plot.py
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from asr.training.wer import wer

HERE = Path(__file__).resolve().parent


def main() -> None:
    lab = json.loads((HERE / "gv_postfilter.json").read_text())["wer"]
    val = json.loads((HERE / "gv_postfilter-val1000.json").read_text())["wer"]
    ev = {a: json.loads((HERE / f"eval-codec-alpha{a}.json").read_text())["transcripts"] for a in (0, 2, 3)}
    sets: dict[str, dict[str, float]] = {
        "lab: held-out 0-99\n(alpha chosen here)": {k.replace("alpha", ""): v for k, v in lab.items()},
        "validation: held-out\n1000-1099": {k.replace("alpha", ""): v for k, v in val.items()},
    }
    for lo, hi, name in (
        (0, 100, "eval: held-out 0-99"),
        (100, 200, "eval: held-out 100-199\n(unseen by the choice)"),
    ):
        refs = [t["text"] for t in ev[0][lo:hi]]
        sets[name] = {str(a): wer(refs, [t["codec"] for t in rows[lo:hi]]) for a, rows in ev.items()}
    fig, ax = plt.subplots(figsize=(10, 4))
    colors = {
        "hibari": "0.6",
        "0": "tab:red",
        "1": "tab:orange",
        "2": "tab:green",
        "3": "tab:blue",
        "4": "tab:purple",
    }
    width = 0.15
    for i, w in enumerate(sets.values()):
        for j, (k, v) in enumerate(w.items()):
            ax.bar(
                i + (j - len(w) / 2) * width,
                100 * v,
                width,
                color=colors[k],
            )
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, ["hibari itself", *(f"alpha {k}" for k in list(colors)[1:])], fontsize=8, ncol=3)
    ax.set_xticks(range(len(sets)), list(sets), fontsize=8)
    ax.set_ylabel("Moonshine WER, %")
    ax.set_title("codec round trip with the global-variance postfilter folded into the decoder head")
    fig.tight_layout()
    fig.savefig(HERE / "postfilter.png", dpi=90)


if __name__ == "__main__":
    main()
