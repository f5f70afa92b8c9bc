"""Compute cost of the flow TTS on one thread: first chunk (phrase text in -> first ~225 ms of PCM out)
P50/P90, steady-state RTF per Euler step count, and the cost of chunk 2 vs chunk 50 of a long stream.

    python -m tts.training.bench_flow --weights tts/weights [--threads 1] [--out bench.json]

Costs do not depend on how well the model is trained, only on its dimensions and the durations it predicts,
so any exported checkpoint (even a few steps old) measures the runtime.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from duplex.base.config import ComponentConfig
from duplex.base.messages import TtsInput
from tts.flow_tts import FlowTtsStage, load_flow_tts_stage

PHRASES = [
    "Sure, I can help with that.",
    "The capital of France is Paris.",
    "Well, it depends on the weather.",
    "I think so too.",
    "Let me check that for you.",
]
LONG = (
    "The capital of France is Paris. It is a beautiful city, with many museums and cafes, and the river "
    "runs right through the middle of it, so you can walk along it for hours."
)


@torch.no_grad()
def first_chunk_seconds(stage: FlowTtsStage, phrase: str) -> float:
    """G2P + encoder + durations + the flow and codec steps up to the first chunk that holds speech (the
    lead pad's frames are computed, their audio dropped): what the first audible sound waits for."""
    t0 = time.perf_counter()
    utt = stage.utterances(phrase)[0]
    state = stage.model.init_state(1, stage.steps, stage.chunk)
    dec = stage.codec.init_state(1)
    done = 0
    while done <= utt.skip + 1 and done < utt.frames:  # +1: the codec's one frame of delay
        n = min(stage.chunk, utt.frames - done)
        y, state = stage.model.step(state, utt.cond[:, done : done + n], utt.mu[:, done : done + n])
        _, dec = stage.codec.decode_latent_step(dec, stage._latent(y))
        done += n
    return time.perf_counter() - t0


@torch.no_grad()
def chunk_costs(stage: FlowTtsStage, chunks: int = 52, repeats: int = 5) -> dict:
    """Seconds for chunk 2 and chunk 50 of one stream (flow + codec), median of `repeats` streams."""
    utt = stage.utterances(LONG)[0]
    cond = utt.cond[:, :1].expand(1, chunks * stage.chunk, -1).contiguous()
    mu = utt.mu[:, :1].expand(1, chunks * stage.chunk, -1).contiguous()
    t = {2: [], 50: []}
    for _ in range(repeats):
        fs, ds = stage.model.init_state(1, stage.steps, stage.chunk), stage.codec.init_state(1)
        for c in range(chunks):
            a = c * stage.chunk
            t0 = time.perf_counter()
            y, fs = stage.model.step(fs, cond[:, a : a + stage.chunk], mu[:, a : a + stage.chunk])
            _, ds = stage.codec.decode_latent_step(ds, stage._latent(y))
            if c in t:
                t[c].append(time.perf_counter() - t0)
    return {f"chunk{c}_ms": 1e3 * float(np.median(v)) for c, v in t.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", type=Path, default=Path("tts/weights"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    stage = load_flow_tts_stage(
        ComponentConfig(name="tts", backend="flow", weights={"path": str(args.weights)})
    )
    stage.step(stage.init_state(), TtsInput("Warm up, please.", True))
    res: dict = {"threads": args.threads, "chunk_ms": stage.chunk * stage.codec.cfg.samples_per_code / 24.0}
    for steps in (2, 4, 8):
        stage.steps = steps
        first = [
            first_chunk_seconds(stage, p) for _ in range(args.repeats // len(PHRASES) + 1) for p in PHRASES
        ]
        t0 = time.perf_counter()
        out, _ = stage.step(stage.init_state(), TtsInput(LONG, True))
        secs = sum(len(c.audio) for c in out) / 24000
        res[f"steps{steps}"] = {
            "first_chunk_p50_ms": 1e3 * float(np.percentile(first, 50)),
            "first_chunk_p90_ms": 1e3 * float(np.percentile(first, 90)),
            "rtf": (time.perf_counter() - t0) / secs,
            "audio_s": secs,
        } | chunk_costs(stage)
    print(json.dumps(res, indent=1))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
