"""ceiling.png from ceiling.json and attribution.json (run from the repository root)."""

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

d = "docs/results/codec-ceiling-2026-11-28/"
a = json.load(open(d + "ceiling.json"))
b = json.load(open(d + "attribution.json"))
c = json.load(open(d + "envelope_delay.json"))
fig, ax = plt.subplots(1, 3, figsize=(15, 3.8), gridspec_kw={"width_ratios": [5, 6, 4]})
panels = (
    (ax[0], a, f"teacher features through the codec's vocoder (n=200 sentences, {a['n_words']} words)"),
    (ax[1], b, f"one vocoder change at a time (n=100, {b['n_words']} words)"),
    (ax[2], c, "the codec vocoder, envelope delayed d frames (n=200)"),
)
for axi, res, title in panels:
    names = list(res["wer"])
    vals = [100 * res["wer"][n] for n in names]
    axi.bar(names, vals, color=["#777"] + ["#4a7"] * (len(names) - 1))
    for i, v in enumerate(vals):
        axi.text(i, v + 0.1, f"{v:.1f}", ha="center", fontsize=8)
    axi.set_ylabel("Moonshine WER %")
    axi.set_title(title, fontsize=9)
    axi.tick_params(axis="x", labelsize=8, rotation=20)
fig.tight_layout()
fig.savefig(d + "ceiling.png", dpi=110)
