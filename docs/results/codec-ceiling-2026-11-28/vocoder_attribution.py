"""Where does the codec's vocoder lose intelligibility against hibari's own DSP? The teacher's exact
features (no PCA, no codec) through hibari's numpy DSP with one change at a time, and through the codec's
causal torch vocoder. Moonshine WER on the first n held-out sentences, all variants on the same renderings.

    .venv/bin/python docs/results/codec-ceiling-2026-11-28/vocoder_attribution.py -n 100 --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from hibari import dsp

from asr.training.wer import wer as corpus_wer
from codec.speech_codec import load_codec
from codec.training.eval_codec import MoonshineScorer
from codec.training.hibari_teacher import HibariTeacher, heldout_sentences, merged_noise


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=100)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    codec = load_codec("codec/weights/speech_codec.safetensors")
    teacher, scorer = HibariTeacher(threads=1), MoonshineScorer()

    def ours(o) -> np.ndarray:
        f0 = torch.from_numpy(o.f0)[None]
        f0 = torch.where(f0 > 40, f0, torch.zeros_like(f0))
        lh = torch.from_numpy(np.ascontiguousarray(o.lh.T))[None]
        nz = torch.from_numpy(np.ascontiguousarray(merged_noise(o.ln, o.lr).T))[None]
        with torch.no_grad():
            return codec.vocoder(f0, lh, nz)[0, 900:].numpy()

    def variants(o, seed: int) -> dict[str, np.ndarray]:
        rng = lambda: np.random.default_rng(seed)  # noqa: E731
        zero = np.zeros_like(o.theta)
        rand_phi = np.random.default_rng(seed + 1).uniform(-math.pi, math.pi, o.phi.shape).astype(np.float32)
        silent = np.full_like(o.lr, -30.0)
        return {
            "hibari": dsp.synth(o.lh, o.theta, o.ln, o.lr, o.phi, o.f0, rng()),
            "theta0": dsp.synth(o.lh, zero, o.ln, o.lr, o.phi, o.f0, rng()),
            "phi_random": dsp.synth(o.lh, o.theta, o.ln, o.lr, rand_phi, o.f0, rng()),
            "merged": dsp.synth(o.lh, o.theta, merged_noise(o.ln, o.lr), silent, o.phi, o.f0, rng()),
            "theta0_merged": dsp.synth(o.lh, zero, merged_noise(o.ln, o.lr), silent, o.phi, o.f0, rng()),
            "codec_vocoder": ours(o),
        }

    sents = heldout_sentences()[: args.n]
    hyps: dict[str, list[str]] = {}
    t0 = time.time()
    for i, s in enumerate(sents):
        outs = teacher.text(s, audio_seed=i)
        parts = [variants(o, 1000 * i + j) for j, o in enumerate(outs)]
        for name in parts[0]:
            hyps.setdefault(name, []).append(scorer.transcribe(np.concatenate([p[name] for p in parts])))
        if (i + 1) % 25 == 0:
            wers = {n: round(100 * corpus_wer(sents[: i + 1], h), 2) for n, h in hyps.items()}
            print(f"{i + 1}/{len(sents)} {wers} ({time.time() - t0:.0f} s)", flush=True)
    res = {
        "n_sentences": len(sents),
        "n_words": sum(len(s.split()) for s in sents),
        "wer": {n: corpus_wer(sents, h) for n, h in hyps.items()},
        "command": f"docs/results/codec-ceiling-2026-11-28/vocoder_attribution.py -n {args.n}",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attribution.json").write_text(json.dumps(res, indent=1))
    with open(args.out / "attribution_transcripts.jsonl", "w") as f:
        for i, s in enumerate(sents):
            f.write(json.dumps({"ref": s} | {n: h[i] for n, h in hyps.items()}) + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
