"""Batched LLM decode across sessions (issue 22): greedy tokens/s with N sessions decoding at once.

Loads the profile's dialogue engine the way the service does (`load_dialogue_stage`: the packaged slow
model and drafter, their dtype, window and system prompt) and, for each model and each session
count N, gives N sessions the system prompt plus a different question each (so their caches differ
in length), then decodes `tokens` greedy tokens per session in three independent sets, in lock-step
so that a neighbour's load on a shared machine hits them alike: one session alone (the reference),
the N sessions one by one (`CachedLM.feed` per session per step, what the engine does today) and
the N sessions batched (`CachedLM.feed_batch`, one forward per step for all N). Reported per
(model, N, mode): n timed steps, P50/P90 of the step latency (all N sessions advance one token),
total tokens/s, the speedup over one by one, the scale over one session alone ("vs N=1", the issue's
target: >= 2.5 at N=4), and the share of greedy tokens equal to the one-by-one run's. Dynamic int8
products quantise a batch with one activation scale, so a near-tie can flip and the two runs part
ways from there; `--per-session-quant` gives each session its own scale (slower; the bf16 down_proj
still rounds a little differently at another batch size).

    .venv/bin/python -m duplex.bench.decode --sessions 1,2,4 --threads 1 --out decode-bench.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from duplex.bench.common import LONG_PROMPTS, QUESTIONS

MODELS = ("drafter", "slow")


def _prompts(n: int) -> list[str]:
    # alternate short questions and long requests so the sessions' caches are of different lengths
    out = []
    for i in range(n):
        pool = QUESTIONS if i % 2 == 0 else LONG_PROMPTS
        out.append(pool[(i // 2) % len(pool)])
    return out


def _prompt_ids(tokenizer: Any, question: str) -> list[int]:
    # ChatML, as both packaged models (SmolLM2, Qwen2.5) render a user turn after the system prompt
    text = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    return list(tokenizer.encode(text, add_special_tokens=False))


def _stats(steps: list[float], sessions: int) -> dict[str, Any]:
    arr = np.asarray(steps)
    return {
        "n": len(steps),
        "step_p50_ms": float(np.percentile(arr, 50) * 1e3),
        "step_p90_ms": float(np.percentile(arr, 90) * 1e3),
        "tokens_per_s": sessions * len(steps) / float(arr.sum()),
    }


def _compare(conv: Any, prompts: list[list[int]], tokens: int, per_session_quant: bool) -> dict[str, Any]:
    """Greedy-decode three independent sets of sessions in lock-step: one session alone (the
    reference for "vs one session"), the N sessions one by one, and the N sessions batched. Each
    step times all three back to back, so a neighbour's load on a shared machine hits them alike."""
    import torch

    lm = conv.lm
    sets = {
        "one": [conv.new_track().cache],
        "one-by-one": [conv.new_track().cache for _ in prompts],
        "batched": [conv.new_track().cache for _ in prompts],
    }
    for name, caches in sets.items():
        for c, p in zip(caches, prompts[:1] if name == "one" else prompts, strict=True):
            lm.feed(c, p)
    steps: dict[str, list[float]] = {name: [] for name in sets}
    out: dict[str, list[list[int]]] = {name: [[] for _ in caches] for name, caches in sets.items()}
    for step in range(tokens + 1):  # the first step is a warm-up, not timed
        for name, caches in sets.items():
            nxt = [int(torch.argmax(c.logits)) for c in caches]
            t0 = time.perf_counter()
            if name == "batched":
                lm.feed_batch(caches, [[t] for t in nxt], per_session_quant=per_session_quant)
            else:
                for c, t in zip(caches, nxt, strict=True):
                    lm.feed(c, [t])
            if step:
                steps[name].append(time.perf_counter() - t0)
            for o, t in zip(out[name], nxt, strict=True):
                o.append(t)
    res = {name: _stats(steps[name], len(caches)) for name, caches in sets.items()}
    for name in ("one-by-one", "batched"):
        res[name]["cache_tokens"] = [len(c.ids) for c in sets[name]]
    same = sum(
        a == b
        for s, t in zip(out["one-by-one"], out["batched"], strict=True)
        for a, b in zip(s, t, strict=True)
    )
    res["token_agreement"] = same / (len(prompts) * (tokens + 1))
    return res


def bench_decode(
    profile: str | None = None,
    *,
    models: Sequence[str] = MODELS,
    sessions: Sequence[int] = (1, 2, 4, 8),
    tokens: int = 64,
    threads: int | None = 1,
    per_session_quant: bool = False,
    stage: Any = None,
) -> dict[str, Any]:
    """Greedy decode throughput of `models` ("drafter", "slow") for each session count, one by one
    vs batched. `stage` reuses a loaded `DialogueStage` (else the profile's is loaded)."""
    import torch

    from dialogue.engine import load_dialogue_stage
    from duplex.base.config import load_profile

    prev_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(int(threads))
    try:
        if stage is None:
            prof = load_profile(profile)
            stage = load_dialogue_stage(
                prof.components["llm"], prof.components.get("drafter"), progress=False
            )
        rows: list[dict[str, Any]] = []
        with torch.inference_mode():
            for name in models:
                conv = stage.drafter if name == "drafter" else stage.slow
                tok = stage.drafter_tokenizer if name == "drafter" else stage.slow_tokenizer
                if conv is None:
                    continue
                for n in sessions:
                    prompts = [_prompt_ids(tok, q) for q in _prompts(n)]
                    res = _compare(conv, prompts, tokens, per_session_quant)
                    base, one = res["one-by-one"], res["one"]
                    for mode in ("one-by-one", "batched"):
                        r = res[mode]
                        rows.append(
                            {
                                "model": name,
                                "sessions": n,
                                "mode": mode,
                                **r,
                                "speedup": r["tokens_per_s"] / base["tokens_per_s"],
                                "vs_one_session": r["tokens_per_s"] / one["tokens_per_s"],
                                "one_session_tokens_per_s": one["tokens_per_s"],
                                "token_agreement": res["token_agreement"],
                            }
                        )
    finally:
        torch.set_num_threads(prev_threads)
    return {
        "threads": threads,
        "tokens": tokens,
        "per_session_quant": per_session_quant,
        "torch": torch.__version__,
        "rows": rows,
    }


def format_table(result: dict[str, Any]) -> str:
    """The rows as a fixed-width text table."""
    head = f"{'model':8} {'N':>2} {'mode':10} {'n':>4} {'P50 ms':>8} {'P90 ms':>8} {'tok/s':>7} {'speedup':>7} {'vs N=1':>6} {'agree':>5}"
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        lines.append(
            f"{r['model']:8} {r['sessions']:>2} {r['mode']:10} {r['n']:>4} {r['step_p50_ms']:>8.1f} "
            f"{r['step_p90_ms']:>8.1f} {r['tokens_per_s']:>7.1f} {r['speedup']:>7.2f} {r['vs_one_session']:>6.2f} "
            f"{r['token_agreement']:>5.2f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m duplex.bench.decode`: print the table and write the JSON to --out."""
    ap = argparse.ArgumentParser(prog="python -m duplex.bench.decode", description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default=None, help="models.yaml profile (default: the default profile)")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated: drafter, slow")
    ap.add_argument("--sessions", default="1,2,4,8", help="comma-separated session counts")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens decoded per session")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--per-session-quant", action="store_true", help="int8 products once per session")
    ap.add_argument("--out", default="decode-bench.json", help="JSON results")
    args = ap.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = set(models) - set(MODELS)
    if bad:
        ap.error(f"--models: unknown {sorted(bad)} (known: {', '.join(MODELS)})")
    result = bench_decode(
        args.profile,
        models=models,
        sessions=[int(s) for s in args.sessions.split(",")],
        tokens=args.tokens,
        threads=args.threads,
        per_session_quant=args.per_session_quant,
    )
    print(format_table(result))
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
