"""Lab: does autoguidance (a weaker model of the same kind steering the flow) buy intelligibility?

Classifier-free guidance needs a model trained with dropped conditions; ours was not. Autoguidance
(Karras et al., 2024, "Guiding a diffusion model with a bad version of itself") needs only a weaker model
of the same kind: v = v_strong + w (v_strong - v_weak). Here the strong model is the shipped flow (step
15,128) and the weak one the flow shipped before it on the same latent (step 8,270, commit 3a12755). Both
read the same phonemes and the strong model's durations (each through its own encoder and regulator),
the same fixed noise, the chunk mask the stage samples under, 2 Euler steps; the latent is snapped to
the FSQ grid and decoded by the shipped codec, the lead's frames dropped as the stage drops them, and
Moonshine transcribes each held-out sentence. w = 0 is the strong model alone through the same path.

    python docs/results/flow-autoguidance-2026-11-28/autoguidance.py --weak /tmp/flow8270 -n 100 --w 0 1 2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--weak", type=Path, required=True, help="folder with the weak flow_model.*")
    ap.add_argument("--strong", type=Path, default=Path("tts/weights"))
    ap.add_argument("-n", type=int, default=100)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--w", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("autoguidance.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)

    from codec.speech_codec import load_codec
    from codec.training.eval_codec import MoonshineScorer, corpus_wer
    from codec.training.hibari_teacher import heldout_sentences
    from duplex.eval.paired import paired_wer_difference
    from tts.flow_model import UNIT_SUBFRAMES, chunk_mask, euler_times
    from tts.flow_tts import (
        LEAD_KEEP_FRAMES,
        LEAD_UNITS,
        PAUSE_UNITS,
        HibariFrontEnd,
        load_flow_model,
        pause_kind,
    )

    strong, meta = load_flow_model(args.strong)
    weak, _ = load_flow_model(args.weak)
    for name in ("latent_mean", "latent_std"):
        if not torch.equal(getattr(strong, name), getattr(weak, name)):
            print(f"note: {name} differs between the models; velocities are mixed in each model's own units")
    codec = load_codec("codec/weights/speech_codec.safetensors")
    front = HibariFrontEnd()
    scorer = MoonshineScorer()
    c = strong.cfg
    skip = max(0, int(LEAD_UNITS * UNIT_SUBFRAMES) // c.subframes - LEAD_KEEP_FRAMES)

    @torch.no_grad()
    def render(text: str, w: float, seed: int) -> np.ndarray:
        pieces = []
        sents = front.sentences(text)
        for si, ids in enumerate(sents):
            ids_t = torch.tensor([ids])
            h_s = strong.encoder(ids_t)
            units = strong.predict_units(h_s)
            units[0, 0] = LEAD_UNITS
            units[0, -1] = PAUSE_UNITS[pause_kind(text) if si == len(sents) - 1 else "sentence"]
            cs = strong.regulate(h_s, units)
            cw = weak.regulate(weak.encoder(ids_t), units, frames=cs.frames) if w else None
            n = int(cs.frames[0])
            frames = torch.arange(n)[None]
            x = strong.noise_for(frames, torch.tensor([seed + 7919 * si]))
            mask = chunk_mask(n, c.chunk, c.left_chunks, x.device)[None, None]
            ts = euler_times(args.steps)
            for s in range(args.steps):
                t = torch.full((1,), ts[s])
                v = strong.estimate(x, t, cs.cond, cs.mu, mask)
                if w:
                    v = v + w * (v - weak.estimate(x, t, cw.cond, cw.mu, mask))
                x = x + (ts[s + 1] - ts[s]) * v
            y = codec.fsq.snap(strong.denormalize(x))
            st = codec.init_state(1)
            a, st = codec.decode_latent_step(st, y)
            a = torch.cat([a, codec.flush(st)], 1)[0, codec.cfg.output_delay :].numpy()
            pieces.append(a[skip * codec.cfg.samples_per_code :])
        return np.concatenate(pieces)

    sentences = heldout_sentences()[args.start : args.start + args.n]
    hyp: dict[str, list[str]] = {str(w): [] for w in args.w}
    t0 = time.time()
    try:
        for i, text in enumerate(sentences):
            for w in args.w:
                hyp[str(w)].append(scorer.transcribe(render(text, w, seed=i)))
            if i % 20 == 19:
                print(f"{i + 1}/{len(sentences)} ({time.time() - t0:.0f} s)", flush=True)
    finally:
        scorer.close()
    base = str(args.w[0])
    res = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "strong_step": meta.get("step"),
        "weak": str(args.weak),
        "steps": args.steps,
        "sentences": [args.start, args.start + args.n],
        "wer": {w: corpus_wer(sentences, h) for w, h in hyp.items()},
        "vs_first": {w: paired_wer_difference(sentences, hyp[base], h) for w, h in hyp.items() if w != base},
        "transcripts": [{"text": t, **{w: h[i] for w, h in hyp.items()}} for i, t in enumerate(sentences)],
    }
    args.out.write_text(json.dumps(res, indent=1))
    for w, v in res["wer"].items():
        d = res["vs_first"].get(w)
        extra = f"  {d['delta_pt']:+.1f} pt [{d['ci95_pt'][0]:+.1f}, {d['ci95_pt'][1]:+.1f}]" if d else ""
        print(f"w = {w}: WER {100 * v:.2f} %{extra}")


if __name__ == "__main__":
    main()
