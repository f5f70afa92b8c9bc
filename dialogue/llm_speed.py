"""Latency of the LLM stage: user-turn prefill, first step, decode rate, and a sanity answer."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable
from typing import Any

import torch

from duplex.config import ComponentConfig

from .llm import LlmStage, LlmStep, load_llm_stage

#: ~25 tokens once rendered as a user turn (the typical length of one spoken request)
PREFILL_TEXT = "Hi there, could you tell me what the weather is usually like in Lisbon during the spring?"
DECODE_TEXT = "Tell me a long story about a dragon who learns to bake bread."
CHECK_TEXT = "What is the capital of France?"


def measure(stage: LlmStage, n: int = 5, decode_tokens: int = 16) -> dict[str, Any]:
    """P50 over `n` runs of prefill (warm system prompt), first step, decode tok/s; Paris check."""
    prefill_s, first_step_s, decode_rate = [], [], []
    prefill_tokens = 0
    for _ in range(n):
        state = stage.init_state()
        out, state = stage.step(state, LlmStep([{"role": "user", "content": PREFILL_TEXT}], 0))
        prefill_s.append(out.timings["prefill_s"])
        prefill_tokens = out.prefill_tokens
        # what the session sees at end of turn: prefill plus the first step's tokens
        state = stage.init_state()
        out, state = stage.step(
            state, LlmStep([{"role": "user", "content": PREFILL_TEXT}], stage.options.first_step_tokens)
        )
        first_step_s.append(out.timings["total_s"])
        state = stage.init_state()
        stage.step(state, LlmStep([{"role": "user", "content": DECODE_TEXT}], 1))
        out, state = stage.step(state, LlmStep(None, decode_tokens))
        if out.n_tokens:
            decode_rate.append(out.n_tokens / out.timings["decode_s"])
    answer = stage.generate([{"role": "user", "content": CHECK_TEXT}])
    return {
        "dtype": stage.options.dtype,
        "threads": stage.options.threads or torch.get_num_threads(),
        "n": n,
        "prefill_tokens": prefill_tokens,
        "prefill_s_p50": statistics.median(prefill_s),
        "first_step_tokens": stage.options.first_step_tokens,
        "first_step_s_p50": statistics.median(first_step_s),
        "decode_tok_s_p50": statistics.median(decode_rate) if decode_rate else float("nan"),
        "answer": answer,
        "paris": "paris" in answer.lower(),
    }


def sweep(
    component: ComponentConfig,
    dtypes: Iterable[str] = ("float32", "bfloat16", "int8-dynamic"),
    threads: Iterable[int] = (1, 2),
    n: int = 5,
) -> list[dict[str, Any]]:
    """Load the component once per dtype and `measure` it at each thread count."""
    rows = []
    for dtype in dtypes:
        comp = dataclasses.replace(component, options={**component.options, "dtype": dtype})
        base = load_llm_stage(comp, progress=False)
        for t in threads:
            stage = LlmStage(base.model, base.tokenizer, dataclasses.replace(base.options, threads=t))
            stage.warm_state()
            rows.append(measure(stage, n=n))
        del base, stage
    return rows
