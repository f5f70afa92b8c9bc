"""The `cpu` profile's slow model (int8 0.5B): a 40-token prefill and 8 decoded tokens, P50 of 5, with 1 and 2
torch threads and with `threads: auto` (resolved per run as the engine resolves it per step).

    .venv/bin/python docs/results/threads-auto-2026-11-28/threads.py 1,2,auto
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from dialogue.kv_cache import CachedLM
from dialogue.llm_weights import load
from duplex.base.config import load_profile
from duplex.base.devices import resolve_threads, torch_threads

TEXT = (
    "The caller asked about the weather in Paris tomorrow and whether it will rain in the afternoon, "
    "and then what to wear for a walk by the river with a friend."
)


def main() -> None:
    cfg = load_profile("cpu").component("llm")
    model, tok = load(cfg, "int8-dynamic", progress=False)
    lm = CachedLM(model, sink_tokens=4, window_tokens=1024)
    ids = tok(TEXT)["input_ids"][:40]

    def run() -> tuple[float, float]:
        c = lm.new()
        t0 = time.perf_counter()
        lm.feed(c, ids)
        t1 = time.perf_counter()
        for _ in range(8):
            lm.feed(c, [int(c.logits.argmax())])
        return 1000 * (t1 - t0), 1000 * (time.perf_counter() - t1) / 8

    for want in (sys.argv[1] if len(sys.argv) > 1 else "1,2,auto").split(","):
        n = want if want == "auto" else int(want)
        with torch_threads(n):
            chosen = torch.get_num_threads() if n == "auto" else n
            run()
            r = [run() for _ in range(5)]
        print(
            f"threads {want} ({chosen}; free cores now {resolve_threads('auto')}): prefill 40 tokens P50 "
            f"{statistics.median(x[0] for x in r):.0f} ms, decode P50 {statistics.median(x[1] for x in r):.0f} ms/token",
            flush=True,
        )


if __name__ == "__main__":
    main()
