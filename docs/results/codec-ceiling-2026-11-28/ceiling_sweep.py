"""How intelligible can any decoder of this codec design be? The teacher's own features (merged noise
envelope, theta = 0) through the codec's vocoder, with the two 601-bin log-envelopes kept whole or
projected on k principal directions (as the decoder predicts them). Moonshine WER on the first n held-out
sentences, all variants on the same hibari renderings.

    .venv/bin/python docs/results/codec-ceiling-2026-11-28/ceiling_sweep.py -n 200 --k 48 64 96 --out DIR
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from asr.training.wer import wer as corpus_wer
from codec.speech_codec import load_codec
from codec.training.eval_codec import MoonshineScorer
from codec.training.hibari_teacher import HibariTeacher, heldout_sentences, merged_noise, training_sentences
from codec.training.train_codec import TeacherSource, fit_pca


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("--k", type=int, nargs="+", default=[48, 64, 96])
    ap.add_argument("--pca-examples", type=int, default=300)
    ap.add_argument("--weights", default="codec/weights/speech_codec.safetensors")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = load_codec(args.weights)
    src = TeacherSource(training_sentences(), seed=0, threads=1)
    ex = [src(i) for i in range(args.pca_examples)]
    bases = {k: fit_pca(ex, k) for k in args.k}
    explained = {k: {n: float(b[f"{n}_explained"]) for n in ("lh", "nz")} for k, b in bases.items()}
    print("explained variance", explained, flush=True)

    def render(o, k: int | None) -> np.ndarray:
        def proj(x: np.ndarray, name: str) -> torch.Tensor:
            t = torch.from_numpy(np.ascontiguousarray(x.T)).float()
            if k is None:
                return t
            mu = torch.from_numpy(bases[k][f"{name}_mean"]).float()
            basis = torch.from_numpy(bases[k][f"{name}_basis"]).float()
            return mu + ((t - mu) @ basis.T) @ basis

        f0 = torch.from_numpy(o.f0)[None]
        f0 = torch.where(f0 > 40, f0, torch.zeros_like(f0))
        with torch.no_grad():
            y = model.vocoder(f0, proj(o.lh, "lh")[None], proj(merged_noise(o.ln, o.lr), "nz")[None])
        return y[0, 900:].numpy()

    teacher, scorer = HibariTeacher(threads=1), MoonshineScorer()
    sents = heldout_sentences()[: args.n]
    names = ["hibari", "whole", *[f"pca{k}" for k in args.k]]
    hyps: dict[str, list[str]] = {n: [] for n in names}
    t0 = time.time()
    for i, s in enumerate(sents):
        outs = teacher.text(s, audio_seed=i)
        hyps["hibari"].append(scorer.transcribe(np.concatenate([o.audio for o in outs])))
        hyps["whole"].append(scorer.transcribe(np.concatenate([render(o, None) for o in outs])))
        for k in args.k:
            hyps[f"pca{k}"].append(scorer.transcribe(np.concatenate([render(o, k) for o in outs])))
        if (i + 1) % 25 == 0:
            wers = {n: round(100 * corpus_wer(sents[: i + 1], h), 2) for n, h in hyps.items()}
            print(f"{i + 1}/{len(sents)} {wers} ({time.time() - t0:.0f} s)", flush=True)
    res = {
        "n_sentences": len(sents),
        "n_words": sum(len(s.split()) for s in sents),
        "wer": {n: corpus_wer(sents, h) for n, h in hyps.items()},
        "explained_variance": explained,
        "command": "docs/results/codec-ceiling-2026-11-28/ceiling_sweep.py "
        + " ".join(f"{a}" for a in ["-n", args.n, "--k", *args.k]),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ceiling.json").write_text(json.dumps(res, indent=1))
    with open(args.out / "transcripts.jsonl", "w") as f:
        for i, s in enumerate(sents):
            f.write(json.dumps({"ref": s} | {n: hyps[n][i] for n in names}) + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
