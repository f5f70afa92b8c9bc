"""Probe: does Moonshine keep a dangling last word when it re-reads only the tail of the turn?

The same training turns and whole-turn transcripts as the decoder probe; Moonshine on the last S seconds.
"""

import json
import re
import sys
import time
from pathlib import Path

from asr import moonshine as M
from asr.training.train_end_of_turn import TurnStore, cache_dir

N = int(sys.argv[1]) if len(sys.argv) > 1 else 400
TAILS = [float(s) for s in (sys.argv[2].split(",") if len(sys.argv) > 2 else ["1.0", "1.5", "2.0"])]
HERE = Path(__file__).resolve().parent


def words(text: str) -> list[str]:
    t = text.lower().replace("’", "'")
    return re.sub(r"[^a-z0-9' ]+", " ", t).split()


def main():
    store = TurnStore(cache_dir() / "train-s1.npz")
    probe = json.load(open(HERE.parent / "eot-decoder-probe-2026-11-29" / "features400.json"))[:N]
    m = M.MoonshineModel(threads=1)
    out = []
    t0 = time.time()
    for i, o in enumerate(probe):
        x = store.float_audio(i)
        row = {k: o[k] for k in ("label", "voice", "text", "heard")}
        last = words(o["text"])[-1:]
        heard = words(o["heard"])
        row["dropped"] = bool(last) and heard[-1:] != last
        for s in TAILS:
            n = int(s * M.SAMPLE_RATE)
            tail = x[-n:] if x.size > n else x
            row[f"tail{s}"] = m.transcribe(tail)
        out.append(row)
        if i % 50 == 0:
            print(i, f"{time.time() - t0:.0f}s", row, flush=True)
    json.dump(out, open(HERE / f"tail{N}.json", "w"), indent=0)


if __name__ == "__main__":
    main()
