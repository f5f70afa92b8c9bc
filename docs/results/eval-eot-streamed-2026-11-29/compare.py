"""Paired comparison of two `duplex eval eot` runs on the same spoken turns: takeover at the shipped rule and
whether a cut turn's last word survives in the transcript.

python docs/results/eval-eot-streamed-2026-11-29/compare.py docs/results/eval-eot-fresh-2026-11-29/eot.json \\
    docs/results/eval-eot-streamed-2026-11-29/eot.json > docs/results/eval-eot-streamed-2026-11-29/compare.txt
"""

import json
import re
import sys

import numpy as np


def load(path: str) -> tuple[dict, dict]:
    d = json.load(open(path))
    spoken = [r for r in d["rows"] if r["voice"] != "text"]
    # the shipped rule's per-turn takeover is listed in the order of the run's spoken cut rows
    cut_rows = [r for r in spoken if r["kind"] == "cut"]
    taken = d["shipped"]["speech"]["cut_pause_taken"]
    assert len(cut_rows) == len(taken), (len(cut_rows), len(taken))
    for r, t in zip(cut_rows, taken, strict=True):
        r["_taken"] = t
    return d, {(r["text"], r["voice"]): r for r in spoken}


def words(s: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", s.lower())


def kept(r: dict) -> bool:
    t, h = words(r["text"]), words(r["heard"])
    return bool(t) and bool(h) and h[-1] == t[-1]


def main() -> None:
    a, ra = load(sys.argv[1])
    b, rb = load(sys.argv[2])
    keys = sorted(set(ra) & set(rb))
    print(f"common spoken turns: {len(keys)} (a {len(ra)}, b {len(rb)})")
    for name, d in (("A", a), ("B", b)):
        s = d["shipped"]["speech"]
        print(
            f"{name}: pause takeover {100 * s['pause_takeover']:.1f} %, hesitation "
            f"{100 * s['hesitation_takeover']:.1f} %, fast {100 * s['fast_share']:.1f} %, "
            f"mean wait {s['wait_mean_ms']:.0f} ms"
        )
    cuts = [k for k in keys if ra[k]["kind"] == "cut"]
    ka = np.array([kept(ra[k]) for k in cuts])
    kb = np.array([kept(rb[k]) for k in cuts])
    print(
        f"cut turns whose last word is the transcript's last: A {ka.sum()}/{len(cuts)}, B {kb.sum()}/{len(cuts)}; "
        f"A only {int((ka & ~kb).sum())}, B only {int((kb & ~ka).sum())}"
    )
    ma = sum(ra[k]["heard"].strip()[-1:] in ".?!" for k in cuts)
    mb = sum(rb[k]["heard"].strip()[-1:] in ".?!" for k in cuts)
    print(f"cut turns heard ending in . ? !: A {ma}, B {mb}")
    ta = np.array([ra[k]["_taken"] for k in cuts])
    tb = np.array([rb[k]["_taken"] for k in cuts])
    print(
        f"taken over: A {int(ta.sum())}, B {int(tb.sum())}; A only {int(((ta > 0) & (tb == 0)).sum())}, "
        f"B only {int(((tb > 0) & (ta == 0)).sum())}"
    )
    rng = np.random.default_rng(0)
    picks = (rng.integers(0, len(cuts), len(cuts)) for _ in range(4000))
    diffs = [tb[i].mean() - ta[i].mean() for i in picks]
    print(
        f"takeover B - A: {100 * (tb.mean() - ta.mean()):+.1f} pt (95 % paired interval "
        f"{100 * np.percentile(diffs, 2.5):+.1f} .. {100 * np.percentile(diffs, 97.5):+.1f})"
    )
    for k in cuts:
        if ra[k]["_taken"] or rb[k]["_taken"]:
            print(
                f"  A{'X' if ra[k]['_taken'] else ' '} B{'X' if rb[k]['_taken'] else ' '} {k[0]!r}\n"
                f"      A {ra[k]['heard']!r}\n      B {rb[k]['heard']!r}"
            )


if __name__ == "__main__":
    main()
