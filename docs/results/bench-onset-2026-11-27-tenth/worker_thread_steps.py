"""The dialogue engine's steps on a worker thread after DuplexService.load, as the executor runs them.

    .venv/bin/python docs/results/bench-onset-2026-11-27-tenth/worker_thread_steps.py new
    .venv/bin/python docs/results/bench-onset-2026-11-27-tenth/worker_thread_steps.py old   # pools left

2026-11-27, this 2-core machine, idle: old: slice listen 112, listen at a pause 55, first draft 80 ms;
new: 66, 29, 39 ms (P50, 12 turns; load 26 vs 24 s).
"""

import contextlib
import sys
import threading
import time

import numpy as np

import duplex.runtime.service as service
from duplex.base.messages import ListenStep, RespondStep

if sys.argv[1:] == ["old"]:
    service.loading_without_pools = contextlib.nullcontext  # type: ignore[assignment]
t0 = time.perf_counter()
svc = service.DuplexService.load("cpu", progress=False)
load_s = time.perf_counter() - t0
llm = svc.stages.llm
QUESTIONS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What is a baby dog called?",
    "What colour is the sky?",
    "What is six times seven?",
    "How do I boil an egg?",
] * 2


def work() -> None:
    hist: list[dict[str, str]] = []
    state = llm.init_state()
    slices, pauses, drafts = [], [], []
    for q in QUESTIONS:
        words = q.split()
        for k in range(2, len(words), 2):
            t = time.perf_counter()
            _, state = llm.step(state, ListenStep(list(hist), " ".join(words[:k]), True, True))
            slices.append(time.perf_counter() - t)
        t = time.perf_counter()
        _, state = llm.step(state, ListenStep(list(hist), q, False, True))
        pauses.append(time.perf_counter() - t)
        t = time.perf_counter()
        _, state = llm.step(
            state, RespondStep([*hist, {"role": "user", "content": q}], 4, True, phrase_words=3)
        )
        drafts.append(time.perf_counter() - t)
        hist += [
            {"role": "user", "content": q},
            {"role": "assistant", "content": "The answer is a short sentence."},
        ]
    ms = [1000 * float(np.median(x)) for x in (slices, pauses, drafts)]
    print(
        f"load {load_s:.0f} s; slice listen {ms[0]:.0f}, listen at a pause {ms[1]:.0f}, first draft {ms[2]:.0f} ms"
    )


worker = threading.Thread(target=work)
worker.start()
worker.join()
svc.close()
