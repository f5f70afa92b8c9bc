"""Paired comparison of the same 100 held-out cuts spoken alone (eval-eot-600, shipped heads) and cut
from their whole sentences (this folder): `.venv/bin/python docs/results/eval-eot-whole/pair.py`."""

import json
import re

from duplex.eval import eot as E
from duplex.eval.eot import _policy_of

new = json.load(open("docs/results/eval-eot-whole/eot.json"))
old = json.load(open("docs/results/eval-eot-600/eot-shipped-heads.json"))
cut_new = [r for r in new["rows"] if r["voice"] != "text" and r["label"] == 0]
cut_old = [r for r in old["rows"] if r["voice"] != "text" and r["label"] == 0][: len(cut_new)]
assert [(r["text"], r["voice"]) for r in cut_new] == [(r["text"], r["voice"]) for r in cut_old], "unpaired"
policy = _policy_of(None)


def words(s: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]", " ", s.lower()).split()


for voice in (None, "flite:slt", "kokoro:heldout-nezumi-kumo"):
    for name, rows in (("alone", cut_old), ("whole", cut_new)):
        sub = [r for r in rows if voice is None or r["voice"] == voice]
        at = next(p for p in E.sweep(sub, policy, E.Waits()) if p["fast_take"] == 0.93)
        last = sum(bool(words(r["heard"])) and words(r["heard"])[-1] == words(r["text"])[-1] for r in sub)
        print(
            f"{voice or 'both voices':28s} {name}: n={len(sub)} pause takeover {at['pause_takeover']:.0%}, "
            f"hesitation takeover {at['hesitation_takeover']:.0%}, cut's last word heard last {last / len(sub):.0%}"
        )
