"""Lab: does one code frame of decoder lookahead win the codec's round trip back?

The codec's decoder is strictly causal at the code rate: the features of code frame k come from latents
0..k only (the encoder reads 3 feature frames ahead, so latent k has heard 37.5 ms past its frame). With
one code frame of lookahead the decoder hears latent k+1 before it speaks frame k. The network is the
same; only its target moves: output frame j is trained to the teacher's frame j - 3 (one code frame
earlier), so the decoder stays causal and its output is simply one code frame (900 samples) later.

`train`: the decoder alone (encoder frozen: the flow's latent is unchanged), warm-started from the shipped
codec, regression losses as train_codec, targets shifted; checkpoints in --run. `eval`: hibari audio ->
shipped encoder -> shipped decoder and the lookahead decoder (same codes, one padding frame repeated at
the end for the lookahead) -> Moonshine, on held-out sentences, with a paired interval.

    python docs/results/codec-lookahead-2026-11-28/lookahead.py train --run ~/.cache/duplex/runs/codec/la1 --minutes 40
    python docs/results/codec-lookahead-2026-11-28/lookahead.py eval --run ~/.cache/duplex/runs/codec/la1 -n 200
    python -m codec.training.postfilter --weights ~/.cache/duplex/runs/codec/la1/export/speech_codec.safetensors \
        --alpha 2 --stats 60 --out /tmp/la1-pf
    python docs/results/codec-lookahead-2026-11-28/lookahead.py eval --run ~/.cache/duplex/runs/codec/la1 -n 200 \
        --candidate /tmp/la1-pf/speech_codec.safetensors
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

SHIPPED = "codec/weights/speech_codec.safetensors"
SHIFT = 3  # feature frames per code frame: one code frame of lookahead


def shifted_loss(model, batch, spectral: float = 0.0):
    """train_codec.codec_loss with output frame j trained to the teacher's frame j - SHIFT: the targets (and
    their mask) move SHIFT frames later, the first SHIFT frames masked out; the decoder reads the same `zq`."""
    from codec.training.train_codec import codec_loss

    def late(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.zeros_like(x[:, :SHIFT]), x[:, :-SHIFT]], 1)

    return codec_loss(model, batch | {k: late(batch[k]) for k in ("f0", "lh", "nz", "mask")}, spectral)


def train(args: argparse.Namespace) -> None:
    from safetensors.torch import load_file

    import codec.training.train_codec as tc
    from codec.speech_codec import load_codec
    from codec.training.hibari_teacher import training_sentences

    torch.set_num_threads(1)
    tc.codec_loss = shifted_loss  # the trainer's step calls the module's codec_loss
    run: Path = args.run.expanduser()
    run.mkdir(parents=True, exist_ok=True)
    cfg = load_codec(SHIPPED).cfg
    trainer = tc.Trainer(
        cfg,
        tc.TeacherSource(training_sentences(), seed=0, threads=1),
        pool_size=args.pool,
        lr=args.lr,
        lr_halflife=6000,
        freeze_encoder=True,
    )
    ck = run / tc.CKPT
    if ck.is_file():
        trainer.load_state_dict(torch.load(ck, map_location="cpu", weights_only=False))
        print(f"resumed at step {trainer.step_n}")
    else:
        sd = {k: v.float() for k, v in load_file(SHIPPED).items()}
        trainer.model.load_state_dict(sd)
        trainer.ema.load_state_dict(sd)
        trainer.pca_ready = True
        trainer.pos = tc.export_position(Path(SHIPPED)) or 0
    trainer.pool.latents = tc.encoder_latents(trainer.model)
    trainer.start()
    t0 = last = time.time()
    log = open(run / "metrics.jsonl", "a")
    acc: dict[str, float] = {}
    while time.time() - t0 < args.minutes * 60:
        parts = trainer.step()
        for k, v in parts.items():
            acc[k] = acc.get(k, 0.0) + v
        if trainer.step_n % 100 == 0:
            row = {"step": trainer.step_n, "time": time.time()} | {k: v / 100 for k, v in acc.items()}
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(
                f"step {trainer.step_n} total {row['total']:.4f} lh {row['lh']:.3f} nz {row['nz']:.3f}",
                flush=True,
            )
            acc = {}
        if time.time() - last > 8 * 60:
            tc.save_checkpoint(ck, **trainer.state_dict(), command="lookahead.py train")
            last = time.time()
    tc.save_checkpoint(ck, **trainer.state_dict(), command="lookahead.py train")
    print(tc.export(run, run / "export"))


def evaluate(args: argparse.Namespace) -> None:
    from codec.speech_codec import load_codec
    from codec.training.eval_codec import MoonshineScorer, corpus_wer
    from codec.training.hibari_teacher import HibariTeacher, heldout_sentences
    from duplex.eval.paired import paired_wer_difference

    torch.set_num_threads(1)
    base = load_codec(SHIPPED)
    la = load_codec(str(args.candidate or args.run.expanduser() / "export" / "speech_codec.safetensors"))
    teacher, scorer = HibariTeacher(threads=1), MoonshineScorer()
    sentences = heldout_sentences()[: args.n]
    hyp = {"hibari": [], "shipped": [], "lookahead": []}
    t0 = time.time()
    try:
        for i, s in enumerate(sentences):
            audio = np.concatenate([o.audio for o in teacher.text(s, audio_seed=1000 + i)])
            with torch.no_grad():
                codes = base.encode(torch.from_numpy(audio)[None])
                y0 = base.decode(codes)[0, base.cfg.output_delay :].numpy()
                padded = torch.cat([codes, codes[:, -1:]], 1)  # the lookahead's last frame needs one more
                y1 = la.decode(padded)[0, la.cfg.output_delay + la.cfg.samples_per_code :].numpy()
            hyp["hibari"].append(scorer.transcribe(audio))
            hyp["shipped"].append(scorer.transcribe(y0))
            hyp["lookahead"].append(scorer.transcribe(y1))
            if i % 25 == 24:
                print(f"{i + 1}/{len(sentences)} ({time.time() - t0:.0f} s)", flush=True)
    finally:
        scorer.close()
    res = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "n": len(sentences),
        "wer": {k: corpus_wer(sentences, v) for k, v in hyp.items()},
        "lookahead_vs_shipped": paired_wer_difference(sentences, hyp["shipped"], hyp["lookahead"]),
        "transcripts": [{"text": t, **{k: v[i] for k, v in hyp.items()}} for i, t in enumerate(sentences)],
    }
    out = args.out or Path(__file__).with_name("lookahead.json")
    out.write_text(json.dumps(res, indent=1))
    d = res["lookahead_vs_shipped"]
    print({k: round(100 * v, 2) for k, v in res["wer"].items()}, f"{d['delta_pt']:+.2f} pt", d["ci95_pt"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["train", "eval"])
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=40)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--pool", type=int, default=2000)
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--candidate", type=Path, default=None, help="eval: another lookahead codec file (postfiltered)"
    )
    args = ap.parse_args()
    train(args) if args.what == "train" else evaluate(args)


if __name__ == "__main__":
    main()
