"""Training loss of the lookahead decoder against the causal decoder trained on (run3dec, same data stream, same
regression loss; started from the decoder before its postfilter was folded in).

    python docs/results/codec-lookahead-2026-11-28/plot.py
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

here = Path(__file__).parent


def rows(name: str) -> list[dict]:
    return [json.loads(x) for x in (here / name).read_text().splitlines() if x.strip()]


la, ctl = rows("metrics.jsonl"), rows("control-run3dec-metrics.jsonl")
fig, ax = plt.subplots(figsize=(7, 4))
ax.plot([r["step"] for r in ctl], [r["total"] for r in ctl], label="causal decoder (run3dec)", alpha=0.8)
ax.plot(
    [r["step"] for r in la], [r["total"] for r in la], label="one code frame of lookahead (la1)", alpha=0.8
)
ax.set(xlabel="decoder step", ylabel="regression loss (train_codec)", ylim=(0.65, 0.9), xlim=(0, 7000))
ax.set_title("decoder with lookahead: re-aligning from the shipped weights")
ax.legend()
fig.tight_layout()
fig.savefig(here / "loss.png", dpi=90)
