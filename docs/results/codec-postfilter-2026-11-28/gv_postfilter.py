"""Is the codec decoder's output over-smoothed, and does a global-variance postfilter win back intelligibility?

The decoder regresses the teacher's normalised PCA coefficients of the two log-envelopes (harmonic `lh`, noise
`nz`); a regression's output has less variance than its target (it predicts the conditional mean), which
flattens formants. Step 1 measures, over M training sentences, the per-coefficient mean and std of the teacher's
coefficients and of the decoder's (hibari audio -> encode -> FSQ -> decode). Step 2 renders the first n held-out
sentences through the codec with the decoder's coefficients moved toward the teacher's statistics,
c' = m_t + (c - m_p) * (s_t / s_p) ** alpha (fixed per coefficient: stateless, so streaming is unchanged), and
scores them with Moonshine against hibari itself.

    .venv/bin/python docs/results/codec-postfilter-2026-11-28/gv_postfilter.py --stats 60 -n 100 \
        --alphas 0 0.5 1 --out docs/results/codec-postfilter-2026-11-28
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from asr.training.wer import wer as corpus_wer
from codec.speech_codec import Features, load_codec
from codec.training.eval_codec import MoonshineScorer
from codec.training.hibari_teacher import HibariTeacher, heldout_sentences, merged_noise, training_sentences


def coefs(codec, name: str, x: np.ndarray) -> torch.Tensor:
    x = torch.from_numpy(np.ascontiguousarray(x, np.float32))
    return ((x - getattr(codec, f"{name}_mean")) @ getattr(codec, f"{name}_basis").T) / getattr(
        codec, f"{name}_std"
    )


@torch.no_grad()
def decoded(codec, audio: np.ndarray) -> tuple[Features, torch.Tensor]:
    a = torch.from_numpy(audio)[None]
    mel = codec.mel(a)
    t = mel.shape[1] // codec.cfg.down * codec.cfg.down
    zq = codec.fsq(codec.encode_latent(mel[:, :t]))[0]
    return codec.decode_features(zq), zq


@torch.no_grad()
def render(codec, feats: Features) -> np.ndarray:
    f0, lh, nz = codec.expand(feats)
    state = codec.init_state(1)
    audio, voc = codec.vocoder.step(state.vocoder, f0, lh, nz)
    out = torch.cat([audio, codec.vocoder.flush(voc)], 1)
    return out[0, codec.cfg.output_delay :].numpy()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", default="codec/weights/speech_codec.safetensors")
    ap.add_argument("--stats", type=int, default=60, help="training sentences for the statistics")
    ap.add_argument("-n", type=int, default=100, help="held-out sentences to score")
    ap.add_argument("--offset", type=int, default=0, help="first held-out sentence (a validation slice)")
    ap.add_argument("--tag", default="", help="suffix of the output files")
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    codec = load_codec(args.weights).eval()
    teacher = HibariTeacher(threads=1)
    t0 = time.time()

    # 1. statistics on training sentences (every 97th, a fixed spread over the corpus)
    train = training_sentences()[::97][: args.stats]
    acc = {k: {"t": [], "p": []} for k in ("lh", "nz")}
    for i, s in enumerate(train):
        outs = teacher.text(s, audio_seed=i)
        audio = np.concatenate([o.audio for o in outs])
        feats, _ = decoded(codec, audio)
        n = feats.lh.shape[1]
        t_lh = coefs(codec, "lh", np.concatenate([o.lh.T for o in outs]))
        t_nz = coefs(codec, "nz", np.concatenate([merged_noise(o.ln, o.lr).T for o in outs]))
        m = min(n, len(t_lh))
        acc["lh"]["t"].append(t_lh[:m]), acc["lh"]["p"].append(feats.lh[0, :m])
        acc["nz"]["t"].append(t_nz[:m]), acc["nz"]["p"].append(feats.nz[0, :m])
    stats = {}
    for k, d in acc.items():
        t, p = torch.cat(d["t"]), torch.cat(d["p"])
        corr = ((t - t.mean(0)) * (p - p.mean(0))).mean(0) / (t.std(0) * p.std(0) + 1e-8)
        stats[k] = {"m_t": t.mean(0), "s_t": t.std(0), "m_p": p.mean(0), "s_p": p.std(0), "corr": corr}
    summary = {
        k: {
            "frames": int(sum(len(x) for x in acc[k]["t"])),
            "std_ratio_pred_over_teacher_first8": (v["s_p"] / v["s_t"])[:8].round(decimals=3).tolist(),
            "std_ratio_mean": float((v["s_p"] / v["s_t"]).mean()),
            "corr_first8": v["corr"][:8].round(decimals=3).tolist(),
            "corr_mean": float(v["corr"].mean()),
        }
        for k, v in stats.items()
    }
    print(json.dumps(summary, indent=1), f"({time.time() - t0:.0f} s)", flush=True)

    def post(feats: Features, alpha: float) -> Features:
        if alpha == 0:
            return feats
        moved = {}
        for k in ("lh", "nz"):
            st = stats[k]
            scale = (st["s_t"] / st["s_p"].clamp(min=1e-3)) ** alpha
            moved[k] = st["m_t"] * alpha + st["m_p"] * (1 - alpha) + (getattr(feats, k) - st["m_p"]) * scale
        return Features(feats.voicing, feats.log_f0, moved["lh"], moved["nz"])

    # 2. held-out sentences, as `duplex eval tts` renders them (audio_seed 1000 + i)
    sents = heldout_sentences()[args.offset : args.offset + args.n]
    names = ["hibari"] + [f"alpha{a:g}" for a in args.alphas]
    hyps: dict[str, list[str]] = {n: [] for n in names}
    scorer = MoonshineScorer()
    try:
        for i, s in enumerate(sents):
            audio = np.concatenate([o.audio for o in teacher.text(s, audio_seed=1000 + args.offset + i)])
            hyps["hibari"].append(scorer.transcribe(audio))
            feats, _ = decoded(codec, audio)
            for a in args.alphas:
                hyps[f"alpha{a:g}"].append(scorer.transcribe(render(codec, post(feats, a))))
            if (i + 1) % 25 == 0:
                wers = {n: round(100 * corpus_wer(sents[: i + 1], h), 2) for n, h in hyps.items()}
                print(f"{i + 1}/{len(sents)} {wers} ({time.time() - t0:.0f} s)", flush=True)
    finally:
        scorer.close()
    res = {
        "weights": args.weights,
        "n_sentences": len(sents),
        "n_words": sum(len(s.split()) for s in sents),
        "stats_sentences": len(train),
        "decoder_vs_teacher": summary,
        "wer": {n: corpus_wer(sents, h) for n, h in hyps.items()},
        "command": f"gv_postfilter.py --stats {args.stats} -n {args.n} --offset {args.offset} --alphas "
        + " ".join(f"{a:g}" for a in args.alphas),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"gv_postfilter{args.tag}.json").write_text(json.dumps(res, indent=1))
    torch.save({k: {kk: vv for kk, vv in v.items()} for k, v in stats.items()}, args.out / "gv_stats.pt")
    with open(args.out / f"gv_postfilter{args.tag}_transcripts.jsonl", "w") as f:
        for i, s in enumerate(sents):
            f.write(json.dumps({"ref": s} | {n: hyps[n][i] for n in names}) + "\n")
    print(json.dumps(res["wer"], indent=1))


if __name__ == "__main__":
    main()
