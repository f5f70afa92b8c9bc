"""Probe (thirteenth session): can the last 400 ms of audio tell a mid-sentence pause from a finished turn?

A logistic regression on a coarse log-mel of the last 40 voiced frames, trained on 200 + 200 training turns
in flite kal/awb/rms (cuts taken from whole sentences), tested on the held-out voices (flite slt and the
Kokoro blend) on the turns `duplex eval eot --speech 200` speaks. Writes acoustic_probe.json beside it. (A tidied copy of
the script that produced the numbers in docs/dialogue.md; the copy itself was not rerun.)

    OMP_NUM_THREADS=1 .venv/bin/python docs/results/eval-eot-whole/acoustic_probe.py   # ~15 min
"""

import json
import time
from pathlib import Path

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score

from asr.training.speakers import Speaker, Synth, heldout_natural_speakers
from asr.training.whole_cut import _trim_trailing_silence, cut_whole, log_mel, whole_sentence_for
from dialogue.training.turn_data import build_examples, split_examples
from dialogue.training.turn_sets import speech_examples
from duplex.base.turn_policy import LISTEN, SPEAK

HERE = Path(__file__).parent
synth = Synth()


def feats(audio: np.ndarray) -> np.ndarray:
    f = _trim_trailing_silence(log_mel(audio))[-40:]
    if len(f) < 40:
        f = np.pad(f, ((40 - len(f), 0), (0, 0)), mode="edge")
    f = f - f.max()
    return f.reshape(5, 8, 40).mean(axis=1).reshape(5, 8, 5).mean(axis=2).ravel()


def render(ex: dict, pool: list[dict], speaker: Speaker, seed: int) -> np.ndarray | None:
    draw = int(np.random.default_rng(seed).integers(2**62))
    if ex["kind"] == "cut":
        whole = whole_sentence_for(ex, pool)
        if whole is None:
            return None
        full = synth.render(whole, speaker, np.random.default_rng(draw)).audio
        alone = synth.render(ex["text"], speaker, np.random.default_rng(draw)).audio
        return cut_whole(full, alone)
    return np.asarray(synth.render(ex["text"], speaker, np.random.default_rng(draw)).audio, np.float32)


t0 = time.time()
train = [
    e
    for e in split_examples(build_examples(progress=False, heard=False))["train"]
    if e.get("head", "turn") == "turn" and e["kind"] in ("cut", "complete")
]
voices = [Speaker(f"flite:{v}", "flite", (("voice", v),)) for v in ("kal", "awb", "rms")]
xs, ys, counts = [], [], {"cut": 0, "complete": 0}
for j in np.random.default_rng(0).permutation(len(train)):
    ex = train[j]
    if counts[ex["kind"]] >= 200:
        continue
    audio = render(ex, train, voices[len(ys) % 3], int(j))
    if audio is None:
        continue
    xs.append(feats(np.asarray(audio, np.float32)))
    ys.append(int(ex["label"] == SPEAK))
    counts[ex["kind"]] += 1
    if min(counts.values()) >= 200:
        break
x, y = np.array(xs), np.array(ys)
mu, sd = x.mean(0), x.std(0) + 1e-6
clf = LogisticRegression(max_iter=3000, C=0.3).fit((x - mu) / sd, y)
print(f"trained on {len(y)} turns in {time.time() - t0:.0f} s", flush=True)

lines = (Path("data/dialogue/turn_eval.jsonl")).read_text().splitlines()
examples = [
    e
    for e in (json.loads(line) for line in lines if line.strip())
    if e.get("head", "turn") == "turn" and int(e["label"]) in (LISTEN, SPEAK)
]
speakers = heldout_natural_speakers()
rows = []
for i, ex in enumerate(speech_examples(examples, 200, 0)):
    if ex["kind"] not in ("cut", "complete"):
        continue
    speaker = speakers[i % 2]
    audio = render(ex, examples, speaker, 1000 + i)
    if audio is None:
        continue
    p = float(clf.predict_proba(((feats(np.asarray(audio, np.float32)) - mu) / sd)[None])[0, 1])
    rows.append(
        {"voice": speaker.name, "label": int(ex["label"]), "p_complete_acoustic": p, "text": ex["text"]}
    )
(HERE / "acoustic_probe.json").write_text(json.dumps(rows))
for voice in (None, "flite:slt", "kokoro:heldout-nezumi-kumo"):
    sub = [r for r in rows if voice is None or r["voice"] == voice]
    auroc = roc_auc_score([r["label"] == SPEAK for r in sub], [r["p_complete_acoustic"] for r in sub])
    print(f"{voice or 'both voices'}: n={len(sub)}, held-out AUROC {auroc:.3f}")
