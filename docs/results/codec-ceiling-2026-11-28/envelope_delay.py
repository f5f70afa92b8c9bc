"""Does aligning the envelope with the pulses' F0 win back the codec vocoder's loss? The codec's causal vocoder
applies frame k's envelope to the window ending with pulse block k, while the pulses reach frame k's F0 at that
block's end: envelope and F0 sit 2 hops apart (hibari's DSP: half a hop). Delaying the envelope by d frames
(applying frame k's envelope to the window ending with block k + d) closes the gap at d more hops of latency.
Teacher features (whole, merged noise) through the codec's vocoder; Moonshine WER on the first n held-out sentences.

    .venv/bin/python docs/results/codec-ceiling-2026-11-28/envelope_delay.py -n 100 --delays 0 1 2 --out DIR
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
from codec.training.hibari_teacher import HibariTeacher, heldout_sentences, merged_noise


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=100)
    ap.add_argument("--delays", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    codec = load_codec("codec/weights/speech_codec.safetensors")
    teacher, scorer = HibariTeacher(threads=1), MoonshineScorer()

    def render(o, d: int) -> np.ndarray:
        f0 = torch.from_numpy(o.f0)[None]
        f0 = torch.where(f0 > 40, f0, torch.zeros_like(f0))
        lh = torch.from_numpy(np.ascontiguousarray(o.lh.T))
        nz = torch.from_numpy(np.ascontiguousarray(merged_noise(o.ln, o.lr).T))
        if d:  # frame k's envelope at the window ending with pulse block k + d
            lh = torch.cat([lh[:1].expand(d, -1), lh[:-d]])
            nz = torch.cat([nz[:1].expand(d, -1), nz[:-d]])
        with torch.no_grad():
            return codec.vocoder(f0, lh[None], nz[None])[0, 900:].numpy()

    sents = heldout_sentences()[: args.n]
    names = ["hibari"] + [f"delay{d}" for d in args.delays]
    hyps: dict[str, list[str]] = {n: [] for n in names}
    t0 = time.time()
    for i, s in enumerate(sents):
        outs = teacher.text(s, audio_seed=i)
        hyps["hibari"].append(scorer.transcribe(np.concatenate([o.audio for o in outs])))
        for d in args.delays:
            hyps[f"delay{d}"].append(scorer.transcribe(np.concatenate([render(o, d) for o in outs])))
        if (i + 1) % 25 == 0:
            wers = {n: round(100 * corpus_wer(sents[: i + 1], h), 2) for n, h in hyps.items()}
            print(f"{i + 1}/{len(sents)} {wers} ({time.time() - t0:.0f} s)", flush=True)
    res = {
        "n_sentences": len(sents),
        "n_words": sum(len(s.split()) for s in sents),
        "wer": {n: corpus_wer(sents, h) for n, h in hyps.items()},
        "command": f"docs/results/codec-ceiling-2026-11-28/envelope_delay.py -n {args.n} --delays "
        + " ".join(map(str, args.delays)),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "envelope_delay.json").write_text(json.dumps(res, indent=1))
    with open(args.out / "envelope_delay_transcripts.jsonl", "w") as f:
        for i, s in enumerate(sents):
            f.write(json.dumps({"ref": s} | {n: hyps[n][i] for n in names}) + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
