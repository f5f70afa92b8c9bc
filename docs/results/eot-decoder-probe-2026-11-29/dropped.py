"""Probe: does Moonshine's decoder know a word was dropped? Features at the transcript's end, on training turns."""

import json
import re
import sys
from pathlib import Path

import numpy as np

from asr import moonshine as M
from asr.training.train_end_of_turn import TurnStore, auroc, cache_dir

N = int(sys.argv[1]) if len(sys.argv) > 1 else 400


class Probe(M.MoonshineModel):
    def steps(self, x):
        """greedy ids and, per emitted position, the softmax row that chose it (last row: the EOS choice)."""
        hidden = self._encoder.run(None, {"input_values": x[None, :]})[0]
        max_tokens = int(x.size / M.SAMPLE_RATE * M.MAX_TOKENS_PER_SECOND) + 1
        past = {n: np.zeros((1, h, 0, s), np.float32) for n, (h, s) in self._past_shape.items()}
        feed = {
            "input_ids": np.array([[M.BOS]], np.int64),
            "encoder_hidden_states": hidden,
            "use_cache_branch": np.array([False]),
            **past,
        }
        ids, rows = [], []
        while True:
            logits, *present = self._decoder.run(None, feed)
            z = logits[0, -1].astype(np.float64)
            p = np.exp(z - z.max())
            p /= p.sum()
            token = int(p.argmax())
            rows.append(p.astype(np.float32))
            for name, value in zip(self._past_names, present, strict=True):
                if ".decoder." in name or not feed["use_cache_branch"][0]:
                    past[name] = value
            if token == M.EOS or len(ids) >= max_tokens:
                break
            ids.append(token)
            feed = {
                "input_ids": np.array([[token]], np.int64),
                "encoder_hidden_states": hidden,
                "use_cache_branch": np.array([True]),
                **past,
            }
        return ids, rows


def main():
    store = TurnStore(cache_dir() / "train-s1.npz")
    m = Probe(threads=1)
    toks = [t.decode("utf-8", "replace").replace(M._SPACE_MARK, " ") for t in m.tokens]
    punct = np.array([bool(re.fullmatch(r"\s*[.!?,;:]+\s*", t)) for t in toks])
    punct[: M.N_SPECIAL] = False
    endp = np.array([bool(re.fullmatch(r"\s*[.!?]+\s*", t)) for t in toks])
    endp[: M.N_SPECIAL] = False
    word = ~punct
    word[: M.N_SPECIAL] = False
    V = 32768

    def pad(a):
        return np.concatenate([a, np.zeros(V - len(a), bool)])

    punct, endp, word = pad(punct), pad(endp), pad(word)
    out = []
    for i in range(min(N, len(store.labels))):
        ids, rows = m.steps(store.float_audio(i))
        text = M.decode_tokens(m.tokens, ids)
        # the position that chose the final end punctuation (if the transcript ends in one)
        last_p = len(ids) - 1 if ids and endp[ids[-1]] else None
        f = {"label": store.labels[i], "voice": store.voices[i], "text": store.texts[i], "heard": text}
        f["eos_p"] = float(rows[-1][M.EOS])
        f["eos_word"] = float(rows[-1][word].sum())  # mass on going on with a word instead of EOS
        if last_p is not None:
            r = rows[last_p]
            f["punct_p"] = float(r[ids[-1]])
            f["punct_word"] = float(r[word].sum())
            f["punct_eos"] = float(r[M.EOS])
            top = np.argsort(-np.where(word, r, 0))[:3]
            f["punct_alt"] = [(toks[t] if t < len(toks) else "?", round(float(r[t]), 3)) for t in top]
        else:
            f["punct_p"] = f["punct_word"] = f["punct_eos"] = None
        out.append(f)
        if i % 50 == 0:
            print(i, f, flush=True)
    Path(f"features{N}.json").write_text(json.dumps(out, indent=0))
    y = np.array([o["label"] for o in out])
    for k in ("eos_p", "eos_word", "punct_p", "punct_word", "punct_eos"):
        s = np.array(
            [(o[k] if o[k] is not None else (1.0 if k in ("punct_p", "eos_p") else 0.0)) for o in out]
        )
        print(k, "AUROC complete-vs-cut", round(auroc(y, s), 3), "(low score = cut if < 0.5)")
    ends = np.array([o["punct_p"] is not None for o in out])
    print("ends in . ! ?: complete", ends[y == 1].mean(), "cut", ends[y == 0].mean())


main()
