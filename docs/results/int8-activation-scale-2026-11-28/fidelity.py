"""int8 activation scales against float32: one scale per tensor (torch's dynamic product, shipped) or per token.

For each of the first NQ factual questions (data/dialogue/facts_eval.jsonl): the chat prompt and float32's
greedy answer (24 tokens at most), teacher forced. The int8 slow model's logits at the answer's positions,
run three ways: as the engine runs it (the prompt in one forward, the answer a token at a time), everything
in one forward, and a token at a time throughout; compared with float32's (mean KL, top-1 agreement).

    PROFILE=cpu NQ=10 OUT=fidelity.json .venv/bin/python docs/results/int8-activation-scale-2026-11-28/fidelity.py
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from transformers import DynamicCache

from dialogue.fast_decoder import FastDecoder
from dialogue.llm_weights import load
from duplex.base.config import load_profile
from duplex.bench.common import load_facts

WAYS = (("engine", "prompt"), ("one-forward", "all"), ("decode", "none"))


def logits_run(model: Any, dec: FastDecoder, ids: list[int], split: int) -> torch.Tensor:
    """Logits after every position: ids[:split] in one forward, then one token at a time."""
    cache = DynamicCache(config=model.config)
    out = []
    with torch.inference_mode():
        out.append(model.lm_head(dec.forward(cache, ids[:split], 0)[0]).float())
        for i in range(split, len(ids)):
            out.append(model.lm_head(dec.forward(cache, ids[i : i + 1], i)[0]).float())
    return torch.cat(out)


def main() -> None:
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    profile = load_profile(os.environ.get("PROFILE", "cpu"))
    cfg = profile.component("llm")
    m32, tok = load(cfg, "float32", progress=False)
    m8, _ = load(cfg, "int8-dynamic", progress=False)
    d32 = FastDecoder(m32)
    d8 = {scale: FastDecoder(m8, scale) for scale in ("tensor", "token")}
    facts = load_facts()[: int(os.environ.get("NQ", "10"))]
    rows, agg = [], {}
    for f in facts:
        msgs = [{"role": "system", "content": cfg.options["system_prompt"]}, {"role": "user", "content": f.q}]
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        prompt = list(tok(text, add_special_tokens=False)["input_ids"])
        ids, p = list(prompt), len(prompt)
        cache = DynamicCache(config=m32.config)
        with torch.inference_mode():
            h = d32.forward(cache, ids, 0)
            for _ in range(24):
                t = int(m32.lm_head(h[0, -1]).argmax())
                if t == tok.eos_token_id or tok.decode([t]) == "<|im_end|>":
                    break
                ids.append(t)
                h = d32.forward(cache, [t], len(ids) - 1)
        ref = logits_run(m32, d32, ids, len(ids))[p - 1 : len(ids) - 1]
        lp_ref = ref.log_softmax(-1)
        row: dict[str, Any] = {"q": f.q, "answer": tok.decode(ids[p:])}
        for scale, dec in d8.items():
            for way, part in WAYS:
                split = {"prompt": p, "all": len(ids), "none": 1}[part]
                lg = logits_run(m8, dec, ids, split)[p - 1 : len(ids) - 1]
                lp = lg.log_softmax(-1)
                kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
                agree = (lg.argmax(-1) == ref.argmax(-1)).float()
                key = f"{scale}/{way}"
                row[key] = {"kl": float(kl.mean()), "agree": float(agree.mean())}
                a = agg.setdefault(key, {"kl": [], "agree": [], "first_agree": []})
                a["kl"] += kl.tolist()
                a["agree"] += agree.tolist()
                a["first_agree"].append(float(agree[0]))
        rows.append(row)
        kls = {k: round(v["kl"], 4) for k, v in row.items() if isinstance(v, dict)}
        print(f.q, "|", row["answer"][:50], "|", kls, flush=True)
    summary = {
        k: {
            "n_tokens": len(v["kl"]),
            "mean_kl": sum(v["kl"]) / len(v["kl"]),
            "top1_agree": sum(v["agree"]) / len(v["agree"]),
            "first_token_agree": sum(v["first_agree"]) / len(v["first_agree"]),
        }
        for k, v in agg.items()
    }
    print(json.dumps(summary, indent=1))
    doc = {"profile": profile.name, "n_questions": len(facts), "summary": summary, "rows": rows}
    with open(os.environ.get("OUT", "fidelity.json"), "w") as fh:
        json.dump(doc, fh, indent=1)


if __name__ == "__main__":
    main()
