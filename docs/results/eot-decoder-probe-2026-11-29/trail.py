"""Does Moonshine drop a cut's last word because of the silence after it? Training turns only."""

import re
import sys

import numpy as np

from asr.end_of_turn import HOP, WIN, log_mel, trailing_silence_start
from asr.moonshine import MoonshineModel
from asr.training.train_end_of_turn import TurnStore, cache_dir


def words(t):
    return re.findall(r"[a-z']+", t.lower())


store = TurnStore(cache_dir() / "train-s1.npz")
m = MoonshineModel(threads=1)
N = int(sys.argv[1]) if len(sys.argv) > 1 else 300
TRAILS = (0.0, 0.05, 0.1, 0.2)
stats = {lab: {t: [0, 0] for t in TRAILS} for lab in (0, 1)}
for i in range(min(N, len(store.labels))):
    x = store.float_audio(i)
    e = np.log(np.exp(log_mel(x)).sum(axis=1) + 1e-12)
    end = min(len(x), trailing_silence_start(e) * HOP + WIN)
    voice = x[:end]
    ref = words(store.texts[i])
    if not ref:
        continue
    for t in TRAILS:
        a = np.concatenate([voice, np.zeros(int(t * 16000), np.float32)])
        h = words(m.transcribe(a))
        kept = bool(h) and h[-1] == ref[-1]
        stats[store.labels[i]][t][0] += kept
        stats[store.labels[i]][t][1] += 1
for lab, name in ((0, "cut"), (1, "complete")):
    print(name, {t: f"{k}/{n} last word kept" for t, (k, n) in stats[lab].items()})
