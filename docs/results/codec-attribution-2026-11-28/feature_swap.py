"""Which of the decoder's outputs costs the codec's round trip its words?

The decoder turns the latent into four 80 Hz features: voicing (a logit), log F0, and the PCA coefficients of the
harmonic (`lh`) and noise (`nz`) log-envelopes. The round trip (hibari audio -> encode -> FSQ -> decode -> the
codec's vocoder) sits ~1.3 points of Moonshine WER above hibari, and the teacher's own features through the same
vocoder ~0.2 (docs/codec.md). This script renders held-out sentences with the shipped decoder's features, and with
one group at a time replaced by the teacher's (projected on the same PCA basis), so each group's share of the gap
shows:

    decoded            the shipped decoder (postfilter folded in)
    teacher            every feature the teacher's (the vocoder's ceiling)
    +teacher_pitch     the decoder's envelopes, the teacher's voicing and F0
    +teacher_lh        the teacher's harmonic envelope
    +teacher_nz        the teacher's noise envelope

    .venv/bin/python docs/results/codec-attribution-2026-11-28/feature_swap.py -n 100 \
        --out docs/results/codec-attribution-2026-11-28
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from asr.training.wer import wer as corpus_wer
from codec.speech_codec import LOG_F0_MEAN, LOG_F0_STD, Features, load_codec
from codec.training.eval_codec import MoonshineScorer
from codec.training.hibari_teacher import HibariTeacher, heldout_sentences, merged_noise

VOICED_HZ = 40.0


def coefs(codec, name: str, x: np.ndarray) -> torch.Tensor:
    return codec.envelope_coefs(name, torch.from_numpy(np.ascontiguousarray(x, np.float32)))


@torch.no_grad()
def decoded(codec, audio: np.ndarray) -> Features:
    mel = codec.mel(torch.from_numpy(audio)[None])
    t = mel.shape[1] // codec.cfg.down * codec.cfg.down
    return codec.decode_features(codec.fsq(codec.encode_latent(mel[:, :t]))[0])


@torch.no_grad()
def render(codec, feats: Features) -> np.ndarray:
    f0, lh, nz = codec.expand(feats)
    state = codec.init_state(1)
    audio, voc = codec.vocoder.step(state.vocoder, f0, lh, nz)
    return torch.cat([audio, codec.vocoder.flush(voc)], 1)[0, codec.cfg.output_delay :].numpy()


def teacher_features(codec, outs, n: int) -> Features:
    f0 = torch.from_numpy(np.concatenate([o.f0 for o in outs]).astype(np.float32))
    lh = coefs(codec, "lh", np.concatenate([o.lh.T for o in outs]))
    nz = coefs(codec, "nz", np.concatenate([merged_noise(o.ln, o.lr).T for o in outs]))
    m = min(n, len(f0))

    def fit(x: torch.Tensor) -> torch.Tensor:  # the decoder's length: pad with the last frame
        x = x[:m]
        return torch.cat([x, x[-1:].expand(n - m, *x.shape[1:])]) if m < n else x

    f0 = fit(f0)
    voicing = torch.where(f0 > VOICED_HZ, 10.0, -10.0)
    log_f0 = (torch.log(f0.clamp(min=VOICED_HZ)) - LOG_F0_MEAN) / LOG_F0_STD
    return Features(voicing[None], log_f0[None], fit(lh)[None], fit(nz)[None])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", default="codec/weights/speech_codec.safetensors")
    ap.add_argument("-n", type=int, default=100)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    codec = load_codec(args.weights).eval()
    teacher = HibariTeacher(threads=1)
    sents = heldout_sentences()[args.offset : args.offset + args.n]
    names = ["hibari", "decoded", "teacher", "+teacher_pitch", "+teacher_lh", "+teacher_nz"]
    hyps: dict[str, list[str]] = {k: [] for k in names}
    scorer = MoonshineScorer()
    t0 = time.time()
    try:
        for i, s in enumerate(sents):
            outs = teacher.text(s, audio_seed=1000 + args.offset + i)  # as `duplex eval tts` renders them
            audio = np.concatenate([o.audio for o in outs])
            d = decoded(codec, audio)
            t = teacher_features(codec, outs, d.lh.shape[1])
            variants = {
                "decoded": d,
                "teacher": t,
                "+teacher_pitch": Features(t.voicing, t.log_f0, d.lh, d.nz),
                "+teacher_lh": Features(d.voicing, d.log_f0, t.lh, d.nz),
                "+teacher_nz": Features(d.voicing, d.log_f0, d.lh, t.nz),
            }
            hyps["hibari"].append(scorer.transcribe(audio))
            for k, f in variants.items():
                hyps[k].append(scorer.transcribe(render(codec, f)))
            if (i + 1) % 20 == 0:
                wers = {k: round(100 * corpus_wer(sents[: i + 1], h), 2) for k, h in hyps.items()}
                print(f"{i + 1}/{len(sents)} {wers} ({time.time() - t0:.0f} s)", flush=True)
    finally:
        scorer.close()
    res = {
        "weights": args.weights,
        "n_sentences": len(sents),
        "n_words": sum(len(s.split()) for s in sents),
        "wer": {k: corpus_wer(sents, h) for k, h in hyps.items()},
        "command": f"feature_swap.py -n {args.n} --offset {args.offset}",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "feature_swap.json").write_text(json.dumps(res, indent=1))
    with open(args.out / "feature_swap_transcripts.jsonl", "w") as f:
        for i, s in enumerate(sents):
            f.write(json.dumps({"ref": s} | {k: hyps[k][i] for k in names}) + "\n")
    print(json.dumps(res["wer"], indent=1))


if __name__ == "__main__":
    main()
