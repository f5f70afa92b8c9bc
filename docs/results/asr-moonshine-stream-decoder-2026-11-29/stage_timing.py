"""Per-step time of the ASR stages in isolation: one 3.9 s question fed in 0.5 s pieces, a partial at each piece,
the final with the last. Streamed Moonshine (`cpu-streaming`, one and two threads) vs Moonshine whole (`cpu`).

PYTHONPATH=. python docs/results/asr-moonshine-stream-decoder-2026-11-29/stage_timing.py
"""

import dataclasses
import time

import numpy as np
import torch

from duplex.base.config import load_profile
from duplex.base.messages import AsrChunk
from duplex.runtime.service import load_asr
from tests.speech import silence, synthesize

TEXT = "Can you recommend a good book about the history of Rome?"


def run(stage, audio: np.ndarray, piece: int = 8000) -> tuple[float, float, str]:
    state, partials, final, text = stage.init_state(), [], 0.0, ""
    for i in range(0, audio.size, piece):
        last = i + piece >= audio.size
        t = time.perf_counter()
        out, state = stage.step(state, AsrChunk(audio[i : i + piece], transcribe=True, final=last))
        dt = time.perf_counter() - t
        if last:
            final, text = dt, out.text or ""
        else:
            partials.append(dt)
    return 1000 * float(np.median(partials)), 1000 * final, text


def main() -> None:
    torch.set_num_threads(1)
    audio = np.concatenate([silence(0.2), synthesize(TEXT), silence(0.3)])
    cfg = load_profile("cpu-streaming").component("asr")
    stages = {
        "streamed, 1 thread": load_asr(dataclasses.replace(cfg, options={**cfg.options, "threads": 1})),
        "streamed, 2 threads": load_asr(dataclasses.replace(cfg, options={**cfg.options, "threads": 2})),
        "Moonshine whole (cpu)": load_asr(load_profile("cpu").component("asr")),
    }
    print(f"audio {audio.size / 16000:.1f} s")
    for _ in range(2):  # the first round warms up
        for name, stage in stages.items():
            partial, final, text = run(stage, audio)
            print(f"{name:<24} partial median {partial:4.0f} ms, final {final:4.0f} ms  {text!r}")


if __name__ == "__main__":
    main()
