"""The streamed-Moonshine distillation run: loss and panel WER by step (metrics.jsonl beside this file, or the run's).

python docs/results/asr-moonshine-stream-2026-11-29/plot.py [~/.cache/duplex/runs/mstream1/metrics.jsonl]
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).resolve().parent


def main() -> None:
    src = Path(sys.argv[1]).expanduser() if len(sys.argv) > 1 else HERE / "metrics.jsonl"
    rows = [json.loads(line) for line in open(src)]
    train = [r for r in rows if r["kind"] == "train"]
    panel = [r for r in rows if r["kind"] == "panel"]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    ax[0].plot([r["step"] for r in train], [r["loss"] for r in train], lw=1)
    ax[0].set_title("distillation loss (L1 + 1 - cos), 10-step means")
    ax[0].set_xlabel("step (8 utterances each)")
    for key, label in (
        ("natural-conversational", "natural conversational"),
        ("heldout-synthetic", "plain held-out synthetic"),
    ):
        ax[1].plot(
            [r["step"] for r in panel], [r[key] for r in panel], "o-", label=f"{label} (streamed, 480 ms)"
        )
    ax[1].axhline(6.7, ls="--", c="C0", alpha=0.6, label="Moonshine, full context: natural conv. 6.7 %")
    ax[1].axhline(50.6, ls=":", c="gray", label="shipped FastConformer, natural conv. 50.6 %")
    ax[1].set_title("panel WER (%), Moonshine's decoder on the streamed frames")
    ax[1].set_xlabel("step")
    ax[1].legend(fontsize=7)
    for a in ax:
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(HERE / "curve.png", dpi=110)
    print(f"wrote {HERE / 'curve.png'}")


if __name__ == "__main__":
    main()
