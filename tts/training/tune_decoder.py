"""Tune the speech codec's decoder on what the flow model predicts, the encoder frozen (resumable).

    python -m tts.training.tune_decoder --run ~/.cache/duplex/runs/codec/dec1 --flow tts/weights \
        --flow-share 0.5 --minutes 60 --threads 1
    python -m tts.training.tune_decoder --run DIR --export codec/weights      # EMA -> fp16 + json

The codec recipe (`codec.training.train_codec`, every option of it applies) with one change: for a share of
the teacher examples the decoder reads the flow model's own latent instead of the encoder's. The flow model
is driven with the teacher's phonemes and durations ("ground-truth aligned", as vocoders are tuned on a
Tacotron's outputs), so its latent lines up frame by frame with the teacher's features, and is sampled as
the TTS stage samples it (chunk mask, Euler steps, fixed noise, snapped to the FSQ grid). The decoder thus
learns to turn the flow's small errors into the teacher's features, while the encoder, and so the latent the
flow predicts, stays bit for bit (`codec.speech_codec.latent_sha256`). A run started by `train_codec
--freeze-encoder` continues here (same checkpoint format); the other examples use the encoder's latent.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from codec.speech_codec import SpeechCodec
from codec.training.train_codec import LatentFn, encoder_latents
from codec.training.train_codec import main as codec_main
from tts.flow_model import FlowModel


def flow_latents(
    codec: SpeechCodec,
    flow: FlowModel,
    *,
    share: float = 0.5,
    steps: int = 4,
    chunk: int | None = None,
    temperature: float = 1.0,
    seed: int = 0,
    f0_weight: float = 0.0,
) -> LatentFn:
    """raw teacher example (index, ids, units) + log-mel -> the latent the decoder reads: the flow's
    prediction for `share` of the examples (a pure function of the example's index), else the encoder's.
    The flow samples its own intonation, not the teacher's, so its examples' F0 loss is weighted by
    `f0_weight` (0: pitch is learnt from the encoder's examples only)."""
    from_encoder = encoder_latents(codec)

    @torch.no_grad()
    def latents(raw: dict, mel: torch.Tensor) -> tuple[torch.Tensor, float]:
        n = mel.shape[0] // codec.cfg.down
        rng = np.random.default_rng([seed, int(raw["index"]), 17])
        if rng.random() >= share:
            return from_encoder(raw, mel)
        ids = torch.as_tensor(np.asarray(raw["ids"]), dtype=torch.long)[None]
        units = torch.as_tensor(np.asarray(raw["units"]), dtype=torch.long)[None]
        cond = flow.regulate(flow.encoder(ids), units, torch.tensor([n]))
        y = flow.sample(cond, steps, chunk, seed=int(rng.integers(1 << 20)), temperature=temperature)
        return codec.fsq.snap(y[0]), f0_weight

    return latents


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--flow", type=Path, default=Path("tts/weights"), help="flow weights folder (exported)")
    ap.add_argument("--flow-share", type=float, default=0.5, help="share of examples decoded from the flow")
    ap.add_argument("--flow-steps", type=int, default=4, help="Euler steps (as the profile samples)")
    ap.add_argument("--flow-chunk", type=int, default=6, help="chunk frames of the mask (the profile's)")
    ap.add_argument("--flow-temperature", type=float, default=1.0)
    ap.add_argument("--flow-f0-weight", type=float, default=0.0, help="F0 loss weight of the flow's examples")


def make_latents(codec: SpeechCodec, args: argparse.Namespace) -> LatentFn:
    from tts.flow_tts import load_flow_model

    flow, meta = load_flow_model(args.flow)
    want = meta.get("codec_latent_sha256")
    if want and codec.latent_sha256() != want:  # checked when the pool is filled (after --init / resume)
        raise SystemExit(
            f"{args.flow} predicts another codec's latent than this run's: tune that codec's decoder"
        )
    return flow_latents(
        codec,
        flow.eval(),
        share=args.flow_share,
        steps=args.flow_steps,
        chunk=args.flow_chunk,
        temperature=args.flow_temperature,
        seed=args.seed,
        f0_weight=args.flow_f0_weight,
    )


def main(argv: list[str] | None = None) -> None:
    codec_main(
        argv,
        make_latents=make_latents,
        add_arguments=add_arguments,
        module="tts.training.tune_decoder",
        doc=__doc__,
    )


if __name__ == "__main__":
    main()
