"""Moonshine's decoder reading the streamed encoder's frames (asr/moonshine_stream.py), frozen packaged weights:
panel WER per encoder setting (docs/asr.md, "Moonshine's encoder, streamed").

    python docs/results/asr-moonshine-probe-2026-11-29/probe.py natural-conversational
"""

import sys
import time

import torch

from asr.moonshine import MoonshineModel, decode_tokens
from asr.moonshine_stream import load_packaged
from asr.training.panel import panel_set
from asr.training.wer import wer

CONFIGS = {
    "full": {"chunk_frames": None, "causal_norm": False},
    "causal-norm": {"chunk_frames": None, "causal_norm": True},
    "chunk20-left250": {"chunk_frames": 20, "left_frames": 250},
    "chunk40-left250": {"chunk_frames": 40, "left_frames": 250},
}


def main() -> None:
    torch.set_num_threads(1)
    model = MoonshineModel(threads=1)
    for name in sys.argv[1:] or ["natural-conversational"]:
        utts = panel_set(name)
        refs = [u.text for u in utts]
        for cname, kw in CONFIGS.items():
            enc = load_packaged(**kw)
            hyps, t0 = [], time.time()
            for u in utts:
                with torch.no_grad():
                    h = enc(torch.from_numpy(u.audio)[None]).numpy()
                hyps.append(decode_tokens(model.tokens, model.decode_frames(h, u.audio.size)))
            print(
                name,
                cname,
                f"{100 * wer(refs, hyps):.1f} %",
                f"{time.time() - t0:.0f} s",
                hyps[:3],
                flush=True,
            )


if __name__ == "__main__":
    main()
