"""Probe: does the project's streaming CTC model hear speech after the end of Moonshine's transcript?

For each training turn (the acoustic cue's store, the first N; Moonshine's transcripts from the decoder probe),
force the CTC model over the transcript T and compare P(labelling == T) with P(labelling starts with T):
r = log P_exact - log P_prefix is ~0 when nothing follows T in the audio and very negative when more is heard.
"""

import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

from asr.nemo_streaming import SHIPPED, load_nemo_model
from asr.training.train_end_of_turn import TurnStore, auroc, cache_dir

N = int(sys.argv[1]) if len(sys.argv) > 1 else 400
CTX = int(sys.argv[2]) if len(sys.argv) > 2 else -1  # index into att_context_size_all (-1: the largest)
HERE = Path(__file__).resolve().parent


def lse(*xs):
    m = max(xs)
    if m == -np.inf:
        return -np.inf
    return m + np.log(sum(np.exp(x - m) for x in xs))


def ctc_exact_prefix(lp: np.ndarray, labels: list[int], blank: int) -> tuple[float, float]:
    """log P(collapse == labels), log P(collapse starts with labels); lp is (T, V) log-probs."""
    T = lp.shape[0]
    U = len(labels)
    if U == 0:
        exact = float(lp[:, blank].sum())
        return exact, 0.0
    ext = [blank]
    for lab in labels:
        ext += [lab, blank]
    S = len(ext)
    a = np.full(S, -np.inf)
    a[0] = lp[0, blank]
    a[1] = lp[0, ext[1]]
    prefix = a[S - 2]  # entering the last label at frame 0
    for t in range(1, T):
        n = np.full(S, -np.inf)
        entry_last = -np.inf
        for s in range(S):
            terms = [a[s]]
            new = []
            if s >= 1:
                new.append(a[s - 1])
            if s >= 2 and ext[s] != blank and ext[s] != ext[s - 2]:
                new.append(a[s - 2])
            n[s] = lse(*(terms + new)) + lp[t, ext[s]]
            if s == S - 2 and new:
                entry_last = lse(*new) + lp[t, ext[s]]
        prefix = lse(prefix, entry_last)
        a = n
    exact = lse(a[S - 1], a[S - 2])
    return float(exact), float(prefix)


def norm(text: str) -> str:
    t = text.lower().replace("’", "'")
    t = re.sub(r"[^a-z' ]+", " ", t)
    return " ".join(t.split())


def A(pos, neg):
    return auroc([1] * len(pos) + [0] * len(neg), np.concatenate([pos, neg]))


def main():
    import logging

    logging.disable(logging.WARNING)
    model = load_nemo_model(SHIPPED).eval()
    enc = model.encoder
    ctxs = [list(c) for c in getattr(enc, "att_context_size_all", [enc.att_context_size])]
    ctxs.sort(key=lambda c: c[1])
    enc.set_default_att_context_size(ctxs[CTX])
    blank = model.tokenizer.vocab_size
    store = TurnStore(cache_dir() / "train-s1.npz")
    probe = json.load(open(HERE.parent / "eot-decoder-probe-2026-11-29" / "features400.json"))[:N]
    out = []
    t0 = time.time()
    torch.set_num_threads(1)
    for i, o in enumerate(probe):
        x = torch.from_numpy(store.float_audio(i))[None]
        with torch.inference_mode():
            lp, _, greedy = model.forward(input_signal=x, input_signal_length=torch.tensor([x.shape[1]]))
        lp = lp[0].double().numpy()
        g = greedy[0].tolist()
        hyp = []
        prev = -1
        for k in g:
            if k != prev and k != blank:
                hyp.append(k)
            prev = k
        T = norm(o["heard"])
        ids = model.tokenizer.text_to_ids(T) if T else []
        ex, pre = ctc_exact_prefix(lp, ids, blank)
        ctc_text = model.tokenizer.ids_to_text(hyp)
        last = norm(o["text"]).split()[-1:] if o["text"] else []
        dropped = bool(last) and not T.endswith(last[0])
        out.append(
            dict(o, ctc_text=ctc_text, r=ex - pre, exact=ex, prefix=pre, frames=lp.shape[0], dropped=dropped)
        )
        if i % 50 == 0:
            print(
                i,
                f"{time.time() - t0:.0f}s",
                o["label"],
                round(ex - pre, 2),
                "|",
                T,
                "|",
                ctc_text,
                flush=True,
            )
    json.dump(out, open(HERE / f"ctc{N}-ctx{CTX}.json", "w"), indent=0)
    y = np.array([o["label"] for o in out])
    r = np.array([o["r"] for o in out])
    drop = np.array([o["dropped"] for o in out])
    print("context", ctxs[CTX])
    print("AUROC complete vs all cuts", round(A(r[y == 1], r[y == 0]), 3))
    m = (y == 1) | drop
    print(
        "AUROC complete vs cuts whose last word Moonshine dropped",
        round(A(r[m & (y == 1)], r[m & (y == 0)]), 3),
        "n",
        int((m & (y == 0)).sum()),
    )
    for eng in sorted({o["voice"].split(":")[0] for o in out}):
        e = np.array([o["voice"].startswith(eng) for o in out])
        print(eng, round(A(r[e & (y == 1)], r[e & (y == 0) & drop]), 3))


if __name__ == "__main__":
    main()
