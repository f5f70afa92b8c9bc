"""CUDA decode vs CPU for the drafter (issue 22): does the `gpu` profile's bf16 CUDA drafter decode what the
CPU float32 one does, alone and batched?

Loads the profile's drafter (weights and adapter as the engine loads them) twice: on the CPU in float32
(the reference) and on `--device` in `--dtype`. Each greedily decodes `--tokens` tokens for `--prompts`
different chat prompts, one session at a time (`CachedLM.feed`) and all together (`CachedLM.feed_batch`).
Reported: the share of greedy tokens equal to the CPU float32 run's (bf16 rounding flips near-ties, after
which a session parts ways), the share of the device's batched tokens equal to its own one-by-one tokens
(batching must not change the decode beyond rounding), and the largest logit difference of the first
step (same input everywhere, so it measures rounding alone).

    .venv/bin/python -m duplex.bench.gpu_check --out gpu-check-out/decode-agreement.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dialogue import llm_weights
from dialogue.drafter_adapter import adapter_path, load_drafter
from dialogue.engine import DrafterOptions
from dialogue.kv_cache import CachedLM
from duplex.base.config import load_profile

PROMPTS = (
    "What is the capital of France?",
    "Can you tell me a little about how the weather works?",
    "Hi! I'd like to book a table for two tonight.",
    "Why is the sky blue?",
    "How many legs does a spider have?",
    "Tell me a short joke about computers.",
    "What should I cook for dinner?",
    "Where is the nearest train station?",
)


def greedy_decode(lm: CachedLM, prompts: Sequence[list[int]], tokens: int, batched: bool) -> dict[str, Any]:
    """Greedy tokens per prompt, the first step's logits [B, vocab] (float32, CPU) and the decode's seconds;
    one session at a time (`CachedLM.feed`) or all together (`feed_batch`)."""
    caches = [lm.new() for _ in prompts]
    if batched:
        lm.feed_batch(caches, prompts)
    else:
        for c, p in zip(caches, prompts, strict=True):
            lm.feed(c, p)
    first = torch.stack([c.logits.float().cpu() for c in caches])
    out: list[list[int]] = [[] for _ in prompts]
    t0 = time.perf_counter()
    for _ in range(tokens):
        picks = [int(torch.argmax(c.logits)) for c in caches]
        for o, t in zip(out, picks, strict=True):
            o.append(t)
        if batched:
            lm.feed_batch(caches, [[t] for t in picks])
        else:
            for c, t in zip(caches, picks, strict=True):
                lm.feed(c, [t])
    return {"tokens": out, "first_logits": first, "decode_s": time.perf_counter() - t0}


def token_agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> float:
    same = total = 0
    for x, y in zip(a, b, strict=True):
        same += sum(int(p == q) for p, q in zip(x, y, strict=True))
        total += len(x)
    return same / max(total, 1)


def run(profile: str | None, device: str, dtype: str, n_prompts: int, tokens: int) -> dict[str, Any]:
    """The agreement record (see the module docstring)."""
    drafter = load_profile(profile).component("drafter")
    opts = DrafterOptions.from_mapping({**drafter.options, "dtype": dtype, "device": device})
    adapter = adapter_path(opts.adapter)
    results: dict[str, dict[str, Any]] = {}
    prompts: list[list[int]] = []
    for name, (dev, dt) in {"cpu_float32": ("cpu", "float32"), "device": (device, dtype)}.items():
        model, tok = load_drafter(drafter.weights, dt, adapter, progress=False, device=dev)
        if not prompts:
            for q in PROMPTS[:n_prompts]:
                msgs = [{"role": "user", "content": q}]
                text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
                prompts.append(list(tok(text, add_special_tokens=False)["input_ids"]))
        lm = CachedLM(model, sink_tokens=0, window_tokens=opts.window_tokens, evict_chunk=opts.evict_chunk)
        with torch.inference_mode():
            results[name] = {"one_by_one": greedy_decode(lm, prompts, tokens, False)}
            results[name]["batched"] = greedy_decode(lm, prompts, tokens, True)
        del model, lm
    ref, dev_ = results["cpu_float32"], results["device"]

    def diff(a: dict[str, Any], b: dict[str, Any]) -> float:
        return float((a["first_logits"] - b["first_logits"]).abs().max())

    return {
        "profile": profile,
        "device": device,
        "device_name": torch.cuda.get_device_name(torch.device(device))
        if device.startswith("cuda")
        else "cpu",
        "dtype": dtype,
        "prompts": len(prompts),
        "tokens": tokens,
        "token_agreement": {
            "device_one_by_one_vs_cpu_float32": token_agreement(
                dev_["one_by_one"]["tokens"], ref["one_by_one"]["tokens"]
            ),
            "device_batched_vs_cpu_float32": token_agreement(
                dev_["batched"]["tokens"], ref["one_by_one"]["tokens"]
            ),
            "device_batched_vs_device_one_by_one": token_agreement(
                dev_["batched"]["tokens"], dev_["one_by_one"]["tokens"]
            ),
            "cpu_batched_vs_cpu_one_by_one": token_agreement(
                ref["batched"]["tokens"], ref["one_by_one"]["tokens"]
            ),
        },
        "max_first_logit_diff": {
            "device_vs_cpu_float32": diff(dev_["one_by_one"], ref["one_by_one"]),
            "device_batched_vs_device_one_by_one": diff(dev_["batched"], dev_["one_by_one"]),
        },
        "decode_s": {f"{k}_{m}": round(v[m]["decode_s"], 4) for k, v in results.items() for m in v},
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="gpu", help="models.yaml profile whose drafter is checked")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N (or cpu, to try the check itself)")
    ap.add_argument(
        "--dtype", default="bfloat16", choices=[d for d in llm_weights.DTYPES if d != "int8-dynamic"]
    )
    ap.add_argument("--prompts", type=int, default=4, help=f"prompts decoded at once (1..{len(PROMPTS)})")
    ap.add_argument("--tokens", type=int, default=16, help="greedy tokens per prompt")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the CPU reference)")
    ap.add_argument("--out", default="gpu-check-out/decode-agreement.json")
    args = ap.parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS) or args.tokens < 1:
        ap.error(f"--prompts takes 1..{len(PROMPTS)} and --tokens >= 1")
    llm_weights.check_device(args.device, args.dtype, "gpu_check")
    llm_weights.require_device(args.device, "gpu_check")
    torch.set_num_threads(args.threads)
    record = run(args.profile, args.device, args.dtype, args.prompts, args.tokens)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    json.dump(record, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
