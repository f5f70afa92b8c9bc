"""The streamed-Moonshine runs on one curve: `mstream1` (feature distillation, steps 0-806), `mstream2`
(through Moonshine's decoder, 806-1396), `mstream3` (the decoder + the pool's known text, 1396-2495) and
`mstream4` (the KL only where the teacher hears the known text, 2495-3245) and `mstream5` (2,000 fresh
utterances and the text's CE at weight 1.0, from 3245 on): the decoder's KL and panel WER by step.

(It replaces the first two runs' own scripts, which drew their folders' curve.png.)

python docs/results/asr-moonshine-stream-text-2026-11-29/plot.py [--out curve.png]   # reads the metrics files
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).resolve().parent
RUNS = (
    (HERE.parent / "asr-moonshine-stream-2026-11-29" / "metrics.jsonl", "features: L1 + (1 - cos)"),
    (HERE.parent / "asr-moonshine-stream-decoder-2026-11-29" / "metrics.jsonl", "decoder: KL"),
    (HERE / "metrics.jsonl", "text: KL on the known text + 0.5 x its CE"),
    (
        HERE.parent / "asr-moonshine-stream-klright-2026-11-29" / "metrics.jsonl",
        "kl-right: KL where the teacher is right",
    ),
    (
        HERE.parent / "asr-moonshine-stream-fresh-2026-11-29" / "metrics.jsonl",
        "fresh: + 2,000 new utterances, CE x 1.0",
    ),
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(HERE / "curve.png"))
    out = Path(ap.parse_args().out)
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for i, (src, label) in enumerate(RUNS):
        if not src.exists():
            continue
        rows = [json.loads(line) for line in open(src)]
        train = [r for r in rows if r["kind"] == "train"]
        panel = [r for r in rows if r["kind"] == "panel"]
        key = "kl" if "kl" in train[-1] else "loss"
        ax[0].plot(
            [r["step"] for r in train], [r[key] for r in train], lw=1, c=f"C{i}", label=f"{label} ({key})"
        )
        if "ce" in train[-1]:
            ax[0].plot([r["step"] for r in train], [r["ce"] for r in train], lw=1, c=f"C{i}", ls=":",
                       label="text cross-entropy")  # fmt: skip
        for key, style in (("natural-conversational", "o-"), ("heldout-synthetic", "s--")):
            ax[1].plot(
                [r["step"] for r in panel], [r[key] for r in panel], style, c=f"C{i}",
                label=f"{key.replace('-', ' ')}, {label.split(':')[0]}",
            )  # fmt: skip
    ax[0].set_title("training loss, 10-step means")
    ax[0].set_xlabel("step (8 utterances each)")
    ax[0].set_ylim(0, 1.5)
    ax[0].legend(fontsize=7)
    ax[1].axhline(6.7, ls="--", c="gray", alpha=0.6, label="Moonshine, full context: natural conv. 6.7 %")
    ax[1].axhline(
        36.8, ls=":", c="gray", alpha=0.6, label="Moonshine, full context: held-out synthetic 36.8 %"
    )
    ax[1].axhline(12, ls="-.", c="red", alpha=0.5, label="target, held-out synthetic: 12 %")
    ax[1].set_title("panel WER (%), streamed at 480 ms (n = 60 per set)")
    for a in ax:
        # the objective changes (each run goes on from the one before's export); 1995, 2945, 3695: decay phases
        for x in (806, 1396, 1995, 2495, 2945, 3245, 3695):
            a.axvline(x, c="k", lw=0.6, alpha=0.4)
    ax[1].set_xlabel("step")
    ax[1].legend(fontsize=6)
    for a in ax:
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
