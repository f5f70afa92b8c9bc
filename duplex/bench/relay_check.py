"""How the relay's draft is checked, measured in the dialogue engine: relay off, the learned verifier, the
verifier with only the draft's head that restates the caller committed ("grounded"), and the slow model's
exact check, on the same held-out factual questions (as text).

    OMP_NUM_THREADS=1 .venv/bin/python -m duplex.bench.relay_check --profile cpu --facts 40 --out bench-out/relay

For each question and each way: a listen step on the question (as the user's words arrive, with the
drafter's pre-close), then the answer's first step until the TTS's first phrase (3 words): its time is
what the answer's onset waits on in the engine; then the rest of the answer, scored by the question's
keywords. A draft-attributable wrong fact is a question the relay answers wrong and relay-off right.
After a committed draft, the seam: when the TTS's second phrase (the slow model's first words) was ready
after the first, against how long the first phrase lasts in hibari's voice; where it came later, a
listener hears a pause inside the answer (`seam_gap_ms`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: the ways a first answer step can go: session options on `RespondStep`
MODES: dict[str, dict[str, Any]] = {
    "off": {"relay": False},
    "verifier": {"relay": True, "relay_check": "verifier"},
    "grounded": {"relay": True, "relay_check": "grounded"},
    "exact": {"relay": True, "relay_check": "exact"},
}


def spoken_seconds(voice: Any, phrase: str) -> float:
    """How long `voice` (a TTS stage) speaks `phrase`."""
    from duplex.eval.tts import speak

    return len(speak(voice, phrase)) / voice.sample_rate if phrase.strip() else 0.0


def answer(stage: Any, question: str, mode: dict[str, Any], voice: Any = None) -> dict[str, Any]:
    """One answer to `question` as the live service gives it (the drafter pre-closing the turn as the
    words arrive); the first phrase's time in ms, and with a `voice`, how long the first phrase sounds
    and by how much the second phrase came after it had been spoken (`seam_gap_ms`, 0: no pause)."""
    from duplex.bench.llm_quality import answer_with_relay

    r, relay = answer_with_relay(stage, [], question, preclose=True, **mode)
    ready = r["phrase_ready_s"]
    kept = bool(relay is not None and relay.prefix)
    heard = spoken_seconds(voice, r["first_phrase"]) if voice is not None and kept else None
    gap = (
        round(max(0.0, 1000 * (ready[1] - ready[0] - heard)), 1)
        if heard is not None and len(ready) > 1
        else None
    )
    return {
        "draft_kept": kept,
        "first_phrase_ms": None if heard is None else round(1000 * heard, 1),
        "seam_gap_ms": gap,
        # the first phrase ready for the TTS (a committed draft under a phrase's words waits for the
        # slow model's), and the second after it
        "first_ms": round(1000 * ready[0], 1) if ready else round(1000 * r["first_phrase_s"], 1),
        "seam_ms": round(1000 * (ready[1] - ready[0]), 1) if len(ready) > 1 else None,
        "first_phrase": r["first_phrase"],
        "answer": r["answer"],
        "draft": relay.draft if relay is not None else None,
        "kept": relay.prefix if relay is not None else None,
    }


def _pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def summarise(rows: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per way: first phrase P50/P90, facts right, and wrong answers where relay-off was right."""
    out: dict[str, Any] = {}
    for name, rs in rows.items():
        times = [r["first_ms"] for r in rs]
        # committed drafts: how long the slow model's first phrase came after the draft's, and how much
        # of that the draft's phrase, as hibari speaks it, did not cover (a pause at the seam)
        seams = [r["seam_ms"] for r in rs if r.get("draft_kept") and r.get("seam_ms") is not None]
        gaps = [r["seam_gap_ms"] for r in rs if r.get("draft_kept") and r.get("seam_gap_ms") is not None]
        out[name] = {
            "n": len(rs),
            "first_p50_ms": statistics.median(times),
            "first_p90_ms": _pct(times, 0.9),
            "committed": sum(bool(r.get("draft_kept")) for r in rs),
            "seam_p50_ms": statistics.median(seams) if seams else None,
            "seam_p90_ms": _pct(seams, 0.9) if seams else None,
            "seam_gaps": sum(g > 0 for g in gaps),
            "seam_gap_max_ms": max(gaps) if gaps else None,
            "correct": sum(r["ok"] for r in rs),
            "wrong_where_off_right": (
                [r["q"] for r, o in zip(rs, rows["off"], strict=True) if o["ok"] and not r["ok"]]
                if "off" in rows and name != "off"
                else []
            ),
        }
    return out


def table(summary: dict[str, Any]) -> str:
    lines = [
        f"{'way':<10}{'first P50':>10}{'P90':>8}{'right':>9}{'kept':>6}{'seam P50':>10}{'P90':>8}{'gaps':>6}"
        "  wrong where relay-off was right"
    ]
    for name, s in summary.items():
        seam = (
            f"{s['seam_p50_ms']:>8.0f}ms{s['seam_p90_ms']:>6.0f}ms"
            if s.get("seam_p50_ms") is not None
            else f"{'-':>10}{'-':>8}"
        )
        lines.append(
            f"{name:<10}{s['first_p50_ms']:>8.0f}ms{s['first_p90_ms']:>6.0f}ms{s['correct']:>5}/{s['n']:<3}"
            f"{s.get('committed', 0):>6}{seam}{s.get('seam_gaps', 0):>6}  "
            + ("; ".join(s["wrong_where_off_right"]) or "-")
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m duplex.bench.relay_check", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--profile", default="cpu")
    ap.add_argument(
        "--facts", type=int, default=40, help="the first N questions of data/dialogue/facts_eval.jsonl"
    )
    ap.add_argument("--modes", default=",".join(MODES), help=f"a comma list of {', '.join(MODES)}")
    ap.add_argument("--out", default="bench-out/relay-check")
    ap.add_argument(
        "--no-voice",
        action="store_true",
        help="do not time the committed phrase in hibari's voice (no seam gaps)",
    )
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown way(s) {', '.join(unknown)}: one of {', '.join(MODES)}")

    import torch

    from dialogue.engine import load_dialogue_stage
    from duplex.base.config import load_profile
    from duplex.bench.common import load_facts
    from duplex.bench.conversation import keywords_match

    torch.set_num_threads(1)
    profile = load_profile(args.profile)
    drafter = profile.components.get("drafter")
    if drafter is None:
        ap.error(f"profile {profile.name!r} has no drafter: no relay to check")
    stage = load_dialogue_stage(profile.component("llm"), drafter, progress=True)
    facts = load_facts()[: args.facts]
    voice = None
    if not args.no_voice:
        from duplex.base.config import ComponentConfig
        from tts.loading import load_tts

        voice = load_tts(ComponentConfig("tts", "hibari", {"package": "hibari"}, {}))
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for i, fact in enumerate(facts):
        for m in modes:
            r = answer(stage, fact.q, MODES[m], voice)
            rows[m].append({"q": fact.q, "ok": keywords_match(r["answer"], fact.any), **r})
        print(
            f"[{i + 1}/{len(facts)}] {fact.q} | "
            + " | ".join(
                f"{m} {rows[m][-1]['first_ms']:.0f} ms {rows[m][-1]['answer'][:40]!r}" for m in modes
            ),
            flush=True,
        )
    summary = summarise(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"profile": profile.name, "facts": len(facts), "summary": summary, "rows": rows}
    (out / "relay_check.json").write_text(json.dumps(doc, indent=1))
    text = table(summary)
    (out / "relay_check.txt").write_text(f"profile {profile.name}, {len(facts)} facts as text\n{text}\n")
    print(text)
    print(f"wrote {out / 'relay_check.json'} and {out / 'relay_check.txt'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
