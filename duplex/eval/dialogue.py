"""`duplex eval dialogue`: how well the dialogue engine takes turns and how much the relay buys.

Everything runs through the engine's own steps (the code the server runs), on held-out data that
training never saw (`data/dialogue/turn_eval.jsonl`, `data/dialogue/relay_eval.jsonl`):

1. **Turn-taking on held-out text**: each example's words are listened to as the engine does at a
   pause; takeover rate on mid-sentence cuts (LISTEN, lower is better) and on complete turns
   (SPEAK, higher is better), the 3-class confusion, and backchannel-vs-interruption accuracy.
2. **Turn-taking on synthesised speech**: the same for a sample spoken by hibari and transcribed
   by the packaged ASR, so ASR errors and punctuation are in the loop.
3. **Relay versus slow-only** on the same prompts, alternating which goes first: onset (end of
   turn -> first audio chunk from the TTS, after the user's words were prefilled slice by slice as
   in the live service), fraction of drafts committed, verifier AUROC against the slow model's own
   judgement of each draft, and answer quality by two judges run by the slow model, the same for
   both (`dialogue/training/judge.py`): its 1-9 rating, lenient at 0.5B, and a likelihood judge (how much more
   likely the answer is after the caller's words than after a neutral turn, times P(it ends there)).
   Each prompt is answered three times: slow-only, with its draft committed, with it discarded; the
   relay at any verifier threshold is, prompt by prompt, one of the last two, so one pass gives every
   operating point (reported: the engine's, the verifier's named ones, and the sweep in the plot).
   The judges' floor and validity are measured too: each prompt graded with the answer to another
   prompt (`--resummarise FILE --rejudge` grades a stored run's answers again). The answers do
   not depend on the verifier (greedy drafts and answers), so `--resummarise FILE --rescore` scores
   the stored drafts with the current verifier and replays its operating points on the stored runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import random
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from duplex.base.paths import DATA_ROOT

log = logging.getLogger("duplex.eval")

DATA = DATA_ROOT / "dialogue"
LABELS = ("listen", "backchannel", "speak")


def percentile(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if xs else float("nan")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise SystemExit(
            f"eval dialogue: {path} is missing (it ships with the repository; see dialogue/train_*.py)"
        )
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- 1/2: turn-taking ---------------------------------------------------------------------------


def decide(probs: Sequence[float], speak_thr: float, bc_thr: float, take_thr: float | None = None) -> int:
    """The turn head's rule (dialogue.turn_taking.TurnPolicy, as the session core applies it)."""
    from dialogue.turn_taking import TurnPolicy

    return TurnPolicy(speak_thr, bc_thr, 0.5, take_thr).decide_turn(probs)


def turn_metrics(pairs: list[tuple[int, int]]) -> dict[str, Any]:
    """pairs of (label, decision) -> takeover rates and the confusion matrix.

    A takeover is the service answering during a pause of ~1.3 s: decision `speak` (answers after
    500 ms) or `backchannel` (says mm-hmm, answers after 1 s if they do not go on); `listen` waits
    2 s. `fast_takeover` counts `speak` alone (the 500 ms hangover)."""
    conf = [[0, 0, 0] for _ in range(3)]
    for y, d in pairs:
        conf[y][d] += 1
    n_listen, n_speak = sum(conf[0]), sum(conf[2])
    return {
        "pause_takeover": (conf[0][1] + conf[0][2]) / n_listen if n_listen else float("nan"),
        "n_listen": n_listen,
        "complete_takeover": (conf[2][1] + conf[2][2]) / n_speak if n_speak else float("nan"),
        "fast_takeover": conf[2][2] / n_speak if n_speak else float("nan"),
        "n_speak": n_speak,
        "backchannel_recall": conf[1][1] / sum(conf[1]) if sum(conf[1]) else float("nan"),
        "n_backchannel": sum(conf[1]),
        "confusion": {LABELS[i]: dict(zip(LABELS, conf[i], strict=True)) for i in range(3)},
    }


def eval_turns_text(
    stage: Any,
    examples: list[dict[str, Any]],
    speak_thr: float,
    bc_thr: float,
    progress: bool,
    take_thr: float | None = None,
) -> dict[str, Any]:
    from tqdm.auto import tqdm

    from duplex.base.messages import ListenStep, OverlapStep

    pairs: list[tuple[int, int]] = []
    overlap_ok: list[bool] = []
    for ex in tqdm(examples, desc="turn heads (text)", disable=not progress):
        state = stage.init_state()
        if ex.get("head", "turn") == "overlap":
            out, _ = stage.step(state, OverlapStep(ex["text"]))
            overlap_ok.append(bool(out.interrupt) == (int(ex["label"]) == 1))
        else:
            out, _ = stage.step(
                state, ListenStep(list(ex.get("history") or []), ex["text"], prefill_slow=False)
            )
            pairs.append((int(ex["label"]), decide(out.probs, speak_thr, bc_thr, take_thr)))
    m = turn_metrics(pairs)
    m["overlap_accuracy"] = sum(overlap_ok) / len(overlap_ok) if overlap_ok else float("nan")
    m["n_overlap"] = len(overlap_ok)
    return m


def eval_turns_speech(
    stage: Any,
    asr: Any,
    examples: list[dict[str, Any]],
    n: int,
    speak_thr: float,
    bc_thr: float,
    seed: int,
    progress: bool,
    take_thr: float | None = None,
    cut_audio: str = "alone",
) -> dict[str, Any]:
    """Speak the words with hibari, transcribe them with the profile's ASR, then listen. `cut_audio="whole"`:
    a mid-sentence cut is hibari's whole sentence cut where the cut's words end (`whole_cut.cut_whole`, as
    `duplex eval eot --cut-audio whole`), then 0.2 s of silence, so it does not end like a finished
    sentence; "alone" speaks the cut's words as they are."""
    if cut_audio not in ("alone", "whole"):
        raise ValueError(f"cut_audio must be 'alone' or 'whole', not {cut_audio!r}")
    from tqdm.auto import tqdm

    from asr.training.whole_cut import cut_whole, whole_sentence_for
    from codec.resample import resample
    from duplex.base.messages import AsrChunk, ListenStep
    from tts.hibari_tts import SAMPLE_RATE, HibariSynth

    rng = random.Random(seed)
    by_label: dict[int, list[dict[str, Any]]] = {0: [], 2: []}
    for ex in examples:
        if ex.get("head", "turn") == "turn" and int(ex["label"]) in by_label:
            by_label[int(ex["label"])].append(ex)
    chosen = []
    for lab in (0, 2):
        rng.shuffle(by_label[lab])
        chosen += by_label[lab][: n // 2]
    synth = HibariSynth(threads=1, seed=seed)
    pairs: list[tuple[int, int]] = []
    wrong: list[dict[str, Any]] = []

    def speak(text: str) -> np.ndarray:
        return resample(synth.synthesize(text), SAMPLE_RATE, 16000).astype(np.float32)

    for ex in tqdm(chosen, desc="turn heads (speech)", disable=not progress):
        whole = whole_sentence_for(ex, examples) if cut_audio == "whole" and int(ex["label"]) == 0 else None
        if whole is None:
            audio = speak(ex["text"])
        else:
            audio = np.concatenate([cut_whole(speak(whole), speak(ex["text"])), np.zeros(3200, np.float32)])
        out, _ = asr.step(asr.init_state(), AsrChunk(samples=audio, transcribe=True, final=True))
        heard = str(getattr(out, "text", "") or "")
        res, _ = stage.step(
            stage.init_state(), ListenStep(list(ex.get("history") or []), heard, prefill_slow=False)
        )
        d = decide(res.probs, speak_thr, bc_thr, take_thr)
        pairs.append((int(ex["label"]), d))
        if (d > 0) != (int(ex["label"]) == 2):
            wrong.append(
                {"text": ex["text"], "heard": heard, "label": LABELS[int(ex["label"])], "decision": LABELS[d]}
            )
    m = turn_metrics(pairs)
    m["errors"] = wrong[:12]
    return m


# -- 3: relay versus slow-only -------------------------------------------------------------------


def run_answer(
    stage: Any, tts: Any, history: list[dict[str, str]], text: str, relay: bool, commit: bool | None = None
) -> dict[str, Any]:
    """One answer as the live service gives it: listen (prefill), then respond until the TTS has
    the first audio (onset), then to the end. `commit` forces the relay's decision (None: the
    verifier decides)."""
    from duplex.base.messages import ListenStep, RespondStep, TtsInput
    from duplex.base.phrases import first_phrase_ready

    words = int(getattr(getattr(tts, "segmenter", None), "first_phrase_words", 3))
    state = stage.init_state()
    # the time-sliced prefill while the user spoke (with the relay, the drafter pre-closes the turn)
    stage.step(state, ListenStep(history, text, preclose=relay))
    msgs = history + [{"role": "user", "content": text}]
    opts = stage.slow_options
    t0 = time.perf_counter()
    out, state = stage.step(
        state, RespondStep(msgs, opts.first_step_tokens, relay, commit, phrase_words=words)
    )
    info = out.relay
    answer, pending = out.text, out.text
    tts_state = tts.init_state()
    onset = None
    while True:
        if onset is None and first_phrase_ready(answer, out.done, words):
            chunks, tts_state = tts.step(tts_state, TtsInput(pending, out.done))
            pending = ""
            if any(len(c.audio) for c in chunks):
                onset = time.perf_counter() - t0
        if out.done:
            break
        out, state = stage.step(state, RespondStep(None, opts.step_tokens))
        answer += out.text
        pending += out.text
    if onset is None:
        onset = time.perf_counter() - t0
    return {
        "answer": answer.strip(),
        "onset_s": onset,
        "total_s": time.perf_counter() - t0,
        "committed": bool(info.committed) if info else False,
        "p": float(info.p_accept) if info else None,
        "draft": info.draft if info else "",
        "prefix": info.prefix if info else "",
        "veto": info.veto if info else None,
    }


def auroc(scores: Sequence[float], labels: Sequence[int]) -> float:
    pos = [s for s, y in zip(scores, labels, strict=True) if y]
    neg = [s for s, y in zip(scores, labels, strict=True) if not y]
    if not pos or not neg:
        return float("nan")
    wins = sum((p > q) + 0.5 * (p == q) for p in pos for q in neg)
    return wins / (len(pos) * len(neg))


#: the three runs per prompt: slow model alone, the draft committed whatever the verifier says, the
#: draft discarded whatever it says. The relay at any verifier threshold is, prompt by prompt, the
#: committed or the discarded run, so one pass measures every operating point.
VARIANTS = ("slow", "commit", "discard")
_FORCE = {"slow": None, "commit": True, "discard": False}


def eval_relay(stage: Any, tts: Any, prompts: list[dict[str, Any]], progress: bool) -> list[dict[str, Any]]:
    from tqdm.auto import tqdm

    rows = []
    for i, pr in enumerate(tqdm(prompts, desc="relay vs slow-only", disable=not progress)):
        history = [dict(m) for m in pr.get("history") or []]
        text = pr["text"]
        k = i % len(VARIANTS)  # rotate which goes first, so warm caches favour none
        res = {
            v: run_answer(stage, tts, history, text, v != "slow", _FORCE[v])
            for v in VARIANTS[k:] + VARIANTS[:k]
        }
        label = int(_slow_accepts(stage, history, text, res["commit"])) if res["commit"]["draft"] else None
        rows.append(
            {
                "text": text,
                "history": history,
                "source": pr.get("source", ""),
                "p": res["commit"]["p"],
                "label": label,
            }
            | {v: res[v] for v in VARIANTS}
        )
    judge_rows(stage, rows, rating=True, progress=progress)
    return rows


#: the judges of `dialogue.training.judge` and the key of their grade in each run: the slow model's 1-9
#: rating ("quality", the first judge this evaluation had) and the likelihood judge, per token and whole
JUDGES = {
    "rating": "quality",
    "likelihood": "quality_likelihood",
    "likelihood-total": "quality_likelihood_total",
}


def judge_rows(stage: Any, rows: list[dict[str, Any]], rating: bool, progress: bool = False) -> None:
    """Grade every run of every row in place with the likelihood judge (and the rating judge when
    `rating`), the same judges for all three runs. The judges' floor too: each prompt graded with the
    slow model's answer to the next prompt (fluent, on no topic of this call), so a quality ratio can
    be read against what a wrong answer scores (`mismatched_quality*`)."""
    from tqdm.auto import tqdm

    from dialogue.training.judge import LikelihoodJudge, RatingJudge

    model, tok = stage.slow.lm.model, stage.slow_tokenizer
    rate = RatingJudge(model, tok)
    lik = LikelihoodJudge(model, tok, stage.system_prompt)
    for i, row in enumerate(tqdm(rows, desc="judging", disable=not progress)):
        history, text = row["history"], row["text"]
        other = rows[(i + 1) % len(rows)]["slow"]["answer"] if len(rows) > 1 else None
        answers = list(
            dict.fromkeys([row[v]["answer"] for v in VARIANTS] + ([other] if other is not None else []))
        )
        prefix = row["commit"].get("prefix") or ""
        scored = lik.score(history, text, answers + ([prefix] if prefix.strip() else []))
        scores = dict(zip(answers, scored[: len(answers)], strict=True))
        # the slow model's own mean log-probability of the committed words: what the verifier
        # approximates from the drafter's side, for the bound in `slow_scored_relay`
        row["commit"]["prefix_logp"] = (
            scored[-1].logp / scored[-1].n_tokens if prefix.strip() and scored[-1].n_tokens else None
        )
        for v in VARIANTS:
            s = scores[row[v]["answer"]]
            row[v] |= {
                "likelihood": s.as_dict(),
                "quality_likelihood": s.quality,
                "quality_likelihood_total": s.quality_total,
            }
        row["mismatched_quality_likelihood"] = scores[other].quality if other is not None else None
        row["mismatched_quality_likelihood_total"] = (
            scores[other].quality_total if other is not None else None
        )
        if rating:
            grades = {
                a: rate(history, text, a) for a in answers
            }  # each distinct answer once, the mismatched one too
            for v in VARIANTS:
                row[v]["quality"] = grades[row[v]["answer"]]
            row["mismatched_quality"] = grades[other] if other is not None else None


def _slow_accepts(stage: Any, history: list[dict[str, str]], text: str, r: dict[str, Any]) -> bool:
    """The verifier's training label, recomputed for this draft (`train_verifier.judge_prefix`): its
    forced negatives, the slow model's own greedy opening, or typical acceptance of the draft's
    prefix under the slow model in context (parameters stored with the verifier)."""
    from dialogue.training.relay_features import score_prefix
    from dialogue.training.train_verifier import Acceptance, judge_prefix
    from dialogue.turn_taking import normalize_user_text
    from dialogue.verifier import chat_ids, draft, prefix_text

    meta = _verifier_meta()
    prefix = r["prefix"] or prefix_text(r["draft"], ended=True)
    user = normalize_user_text(text)
    ctx = chat_ids(stage.slow_tokenizer, stage.system_prompt, history, user)
    model = stage.slow.lm.model
    sc = score_prefix(model, stage.slow_tokenizer, ctx, prefix)
    own = draft(model, stage.slow_tokenizer, ctx, stop_ids=stage.slow_stop)
    ex = {
        "prefix": prefix,
        "text": user,
        "slow_text": own.text,
        "score_logprobs": sc.logprobs,
        "score_entropies": sc.entropies,
    }
    acc = Acceptance(float(meta["acceptance"]["epsilon"]), float(meta["acceptance"]["delta"]))
    return judge_prefix(ex, acc) in ("own", "ok")


@functools.cache
def _verifier_meta() -> dict[str, Any]:
    """The shipped verifier's metadata (its label thresholds), read once."""
    from dialogue.verifier import load_verifier

    return load_verifier()[2]


#: an operating point: a fixed threshold, or a rolling rule {commit, window, prior} (verifier.RollingThreshold)
Point = float | dict[str, Any]


def thresholds_for(rows: list[dict[str, Any]], point: Point) -> list[float]:
    """The threshold each prompt meets at `point`: a rolling rule is replayed over the prompts in
    the order they were answered, each draft's score joining the window after its decision."""
    if not isinstance(point, dict):
        return [float(point)] * len(rows)
    from dialogue.verifier import RollingThreshold

    rolling = RollingThreshold(point["prior"], float(point["commit"]), int(point["window"]))
    out = []
    for r in rows:
        out.append(rolling.threshold())
        if r["p"] is not None and r["commit"]["committed"]:  # a draft with a prefix to judge
            rolling.observe(float(r["p"]))
    return out


def relay_run(row: dict[str, Any], threshold: float) -> dict[str, Any]:
    """What the relay does for this prompt at `threshold`: the committed run or the discarded one."""
    c = row["commit"]
    ok = c["committed"] and not c.get("veto") and row["p"] is not None and row["p"] >= threshold
    return c if ok else row["discard"]


def at_threshold(
    rows: list[dict[str, Any]], point: Point, only: Sequence[int] | None = None
) -> dict[str, Any]:
    """Relay versus slow-only with the verifier at `point` (on the rows `only`, when given: a
    rolling point is still replayed over all rows, in the order they were answered)."""
    ts = thresholds_for(rows, point)
    if only is not None:
        rows, ts = [rows[i] for i in only], [ts[i] for i in only]
    threshold = float(np.mean(ts)) if ts else float("nan")
    runs = [relay_run(r, t) for r, t in zip(rows, ts, strict=True)]
    on_r = [x["onset_s"] * 1000 for x in runs]
    on_s = [r["slow"]["onset_s"] * 1000 for r in rows]
    rating = quality_of(rows, runs, "rating")
    committed = [x["committed"] for x in runs]
    return {
        "threshold": threshold,  # the mean, for a rolling point
        "rolling": isinstance(point, dict),
        "onset_ms": {
            "relay": {"p50": percentile(on_r, 50), "p90": percentile(on_r, 90)},
            "slow_only": {"p50": percentile(on_s, 50), "p90": percentile(on_s, 90)},
        },
        "p90_ratio": percentile(on_r, 90) / percentile(on_s, 90) if rows else float("nan"),
        # the rating judge's, kept at the top level as the first runs stored them
        "quality": {"relay": rating["relay"], "slow_only": rating["slow_only"]},
        "quality_ratio": rating["ratio"],
        # how much of the judge's range between a mismatched answer and slow-only the relay keeps
        "quality_kept": rating["kept"],
        "judges": {
            name: quality_of(rows, runs, name)
            for name in JUDGES
            if all(JUDGES[name] in r["slow"] for r in rows)
        },
        "answers_changed": sum(x["answer"] != r["slow"]["answer"] for x, r in zip(runs, rows, strict=True)),
        "committed_fraction": sum(committed) / len(committed) if committed else float("nan"),
        "copied_openings": copied_openings(rows, runs),
    }


def quality_of(rows: list[dict[str, Any]], runs: list[dict[str, Any]], judge: str) -> dict[str, Any]:
    """One judge's grades of the relay's `runs` against slow-only on `rows`: means, their ratio, the
    share of the range above a mismatched answer kept, and the share of prompts whose relay answer
    is graded at least as well as slow-only's."""
    key = JUDGES[judge]
    q_r = [x[key] for x in runs]
    q_s = [r["slow"][key] for r in rows]
    m_r = float(np.mean(q_r)) if q_r else float("nan")
    m_s = float(np.mean(q_s)) if q_s else float("nan")
    return {
        "relay": m_r,
        "slow_only": m_s,
        "ratio": m_r / m_s if q_s and m_s > 0 else float("nan"),
        "kept": _kept(m_r, m_s, [r.get(f"mismatched_{key}") for r in rows]),
        "not_worse": float(np.mean([a >= b for a, b in zip(q_r, q_s, strict=True)])) if q_s else float("nan"),
    }


def starts_like_earlier_answer(answer: str, history: Sequence[dict[str, str]], k: int = 3) -> bool:
    """`answer` starts with the same `k` words as an earlier assistant turn of the conversation (the
    drafter's failure in long sessions: "The spider that comes after Monday has 8 legs.")."""

    def head(text: str) -> list[str]:
        return re.sub(r"[^\w' ]", " ", text.lower()).split()[:k]

    mine = head(answer)
    return len(mine) == k and any(head(m["content"]) == mine for m in history if m["role"] == "assistant")


def copied_openings(rows: list[dict[str, Any]], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Of the prompts with earlier answers in their history: how often the relay's answer and the
    slow model's start like one of them (the slow model's own rate is the baseline)."""
    pairs = [
        (r, x)
        for r, x in zip(rows, runs, strict=True)
        if any(m["role"] == "assistant" for m in r.get("history") or [])
    ]
    if not pairs:
        return {"n": 0, "relay": float("nan"), "slow_only": float("nan")}
    relay = sum(starts_like_earlier_answer(x["answer"], r["history"]) for r, x in pairs)
    slow = sum(starts_like_earlier_answer(r["slow"]["answer"], r["history"]) for r, _ in pairs)
    return {"n": len(pairs), "relay": relay / len(pairs), "slow_only": slow / len(pairs)}


#: row kinds reported apart: single user turns, and conversations of dialogue/training/multi_turn.py
KINDS = {
    "single": lambda r: r.get("source") != "multi",
    "conversations": lambda r: r.get("source") == "multi",
}


def operating_points(meta: dict[str, Any], threshold: float, rolling: Any = None) -> dict[str, Point]:
    """The verifier's named operating points, each rolling one also with its starting threshold held
    fixed (what the rolling rule buys), and the engine's (`threshold`, or its `rolling` rule)."""
    from dialogue.verifier import named_operating_points

    points: dict[str, Point] = named_operating_points(meta) if "threshold" in meta else {}
    points |= {
        f"{k}-fixed": float(meta["thresholds"][k])
        for k, v in points.items()
        if isinstance(v, dict) and k in (meta.get("thresholds") or {})
    }
    return points | {"engine": rolling.rule if rolling is not None else float(threshold)}


def _kept(q_relay: float, q_slow: float, floor: Sequence[float | None]) -> float:
    f = [x for x in floor if x is not None]
    if not f or not q_slow - np.mean(f) > 0:
        return float("nan")
    return float((q_relay - np.mean(f)) / (q_slow - np.mean(f)))


def judge_validity(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per judge (where every row has its grades): slow-only's answer against the same prompt graded
    with another prompt's answer (`dialogue.training.judge.validity`)."""
    from dialogue.training.judge import validity

    out = {}
    for name, key in JUDGES.items():
        pairs = [
            (r["slow"][key], r[f"mismatched_{key}"])
            for r in rows
            if key in r["slow"] and r.get(f"mismatched_{key}") is not None
        ]
        if pairs and len(pairs) == len(rows):
            out[name] = validity([g for g, _ in pairs], [b for _, b in pairs])
    return out


def slow_scored_relay(rows: list[dict[str, Any]], n_committed: int) -> dict[str, Any] | None:
    """The relay if the verifier were the slow model itself: the same number of drafts committed,
    the ones whose words the slow model finds likeliest (mean log-probability in context; the veto
    still applies). A bound on what any verifier of the drafts can buy at that commit rate (it needs
    the slow model's forward over the draft, the latency the verifier exists to avoid); None when the
    rows have no such scores (runs stored before it was measured)."""
    cand = [
        i
        for i, r in enumerate(rows)
        if r["commit"]["committed"] and not r["commit"].get("veto") and r["p"] is not None
    ]
    if not cand or any(rows[i]["commit"].get("prefix_logp") is None for i in cand):
        return None
    keep = set(sorted(cand, key=lambda i: -rows[i]["commit"]["prefix_logp"])[:n_committed])
    runs = [r["commit"] if i in keep else r["discard"] for i, r in enumerate(rows)]
    return {
        "committed_fraction": len(keep) / len(rows),
        "judges": {
            name: quality_of(rows, runs, name)
            for name in JUDGES
            if all(JUDGES[name] in r["slow"] for r in rows)
        },
    }


def keep_margin() -> float:
    """A committed draft "keeps" the answer when it loses at most this much of the per-token likelihood
    judge's grade: the margin of the verifier's judge labels (imported when needed: its module brings
    torch, which `duplex serve` does not otherwise load with the engine in its own process)."""
    from dialogue.training.relay_labels import MARGIN

    return float(MARGIN)


def judge_labelled(rows: list[dict[str, Any]], margin: float | None = None) -> list[tuple[float, int]]:
    """(verifier score, 1 iff committing the draft lost at most `margin` (default `keep_margin()`) of the
    per-token likelihood judge's grade) for every row with a draft to commit and both grades."""
    margin = keep_margin() if margin is None else margin
    key = JUDGES["likelihood"]
    return [
        (float(r["p"]), int(r["slow"][key] - r["commit"][key] <= margin))
        for r in rows
        if r["p"] is not None and r["commit"]["committed"] and key in r["slow"] and key in r["commit"]
    ]


def summarise_relay(
    rows: list[dict[str, Any]], threshold: Point, points: dict[str, Point] | None = None
) -> dict[str, Any]:
    """The relay at the engine's threshold, at the verifier's named operating points, and the sweep
    over every threshold that changes a decision (for the plot)."""
    labelled = [(r["p"], r["label"]) for r in rows if r["label"] is not None and r["p"] is not None]
    judged = judge_labelled(rows)
    cuts = sorted({0.0, 1.01} | {float(r["p"]) for r in rows if r["p"] is not None})
    floor = [r["mismatched_quality"] for r in rows if r.get("mismatched_quality") is not None]

    def with_decisions(point: Point) -> dict[str, Any]:
        ts = thresholds_for(rows, point)
        return at_threshold(rows, point) | {
            "decisions": [relay_run(r, t) is r["commit"] for r, t in zip(rows, ts, strict=True)]
        }

    by_kind = {name: [i for i, r in enumerate(rows) if keep(r)] for name, keep in KINDS.items()}
    engine = with_decisions(threshold)
    return engine | {
        "n": len(rows),
        "slow_scored": slow_scored_relay(rows, sum(engine["decisions"])),
        # the engine's point on single turns and on conversations apart (the long-session failure)
        "by_kind": {
            name: at_threshold(rows, threshold, idx) | {"n": len(idx)}
            for name, idx in by_kind.items()
            if idx and len(idx) < len(rows)
        },
        "quality_mismatched": float(np.mean(floor)) if floor else float("nan"),
        # how well each judge tells slow-only's answer from the answer to another prompt, on these rows
        "judge_validity": judge_validity(rows),
        "verifier_auroc": auroc([p for p, _ in labelled], [y for _, y in labelled]),
        # ... and against what committing each draft did to the answer, by the per-token judge
        "verifier_auroc_judge": auroc([p for p, _ in judged], [y for _, y in judged]),
        "n_judge_labelled": len(judged),
        "n_labelled": len(labelled),
        "operating_points": {name: with_decisions(t) for name, t in (points or {}).items()},
        "sweep": [at_threshold(rows, t) for t in cuts],
        "rows": rows,
    }


# -- report -------------------------------------------------------------------------------------


def fmt_pct(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f} %"


def report(results: dict[str, Any]) -> str:
    lines = []
    for key, title in (
        ("turn_text", "turn-taking, held-out text"),
        ("turn_speech", "turn-taking, synthesised speech -> ASR"),
    ):
        m = results.get(key)
        if not m:
            continue
        lines.append(f"{title}:")
        lines.append(
            f"  pause takeover    {fmt_pct(m['pause_takeover'])}  (n={m['n_listen']}, target <= 10 %)"
        )
        lines.append(
            f"  complete takeover {fmt_pct(m['complete_takeover'])}  (n={m['n_speak']}, target >= 90 %);"
            f" of which after the short hangover {fmt_pct(m['fast_takeover'])}"
        )
        if m.get("n_backchannel"):
            lines.append(f"  backchannel recall {fmt_pct(m['backchannel_recall'])}  (n={m['n_backchannel']})")
        if m.get("n_overlap"):
            lines.append(
                f"  backchannel vs interruption accuracy {fmt_pct(m['overlap_accuracy'])}  (n={m['n_overlap']})"
            )
    r = results.get("relay")
    if r:
        lines.append(
            f"relay vs slow-only (n={r['n']} prompts, same run; each prompt answered slow-only, with its "
            f"draft committed and with it discarded):"
        )
        lines.append(
            f"  verifier AUROC {r['verifier_auroc']:.3f} (n={r['n_labelled']} drafts labelled by the slow model)"
        )
        if r.get("n_judge_labelled"):
            lines.append(
                f"  verifier AUROC {r['verifier_auroc_judge']:.3f} against what committing did to the answer "
                f"(n={r['n_judge_labelled']}; kept = loses at most {keep_margin()} of the per-token judge)"
            )
        pts = [("engine", r)] + list(r.get("operating_points", {}).items())
        for name, m in pts:
            o = m["onset_ms"]
            thr = (
                f"rolling threshold (mean {m['threshold']:.3f})"
                if m.get("rolling")
                else f"threshold {m['threshold']:.3f}"
            )
            lines.append(
                f"  {name:9s} {thr}: committed {fmt_pct(m['committed_fraction'])}; onset "
                f"P50/P90 relay {o['relay']['p50']:.0f}/{o['relay']['p90']:.0f} ms vs slow-only "
                f"{o['slow_only']['p50']:.0f}/{o['slow_only']['p90']:.0f} ms, P90 ratio {m['p90_ratio']:.2f} "
                f"(target <= 0.50); quality {m['quality']['relay']:.2f} vs {m['quality']['slow_only']:.2f} "
                f"= {fmt_pct(m['quality_ratio'])} (target >= 95 %), {fmt_pct(m['quality_kept'])} of the range above "
                f"a mismatched answer kept; {m['answers_changed']} answers differ from slow-only"
            )
            for judge, q in (m.get("judges") or {}).items():
                if judge != "rating":
                    lines.append(
                        f"  {'':9s} {judge} judge: {q['relay']:.3f} vs {q['slow_only']:.3f} = "
                        f"{fmt_pct(q['ratio'])} (target >= 95 %), {fmt_pct(q['kept'])} of the range kept; "
                        f"relay graded at least as well on {fmt_pct(q['not_worse'])} of prompts"
                    )
        for name, m in (r.get("by_kind") or {}).items():
            o = m["onset_ms"]
            lines.append(
                f"  engine on {name} (n={m['n']}): committed {fmt_pct(m['committed_fraction'])}; onset P90 "
                f"{o['relay']['p90']:.0f} vs {o['slow_only']['p90']:.0f} ms ({m['p90_ratio']:.2f}); quality "
                f"{fmt_pct(m['quality_ratio'])}, {fmt_pct(m['quality_kept'])} of the range kept"
                + "".join(
                    f"; {j} judge {fmt_pct(q['ratio'])}"
                    for j, q in (m.get("judges") or {}).items()
                    if j != "rating"
                )
            )
        c = r.get("copied_openings") or {}
        if c.get("n"):
            lines.append(
                f"  answers starting with the first 3 words of an earlier answer (n={c['n']} prompts with "
                f"history): relay {fmt_pct(c['relay'])} vs slow-only {fmt_pct(c['slow_only'])}"
            )
        b = r.get("slow_scored")
        if b:
            lines.append(
                f"  bound: the slow model's own score of each draft as the verifier, "
                f"{fmt_pct(b['committed_fraction'])} committed: "
                + ", ".join(f"{j} judge {fmt_pct(q['ratio'])}" for j, q in b["judges"].items())
            )
        for judge, v in (r.get("judge_validity") or {}).items():
            lines.append(
                f"  ({judge} judge: slow-only's answer vs the answer to another prompt AUROC {v['auroc']:.3f}; "
                f"the other prompt's answer scores {fmt_pct(v['bad_ratio'])} of slow-only's: a wrong answer's "
                f"'quality ratio')"
            )
        if not r.get("judge_validity"):
            lines.append(
                f"  (the judge grades the slow model's answer to another prompt {r['quality_mismatched']:.2f}: "
                f"the floor of its range)"
            )
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    r = results.get("relay")
    if r and r["rows"]:
        ax = axes[0]
        rows = r["rows"]
        curves = [("slow-only", [row["slow"] for row in rows])]
        for name, m in sorted((r.get("operating_points") or {}).items()):
            runs = [
                row["commit"] if d else row["discard"] for row, d in zip(rows, m["decisions"], strict=True)
            ]
            curves.append((f"relay, {name} ({fmt_pct(m['committed_fraction'])} committed)", runs))
        for label, runs in curves:
            xs = sorted(x["onset_s"] * 1000 for x in runs)
            ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=f"{label}, n={len(xs)}")
        ax.axhline(0.9, color="grey", ls=":", lw=1)
        ax.set_xlabel("onset: end of turn -> first TTS audio (ms)")
        ax.set_ylabel("fraction of answers")
        ax.set_title("relay vs slow-only onset")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        ax = axes[1]
        sw = sorted(r["sweep"], key=lambda m: m["committed_fraction"])
        cf = [100 * m["committed_fraction"] for m in sw]
        ax.plot(cf, [m["p90_ratio"] for m in sw], color="#1f77b4", label="onset P90 ratio (relay / slow)")
        ax.plot(cf, [m["quality_ratio"] for m in sw], color="#2ca02c", label="quality ratio (rating judge)")
        for judge, color in (("likelihood", "#ff7f0e"), ("likelihood-total", "#8c564b")):
            if all(judge in (m.get("judges") or {}) for m in sw):
                ax.plot(
                    cf,
                    [m["judges"][judge]["ratio"] for m in sw],
                    color=color,
                    label=f"quality ratio ({judge} judge)",
                )
        ax.plot(
            cf,
            [m["quality_kept"] for m in sw],
            color="#9467bd",
            ls="--",
            label="rating judge: share kept above a mismatched answer",
        )
        ax.axhline(0.5, color="#1f77b4", ls=":", lw=1)
        ax.axhline(0.95, color="#2ca02c", ls=":", lw=1)
        for name, m in (r.get("operating_points") or {}).items():
            ax.axvline(100 * m["committed_fraction"], color="grey", lw=0.8)
            ax.text(100 * m["committed_fraction"], 1.3, name, rotation=90, fontsize=7, va="top")
        ax.set_ylim(0, 1.4)
        ax.set_xlabel("drafts committed (%), every verifier threshold")
        ax.set_title("the verifier's trade-off (targets dotted)")
        ax.legend(fontsize=7, loc="lower left")
        ax.grid(alpha=0.3)
    ax = axes[2]
    names, vals = [], []
    for key, tag in (("turn_text", "text"), ("turn_speech", "speech")):
        m = results.get(key)
        if m:
            names += [f"pause\n({tag})", f"complete\n({tag})"]
            vals += [m["pause_takeover"], m["complete_takeover"]]
    if names:
        ax.bar(names, [100 * v for v in vals], color=["#d62728", "#2ca02c"] * (len(names) // 2))
        ax.axhline(10, color="#d62728", ls="--", lw=1)
        ax.axhline(90, color="#2ca02c", ls="--", lw=1)
        ax.set_ylabel("takeover rate (%)")
        ax.set_title("turn-taking on held-out turns")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="duplex eval dialogue", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--profile", default=None, help="models.yaml profile (default: the file's default)")
    ap.add_argument("--relay-prompts", type=int, default=40, help="prompts for relay vs slow-only (0 skips)")
    ap.add_argument("--speech", type=int, default=40, help="held-out turns spoken and transcribed (0 skips)")
    ap.add_argument(
        "--cut-audio",
        choices=("alone", "whole"),
        default="alone",
        help="speak a cut turn alone (ends like a finished sentence) or cut it from its whole sentence's audio",
    )
    ap.add_argument("--text", type=int, default=0, help="limit the held-out text examples (0 = all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="eval-out", help="folder for dialogue.json and dialogue.png")
    ap.add_argument(
        "--resummarise",
        metavar="JSON",
        default=None,
        help="run no model: recompute a previous run's relay summaries (its stored runs) with the "
        "current operating points and veto rules, and rewrite the report and plot in --out",
    )
    ap.add_argument(
        "--rejudge",
        action="store_true",
        help="with --resummarise: grade the stored answers again with every judge of "
        "dialogue/training/judge.py (loads the slow model only; ~8 min for 480 prompts)",
    )
    ap.add_argument(
        "--rescore",
        action="store_true",
        help="with --resummarise: draft each stored prompt again and score it with the current "
        "verifier (the stored runs stay: greedy answers do not depend on it; ~3 min)",
    )
    ap.add_argument("--no-progress", action="store_true")


def prompt_key(row: dict[str, Any]) -> str:
    """A relay prompt's identity: its history and text."""
    return json.dumps([[[m["role"], m["content"]] for m in row.get("history") or []], row["text"]])


def rescore_rows(stage: Any, rows: list[dict[str, Any]], progress: bool = True) -> int:
    """Each stored row's verifier score, from the engine's draft of its prompt scored by the engine's
    verifier now (`p` in place). Returns how many drafts differ from the stored ones: those rows keep
    their stored runs, which then answer a different draft (a changed drafter needs a new run)."""
    from tqdm.auto import tqdm

    changed = 0
    for r in tqdm(rows, desc="rescoring drafts", disable=not progress):
        info = stage.relay_draft([dict(m) for m in r["history"]], r["text"])
        changed += info.draft != r["commit"]["draft"]
        p = float(info.p_accept) if info.prefix.strip() else r["p"]
        r["p"] = p
        for v in ("commit", "discard"):
            r[v]["p"] = p
    return changed


def resummarise(
    path: Path, profile_name: str | None, rejudge: bool = False, progress: bool = True, rescore: bool = False
) -> dict[str, Any]:
    """A previous run's results with its relay rows re-judged: the veto recomputed for each stored
    draft (`verifier.draft_veto`) and the operating points of the profile's verifier; with `rejudge`,
    every stored answer graded again by the judges (the slow model's rating where a row lacks it); with
    `rescore`, every stored draft scored by the profile's verifier (`rescore_rows`)."""
    from dialogue.engine import DrafterOptions, previous_answer, previous_request, verifier_operating_point
    from dialogue.verifier import draft_veto, load_verifier
    from duplex.base.config import load_profile

    results = json.loads(path.read_text())
    if not (results.get("relay") or {}).get("rows"):
        raise SystemExit(f"eval dialogue: {path} holds no relay rows to re-summarise")
    rows = results["relay"]["rows"]
    # only the prompts still held out: a prompt removed from relay_eval.jsonl since (the corpus entry
    # that was read one character at a time) leaves the summaries
    held = {prompt_key(p) for p in read_jsonl(DATA / "relay_eval.jsonl")}
    dropped = [r["text"] for r in rows if prompt_key(r) not in held]
    if dropped:
        log.warning(
            "eval dialogue: %d stored prompts are no longer held out and are left out: %s",
            len(dropped),
            ", ".join(repr(t) for t in dropped[:8]) + (" ..." if len(dropped) > 8 else ""),
        )
        rows = [r for r in rows if prompt_key(r) in held]
        results["dropped_prompts"] = len(dropped) + int(results.get("dropped_prompts") or 0)
    for r in rows:
        c = r["commit"]
        msgs = r["history"] + [{"role": "user", "content": r["text"]}]
        c["veto"] = (
            draft_veto(c["prefix"], previous_answer(msgs), r["text"], previous_request=previous_request(msgs))
            if c["prefix"].strip()
            else None
        )
    if rejudge:
        from dialogue.engine import load_dialogue_stage

        stage = load_dialogue_stage(load_profile(profile_name).component("llm"), None, progress=progress)
        if stage.slow is None:
            raise SystemExit(
                "eval dialogue: the judge is the in-process slow model; this profile's llm is remote"
            )
        need_rating = any("quality" not in r[v] for r in rows for v in VARIANTS)
        judge_rows(stage, rows, rating=need_rating, progress=progress)
        results["rejudged"] = time.strftime("%Y-%m-%d %H:%M")
    if rescore:
        from dialogue.engine import load_dialogue_stage

        profile = load_profile(profile_name)
        drafter = profile.components.get("drafter")
        if drafter is None:
            raise SystemExit(f"eval dialogue: profile {profile.name!r} has no drafter to rescore with")
        stage = load_dialogue_stage(profile.component("llm"), drafter, progress=progress)
        changed = rescore_rows(stage, rows, progress)
        if changed:
            log.warning(
                "eval dialogue: %d of %d drafts differ from the stored ones (their stored runs are kept)",
                changed,
                len(rows),
            )
        results["rescored"] = {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "drafts_changed": changed,
            "verifier_labels": stage.verifier_meta.get("labels", "typical"),
        }
    drafter = load_profile(profile_name).components.get("drafter")
    opts = DrafterOptions.from_mapping(drafter.options if drafter is not None else {})
    _, _, meta = load_verifier(None if opts.verifier == "shipped" else Path(opts.verifier).expanduser())
    points = operating_points(meta, *verifier_operating_point(meta, opts.verifier_threshold))
    results["relay"] = summarise_relay(rows, points.pop("engine"), points)
    results["resummarised"] = time.strftime("%Y-%m-%d %H:%M")
    return results


def run(args: argparse.Namespace) -> int:
    import torch

    progress = not args.no_progress
    if args.resummarise:
        return write_results(
            resummarise(Path(args.resummarise), args.profile, args.rejudge, progress, args.rescore),
            Path(args.out),
        )
    if args.rejudge or args.rescore:
        raise SystemExit(
            "eval dialogue: --rejudge and --rescore work on the runs stored in a --resummarise file"
        )

    from dialogue.engine import load_dialogue_stage
    from duplex.base.config import load_profile
    from duplex.runtime.service import load_asr
    from tts.hibari_tts import load_tts_stage

    torch.manual_seed(args.seed)
    profile = load_profile(args.profile)
    drafter = profile.components.get("drafter")
    if drafter is None:
        raise SystemExit(
            f"eval dialogue: profile {profile.name!r} has no drafter component (no turn heads to test)"
        )
    stage = load_dialogue_stage(profile.component("llm"), drafter, progress=progress)
    if stage.slow is None:
        raise SystemExit(
            "eval dialogue: the judge is the in-process slow model; this profile's llm is remote"
        )
    speak_thr = float(stage.policy.speak_threshold)
    bc_thr = float(stage.policy.backchannel_threshold)
    take_thr = getattr(stage.policy, "take_threshold", None)
    results: dict[str, Any] = {
        "profile": profile.name,
        "speak_threshold": speak_thr,
        "backchannel_threshold": bc_thr,
        "take_threshold": take_thr,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    turn_examples = read_jsonl(DATA / "turn_eval.jsonl")
    if args.text:
        random.Random(args.seed).shuffle(turn_examples)
        turn_examples = turn_examples[: args.text]
    t = time.perf_counter()
    results["turn_text"] = eval_turns_text(stage, turn_examples, speak_thr, bc_thr, progress, take_thr)
    results["turn_text"]["seconds"] = round(time.perf_counter() - t, 1)
    if args.speech:
        asr = load_asr(profile.component("asr"))
        t = time.perf_counter()
        results["turn_speech"] = eval_turns_speech(
            stage,
            asr,
            read_jsonl(DATA / "turn_eval.jsonl"),
            args.speech,
            speak_thr,
            bc_thr,
            args.seed,
            progress,
            take_thr,
            getattr(args, "cut_audio", "alone"),
        )
        results["turn_speech"]["cut_audio"] = getattr(args, "cut_audio", "alone")
        results["turn_speech"]["seconds"] = round(time.perf_counter() - t, 1)
    if args.relay_prompts:
        tts = load_tts_stage(profile.component("tts"))
        prompts = read_jsonl(DATA / "relay_eval.jsonl")
        random.Random(args.seed).shuffle(prompts)
        t = time.perf_counter()
        rows = eval_relay(stage, tts, prompts[: args.relay_prompts], progress)
        points = operating_points(stage.verifier_meta, stage.verifier_threshold, stage.rolling_threshold)
        results["relay"] = summarise_relay(rows, points.pop("engine"), points)
        results["relay"]["seconds"] = round(time.perf_counter() - t, 1)
    return write_results(results, Path(args.out))


def write_results(results: dict[str, Any], out: Path) -> int:
    """dialogue.json and dialogue.png in `out`, and the report on stdout."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "dialogue.json").write_text(json.dumps(results, indent=1, default=float))
    plot(results, out / "dialogue.png")
    print(report(results))
    print(f"wrote {out / 'dialogue.json'} and {out / 'dialogue.png'}")
    return 0
