import json
import sys

import numpy as np

from asr.end_of_turn import features
from asr.training.train_end_of_turn import TurnStore, cache_dir, choose_l2

N = int(sys.argv[1])
d = json.load(open(f"features{N}.json"))
store = TurnStore(cache_dir() / "train-s1.npz")
xa = np.stack([features(store.float_audio(i)) for i in range(len(d))])


def dec(o):
    ends = o["punct_p"] is not None
    h = o["heard"].strip()
    return [
        float(ends),
        np.log(o["punct_word"] + 1e-4) if ends else np.log(1e-4),
        np.log(o["punct_p"]) if ends else 0.0,
        np.log(o["eos_word"] + 1e-5),
        float(h.endswith(",")),
        float(h == ""),
    ]


xd = np.array([dec(o) for o in d])
y = np.array([o["label"] for o in d], float)
eng = np.array([o["voice"].split(":")[0] for o in d])
for name, x in (("acoustic", xa), ("decoder", xd), ("both", np.concatenate([xa, xd], 1))):
    z = (x - x.mean(0)) / (x.std(0) + 1e-6)
    l2, table = choose_l2(z, y, eng)
    print(name, "l2", l2, {k: round(v, 3) for k, v in table[str(l2)].items()})
