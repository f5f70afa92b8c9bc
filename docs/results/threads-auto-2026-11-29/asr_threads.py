"""Moonshine base-en (the `cpu` profile's recogniser) on 1 and 2 onnxruntime intra-op threads: the
transcription of a 3 s held-out utterance, P50 / P90 of 15, on an idle machine or beside a busy loop that
holds one core (`--burn`). Does ASR need `threads: auto` as the slow model did?

    .venv/bin/python docs/results/asr-threads-2026-11-29/asr_threads.py [--burn]
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import time

import numpy as np

from asr.moonshine import MoonshineModel
from asr.training.speakers import Synth, heldout_natural_speakers

TEXT = "Could you tell me how long it takes to boil an egg so that the yolk stays soft?"


def burn(stop: mp.Event) -> None:  # type: ignore[valid-type]
    x = 0
    while not stop.is_set():  # type: ignore[attr-defined]
        for _ in range(100_000):
            x += 1


def main() -> None:
    audio = Synth().render(TEXT, heldout_natural_speakers()[0], np.random.default_rng(0)).audio
    print(f"utterance {len(audio) / 16000:.2f} s", flush=True)
    stop = mp.Event()
    proc = None
    if "--burn" in sys.argv:
        proc = mp.Process(target=burn, args=(stop,), daemon=True)
        proc.start()
        time.sleep(1.0)
    try:
        for threads in (1, 2):
            m = MoonshineModel(threads=threads)
            text = m.transcribe(audio)
            ms = []
            for _ in range(15):
                t0 = time.perf_counter()
                m.transcribe(audio)
                ms.append(1000 * (time.perf_counter() - t0))
            q = statistics.quantiles(ms, n=10)
            print(
                f"{'burn' if proc else 'idle'} threads {threads}: P50 {statistics.median(ms):.0f} ms, "
                f"P90 {q[-1]:.0f} ms (n 15) — {text!r}",
                flush=True,
            )
    finally:
        stop.set()
        if proc is not None:
            proc.join()


if __name__ == "__main__":
    main()
