"""The slow model alone, profile against profile: facts, memory, speed, memory footprint.

    OMP_NUM_THREADS=1 .venv/bin/python -m duplex.bench.llm_quality --profiles cpu,cpu-large --out bench-out/llm

Each profile runs in its own process (so its RSS is its own and two models are never in memory at
once), through the dialogue engine the server runs (`load_dialogue_stage`, listen then respond
steps as `duplex.eval.dialogue.run_answer`, relay off, greedy), on the same prompts:

1. **Facts**: `data/dialogue/facts_eval.jsonl` (80 questions), an answer is right when every keyword
   group has an alternative in it (`duplex.bench.conversation.keywords_match`).
2. **Memory**: `duplex.bench.common.MEMORY_CASES` (10 two-turn cases: "My name is Anna." answered by
   the model, then "What is my name?"), graded by `duplex.bench.conversation.memory_verdict`
   (the fact, addressed to the caller, not claimed as the model's own).
3. **Speed**, per torch thread count: the first token of a question after the system prompt, both
   cold (question and answer header prefilled at once) and as live (after the user's words were
   prefilled by a listen step, only the closing header is left); the first phrase (3 words, what the
   TTS starts on); decode tokens/s over long answers.
4. **Footprint**: load time (conversion once, then the int8 quantisation at every start), RSS after
   loading and its peak (VmHWM: the conversion's, if it ran in this process).

Writes `llm_quality.json` (every answer, every timing) and prints a table. The load average is
recorded before and after each part: the numbers are only comparable on an equally loaded machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: prompts whose answers run long: decode speed is measured over them
LONG_PROMPTS = (
    "Tell me a short story about a dragon who is afraid of the dark.",
    "Explain how a car engine works.",
    "Tell me about the history of the Roman empire.",
)
#: questions whose first token is timed (typical turns, not in the facts set)
SPEED_PROMPTS = (
    "What is the capital of Australia?",
    "Can you recommend a good book for a long flight?",
    "How do I boil an egg?",
    "What time does the sun set in winter?",
    "Why is the sky blue?",
    "What should I cook for dinner tonight?",
)
#: words of the first phrase the TTS starts on (the cpu profile's tts first_phrase_words)
FIRST_PHRASE_WORDS = 3


def _proc_status() -> dict[str, float]:
    """VmRSS and VmHWM of this process in GiB (Linux; empty elsewhere)."""
    out: dict[str, float] = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, val = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(val.split()[0]) / (1 << 20)
    except OSError:
        pass
    return out


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def answer(stage: Any, history: list[dict[str, str]], text: str) -> dict[str, Any]:
    """One slow-only answer as the live service gives it: the user's words prefilled by a listen
    step, then respond steps (the first until a first phrase, then `step_tokens` each) to the end."""
    return answer_with_relay(stage, history, text, relay=False)[0]


def answer_with_relay(
    stage: Any, history: list[dict[str, str]], text: str, *, preclose: bool = False, **respond: Any
) -> tuple[dict[str, Any], Any]:
    """`answer` with the first `RespondStep`'s options (`relay`, `relay_check`) and the listen step's
    `preclose` chosen; also the first step's `RelayInfo` (None without a draft)."""
    from duplex.base.messages import ListenStep, RespondStep
    from duplex.base.phrases import PhraseSegmenter

    state = stage.init_state()
    stage.step(state, ListenStep(history, text, preclose=preclose))
    opts = stage.slow_options
    msgs = history + [{"role": "user", "content": text}]
    t0 = time.perf_counter()
    out, state = stage.step(
        state, RespondStep(msgs, opts.first_step_tokens, phrase_words=FIRST_PHRASE_WORDS, **respond)
    )
    first = time.perf_counter() - t0
    relay = out.relay
    text_out, tokens = out.text, out.n_tokens
    # when the TTS could start the answer's first and second phrases (a committed draft shorter than a
    # phrase waits for the slow model's words); after a committed draft the slow model's words must be
    # there before the draft's phrase has been spoken, or the seam is a pause
    segmenter = PhraseSegmenter(FIRST_PHRASE_WORDS)
    phrases, seg = segmenter.step(segmenter.init_state(), out.text, out.done)
    ready = [first] * len(phrases)
    while not out.done:
        out, state = stage.step(state, RespondStep(None, opts.step_tokens))
        text_out += out.text
        tokens += out.n_tokens
        more, seg = segmenter.step(seg, out.text, out.done)
        phrases += more
        ready += [time.perf_counter() - t0] * len(more)
    return {
        "answer": text_out.strip(),
        "first_phrase_s": round(first, 4),
        "phrase_ready_s": [round(t, 4) for t in ready[:2]],
        "first_phrase": phrases[0] if phrases else "",
        "total_s": round(time.perf_counter() - t0, 4),
        "tokens": tokens,
    }, relay


def eval_facts(stage: Any, limit: int, progress: bool) -> dict[str, Any]:
    from tqdm.auto import tqdm

    from duplex.bench.common import load_facts
    from duplex.bench.conversation import keywords_match

    facts = load_facts()
    facts = facts[:limit] if limit else facts
    rows = []
    for f in tqdm(facts, desc="facts", disable=not progress):
        r = answer(stage, [], f.q)
        rows.append({"q": f.q, "ok": keywords_match(r["answer"], f.any), **r})
    n_ok = sum(r["ok"] for r in rows)
    return {"n": len(rows), "correct": n_ok, "accuracy": n_ok / max(1, len(rows)), "rows": rows}


def eval_memory(stage: Any, progress: bool, cases: Sequence[Any] | None = None) -> dict[str, Any]:
    """Two-turn "remember what I said" cases (default `MEMORY_CASES`; `MEMORY_HELDOUT` checks a prompt
    chosen on them), graded by `memory_verdict`."""
    from tqdm.auto import tqdm

    from duplex.bench.common import MEMORY_CASES
    from duplex.bench.conversation import memory_verdict

    rows = []
    for case in tqdm(MEMORY_CASES if cases is None else cases, desc="memory", disable=not progress):
        told = answer(stage, [], case.statement)
        history = [
            {"role": "user", "content": case.statement},
            {"role": "assistant", "content": told["answer"]},
        ]
        asked = answer(stage, history, case.question)
        ok, why = memory_verdict(asked["answer"], case)
        rows.append(
            {
                "statement": case.statement,
                "reply": told["answer"],
                "question": case.question,
                "answer": asked["answer"],
                "ok": ok,
                "why": why,
            }
        )
    n_ok = sum(r["ok"] for r in rows)
    return {"n": len(rows), "correct": n_ok, "rows": rows}


def _median(xs: Sequence[float]) -> float:
    return round(statistics.median(xs), 4) if xs else float("nan")


def eval_speed(stage: Any, threads: int, repeats: int) -> dict[str, Any]:
    """First token (cold / after a listen step), first phrase, and decode tokens/s at `threads`."""
    import torch

    from duplex.base.messages import ListenStep, RespondStep

    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # one untimed answer: the first call of each shape pays allocator and kernel warm-up
        answer(stage, [], SPEED_PROMPTS[0])
        cold, live, phrase, prompt_tokens = [], [], [], []
        for _ in range(repeats):
            for q in SPEED_PROMPTS:
                msgs = [{"role": "user", "content": q}]
                state = stage.init_state()
                t0 = time.perf_counter()
                out, state = stage.step(state, RespondStep(msgs, 1, False))
                cold.append(time.perf_counter() - t0)
                prompt_tokens.append(out.prefill_tokens)
                state = stage.init_state()
                stage.step(state, ListenStep([], q, preclose=False))
                t0 = time.perf_counter()
                stage.step(state, RespondStep(msgs, 1, False))
                live.append(time.perf_counter() - t0)
                phrase.append(answer(stage, [], q)["first_phrase_s"])
        decode_tokens, decode_s = 0, 0.0
        for q in LONG_PROMPTS:
            state = stage.init_state()
            out, state = stage.step(state, RespondStep([{"role": "user", "content": q}], 1, False))
            while not out.done:
                t0 = time.perf_counter()
                out, state = stage.step(state, RespondStep(None, stage.slow_options.step_tokens))
                decode_s += time.perf_counter() - t0
                decode_tokens += out.n_tokens
    finally:
        torch.set_num_threads(prev)
    return {
        "threads": threads,
        "n_first_token": len(cold),
        "first_token_cold_s": {"median": _median(cold), "max": round(max(cold), 4)},
        "prompt_tokens_median": statistics.median(prompt_tokens),
        "first_token_after_listen_s": {"median": _median(live), "max": round(max(live), 4)},
        "first_phrase_after_listen_s": {"median": _median(phrase), "max": round(max(phrase), 4)},
        "decode_tokens": decode_tokens,
        "decode_tok_per_s": round(decode_tokens / decode_s, 2) if decode_s else float("nan"),
        "step_ms_per_token": round(1000 * decode_s / max(1, decode_tokens), 1),
    }


def run_profile(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Everything for one profile, in this process."""
    import torch

    from dialogue import llm_weights
    from dialogue.engine import load_dialogue_stage
    from duplex.base.config import load_profile

    torch.set_num_threads(1)
    progress = not args.no_progress
    profile = load_profile(name)
    llm = profile.component("llm")
    res: dict[str, Any] = {"profile": name, "llm": dict(llm.weights).get("name"), "load_before": _load()}
    cache = llm_weights.cache_dir_for(llm_weights.LlmWeights.from_config(llm))
    converted_now = not llm_weights.status(llm).cached
    t0 = time.perf_counter()
    llm_weights.prepare(llm, progress=progress)
    res["prepare_s"] = round(time.perf_counter() - t0, 1)
    res["converted_now"] = converted_now
    res["rss_after_prepare_gib"] = _proc_status()
    marker = llm_weights._read_marker(cache) or {}
    res["conversion_s"] = marker.get("seconds")
    res["cache_gib"] = round(sum(p.stat().st_size for p in cache.iterdir()) / (1 << 30), 2)
    t0 = time.perf_counter()
    drafter = None if args.no_drafter else profile.components.get("drafter")
    stage = load_dialogue_stage(llm, drafter, progress=progress)
    res["load_s"] = round(time.perf_counter() - t0, 1)
    res["drafter_loaded"] = drafter is not None
    res["rss_after_load_gib"] = _proc_status()
    if args.facts >= 0:
        res["facts"] = eval_facts(stage, args.facts, progress)
    if args.memory:
        from duplex.eval.answers import MEMORY_FRESH, MEMORY_HELDOUT

        res["memory"] = eval_memory(stage, progress)
        res["memory_heldout"] = eval_memory(stage, progress, MEMORY_HELDOUT)
        res["memory_fresh"] = eval_memory(stage, progress, MEMORY_FRESH)
        if args.notes_ab and getattr(stage, "slow_options", None) is not None:
            import dataclasses

            # the same loaded model with the caller notes flipped (dialogue/caller_notes.py), same run
            kept = stage.slow_options
            stage.slow_options = dataclasses.replace(kept, caller_notes=not kept.caller_notes)
            flipped = "on" if stage.slow_options.caller_notes else "off"
            try:
                res[f"memory_notes_{flipped}"] = eval_memory(stage, progress)
                res[f"memory_heldout_notes_{flipped}"] = eval_memory(stage, progress, MEMORY_HELDOUT)
                res[f"memory_fresh_notes_{flipped}"] = eval_memory(stage, progress, MEMORY_FRESH)
            finally:
                stage.slow_options = kept
    res["speed"] = [eval_speed(stage, t, args.repeats) for t in args.threads]
    res["rss_end_gib"] = _proc_status()
    res["load_after"] = _load()
    return res


def summary_table(results: Sequence[dict[str, Any]]) -> str:
    """A markdown table, one column per profile."""
    cols = [r["profile"] + (f" ({r['llm']})" if r.get("llm") else "") for r in results]
    lines = ["| | " + " | ".join(cols) + " |", "|---|" + "---|" * len(results)]

    def row(label: str, fn: Any) -> None:
        vals = []
        for r in results:
            try:
                vals.append(str(fn(r)))
            except (KeyError, IndexError, TypeError):
                vals.append("–")
        lines.append(f"| {label} | " + " | ".join(vals) + " |")

    row(
        "facts correct",
        lambda r: f"{r['facts']['correct']}/{r['facts']['n']} ({100 * r['facts']['accuracy']:.1f} %)",
    )
    row("memory cases correct", lambda r: f"{r['memory']['correct']}/{r['memory']['n']}")
    row(
        "held-out memory cases correct",
        lambda r: f"{r['memory_heldout']['correct']}/{r['memory_heldout']['n']}",
    )
    row("fresh memory cases correct", lambda r: f"{r['memory_fresh']['correct']}/{r['memory_fresh']['n']}")
    for flipped in ("off", "on"):
        if any(f"memory_notes_{flipped}" in r for r in results):
            row(
                f"memory / held-out / fresh memory cases, caller notes {flipped} (same run)",
                lambda r, f=flipped: (
                    f"{r[f'memory_notes_{f}']['correct']} / {r[f'memory_heldout_notes_{f}']['correct']}"
                    f" / {r[f'memory_fresh_notes_{f}']['correct']}"
                ),
            )
    threads = sorted({s["threads"] for r in results for s in r.get("speed", [])})
    for t in threads:

        def sp(r: dict[str, Any], t: int = t) -> dict[str, Any]:
            return next(s for s in r["speed"] if s["threads"] == t)

        row(
            f"decode tok/s, {t} thread(s)",
            lambda r, sp=sp: f"{sp(r)['decode_tok_per_s']} (n={sp(r)['decode_tokens']} tokens)",
        )
        row(
            f"first token cold / after listen, ms, median, {t} thread(s)",
            lambda r, sp=sp: (
                f"{1000 * sp(r)['first_token_cold_s']['median']:.0f} / "
                f"{1000 * sp(r)['first_token_after_listen_s']['median']:.0f} (n={sp(r)['n_first_token']})"
            ),
        )
        row(
            f"first phrase after listen, ms, median, {t} thread(s)",
            lambda r, sp=sp: f"{1000 * sp(r)['first_phrase_after_listen_s']['median']:.0f}",
        )
    row(
        "RSS after load / peak, GiB",
        lambda r: f"{r['rss_after_load_gib']['VmRSS']:.2f} / {r['rss_end_gib']['VmHWM']:.2f}",
    )
    row("load at start (int8 quantisation), s", lambda r: r["load_s"])
    row("one-time conversion, s", lambda r: r["conversion_s"])
    row("load average before / after", lambda r: f"{r['load_before'][0]} / {r['load_after'][0]}")
    return "\n".join(lines)


def _child_args(args: argparse.Namespace, profile: str, out: Path) -> list[str]:
    argv = [sys.executable, "-m", "duplex.bench.llm_quality", "--one", profile, "--json", str(out)]
    argv += ["--facts", str(args.facts), "--repeats", str(args.repeats)]
    argv += ["--threads", ",".join(str(t) for t in args.threads)]
    for flag in ("no_memory", "no_drafter", "no_progress", "notes_ab"):
        if getattr(args, flag):
            argv.append("--" + flag.replace("_", "-"))
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m duplex.bench.llm_quality", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--profiles", default="cpu,cpu-large", help="comma-separated models.yaml profiles")
    ap.add_argument("--out", default="bench-out/llm", help="folder for llm_quality.json")
    ap.add_argument("--facts", type=int, default=0, help="facts questions (0: all 80; -1: skip)")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory cases")
    ap.add_argument("--threads", default="1", help="torch thread counts for the speed part, e.g. 1,2")
    ap.add_argument("--repeats", type=int, default=2, help="passes over the first-token prompts")
    ap.add_argument(
        "--no-drafter", action="store_true", help="load the slow model alone (RSS without the drafter)"
    )
    ap.add_argument(
        "--notes-ab",
        action="store_true",
        help="also score the memory cases with the profile's caller_notes flipped, same loaded model",
    )
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # child process: one profile
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.threads = [int(t) for t in str(args.threads).split(",") if t]
    args.memory = not args.no_memory
    if args.one:
        res = run_profile(args.one, args)
        Path(args.json).write_text(json.dumps(res, indent=1))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in [p.strip() for p in args.profiles.split(",") if p.strip()]:
        part = out / f"llm_quality-{name}.json"
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        rc = subprocess.call(_child_args(args, name, part), env=env)
        if rc != 0:
            print(f"profile {name}: failed (exit {rc})", file=sys.stderr)
            return rc
        results.append(json.loads(part.read_text()))
    doc = {
        "argv": list(argv) if argv is not None else sys.argv[1:],
        "cpus": os.cpu_count(),
        "results": results,
    }
    (out / "llm_quality.json").write_text(json.dumps(doc, indent=1))
    table = summary_table(results)
    (out / "llm_quality.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
