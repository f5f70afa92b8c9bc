"""Distil the relay's drafter on the slow model's openings: LoRA on SmolLM2-135M, optionally with fewer layers.

    python -m dialogue.training.train_drafter [--layers 20] [--rank 16] [--epochs 2] [--out dialogue/weights/drafter_adapter.safetensors]

1. Data: data/dialogue/drafter_targets.jsonl (`python -m dialogue.training.drafter_data` makes it): per prompt
   the slow model's greedy answer; single user turns and conversations whose history holds earlier
   answers (dialogue/training/multi_turn.py: a drafter taught on single turns copies the shape of earlier
   answers in a live session). The drafter sees the chat as the engine gives it (the service's
   system prompt, user turns normalised like ASR text) and learns the answer's first
   `TARGET_TOKENS` tokens in its own tokenisation (plus the end of turn when the answer ended there).
2. Model: the packaged SmolLM2-135M-Instruct in float32. With `--layers K < 30` the K layers with the
   largest block influence (1 - cosine between a layer's input and output on training chats; the
   ShortGPT criterion) are kept, so each drafted token costs K/30 of the layers. LoRA (rank r) on
   every projection of the kept layers, RMSNorm weights trained whole; the base stays frozen.
3. Training: cross-entropy on the answer tokens, AdamW with warm-up and cosine decay, the epoch with
   the lowest validation loss is kept. The validation and held-out prompts are the relay verifier's
   own splits (whole conversations / template families), so the relay benchmark never saw them.
4. Report: on held-out prompts, how often the greedy draft's first 1 / 3 / 5 words equal the slow
   model's (case and punctuation ignored), for the stock drafter and the distilled one, and the
   drafter's decode time per token; on held-out conversations also how often a draft starts with the
   first three words of an earlier answer (`copy_rate`, beside the slow model's own rate). Written into the adapter's metadata and printed.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dialogue import drafter_adapter as DA
from dialogue import verifier as V
from dialogue.training import drafter_data as DD
from dialogue.training import multi_turn as MT
from dialogue.training import relay_features as RF

#: answer tokens (drafter tokenisation) the loss covers: the drafter drafts at most 12
TARGET_TOKENS = 16
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# -- LoRA ---------------------------------------------------------------------------------------


class LoraLinear(nn.Module):
    """y = base(x) + scale * B(A(dropout(x))), with the base frozen; B starts at zero."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scale = alpha / rank
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(self.drop(x), self.lora_a), self.lora_b) * self.scale


def add_lora(model: Any, rank: int, alpha: float, dropout: float) -> list[str]:
    """Wrap every target projection of the decoder layers; returns their parameter-name stems."""
    for p in model.parameters():
        p.requires_grad_(False)
    names = []
    for i, layer in enumerate(model.model.layers):
        for parent in (layer.self_attn, layer.mlp):
            for attr in LORA_TARGETS:
                if hasattr(parent, attr):
                    setattr(parent, attr, LoraLinear(getattr(parent, attr), rank, alpha, dropout))
                    kind = "self_attn" if parent is layer.self_attn else "mlp"
                    names.append(f"model.layers.{i}.{kind}.{attr}")
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.requires_grad_(True)
    model.model.norm.weight.requires_grad_(True)
    return names


def adapter_tensors(model: Any) -> dict[str, torch.Tensor]:
    """What the adapter file holds: LoRA A/B per projection and the (whole) norm weights."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, LoraLinear):
            out[f"{name}.lora_a"] = mod.lora_a.detach().clone().contiguous()
            out[f"{name}.lora_b"] = mod.lora_b.detach().clone().contiguous()
    for name, p in model.named_parameters():
        if p.requires_grad and "lora_" not in name:
            out[name] = p.detach().clone().contiguous()
    return out


def merge_lora(model: Any) -> Any:
    """A copy of `model` with every LoraLinear folded into a plain Linear (for drafting and timing)."""
    m = copy.deepcopy(model)
    for name, mod in list(m.named_modules()):
        if isinstance(mod, LoraLinear):
            lin = mod.base
            with torch.no_grad():
                lin.weight.add_(mod.lora_b @ mod.lora_a, alpha=mod.scale)
            parent, _, attr = name.rpartition(".")
            setattr(m.get_submodule(parent), attr, lin)
    for p in m.parameters():
        p.requires_grad_(False)
    return m


# -- layer choice ---------------------------------------------------------------------------------


def block_influence(model: Any, seqs: Sequence[Sequence[int]]) -> list[float]:
    """Per layer, 1 - mean cosine(input, output) of its hidden states over `seqs` (ShortGPT)."""
    n = len(model.model.layers)
    sims = torch.zeros(n)
    count = 0
    with torch.inference_mode():
        for ids in seqs:
            out = model.model(input_ids=torch.tensor([list(ids)]), output_hidden_states=True)
            hs = out.hidden_states  # embeddings, after layer 0, ..., after the last (final-normed)
            for i in range(n):
                a, b = hs[i][0], hs[i + 1][0]
                if i == n - 1:
                    continue  # the last entry is after the final norm: not comparable
                sims[i] += F.cosine_similarity(a, b, dim=-1).sum()
            count += len(ids)
    bi = (1 - sims / max(count, 1)).tolist()
    bi[n - 1] = float("inf")  # the last layer is always kept (it feeds the final norm and the head)
    return bi


def choose_layers(bi: Sequence[float], k: int) -> list[int]:
    """The k layers with the largest block influence (the first and last always), in order."""
    n = len(bi)
    if not 2 <= k <= n:
        raise ValueError(f"--layers must be between 2 and {n}")
    ranked = sorted(range(1, n - 1), key=lambda i: -bi[i])
    return sorted([0, n - 1] + ranked[: k - 2])


# -- data ---------------------------------------------------------------------------------------


@dataclass
class Example:
    key: str
    split: str
    prompt: list[int]
    target: list[int]
    text: str
    answer: str
    history: list[list[str]]
    source: str = ""


def is_multi(e: Example) -> bool:
    """A conversation of dialogue/training/multi_turn.py (its single-turn prompts are measured apart)."""
    return e.source == MT.SOURCE


def build_examples(tokenizer: Any, system: str, rows: Sequence[dict[str, Any]]) -> list[Example]:
    """Drafter-side chat ids and answer ids of each target row."""
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = []
    for r in rows:
        answer = str(r["answer"]).strip()
        if not answer:
            continue
        hist = [{"role": a, "content": b} for a, b in r["history"]]
        ids = V.chat_ids(tokenizer, system, hist, r["text"])
        tgt = list(tokenizer.encode(answer, add_special_tokens=False))
        if r.get("ended") and len(tgt) < TARGET_TOKENS and isinstance(stop, int):
            tgt.append(stop)
        out.append(
            Example(
                r["key"],
                r["split"],
                ids,
                tgt[:TARGET_TOKENS],
                r["text"],
                answer,
                [list(h) for h in r["history"]],
                str(r.get("source", "")),
            )
        )
    return out


def batches(examples: Sequence[Example], size: int, rng: random.Random | None) -> list[list[Example]]:
    """Batches of similar length (less padding); shuffled order of batches when `rng` is given."""
    order = sorted(examples, key=lambda e: len(e.prompt) + len(e.target))
    out = [list(order[i : i + size]) for i in range(0, len(order), size)]
    if rng is not None:
        rng.shuffle(out)
    return out


def shared_prefix(seqs: Sequence[Sequence[int]]) -> int:
    """Length of the token prefix every sequence starts with, leaving each at least one token of its own."""
    n = min(len(s) for s in seqs) - 1
    first = seqs[0]
    k = 0
    while k < n and all(s[k] == first[k] for s in seqs):
        k += 1
    return k


def batch_loss(
    model: Any, batch: Sequence[Example], pad_id: int, share: bool = True
) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy over the answer tokens of a right-padded batch, and their count.

    Every chat starts with the same system prompt: with `share` its tokens run once (batch 1, with
    gradients) and their keys/values are repeated for the batch, so only the rest is per example
    (about half the work; the loss and the gradients are those of the full sequences)."""
    from transformers import DynamicCache

    seqs = [e.prompt + e.target for e in batch]
    p = shared_prefix(seqs) if share and len(seqs) > 1 else 0
    cache = None
    if p:
        cache = DynamicCache(config=model.config)
        model.model(input_ids=torch.tensor([seqs[0][:p]]), past_key_values=cache, use_cache=True)
        cache.batch_repeat_interleave(len(seqs))
    width = max(len(s) for s in seqs) - p
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), p + width, dtype=torch.long)
    rows, cols, labels = [], [], []
    for i, (e, s) in enumerate(zip(batch, seqs, strict=True)):
        ids[i, : len(s) - p] = torch.tensor(s[p:])
        mask[i, : len(s)] = 1
        start = len(e.prompt) - p
        for j, t in enumerate(e.target):
            rows.append(i)
            cols.append(start + j - 1)  # the position whose logits predict target j
            labels.append(t)
    h = model.model(
        input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=cache is not None
    ).last_hidden_state
    logits = model.lm_head(h[torch.tensor(rows), torch.tensor(cols)])
    loss = F.cross_entropy(logits.float(), torch.tensor(labels), reduction="sum")
    return loss, len(labels)


def mean_loss(model: Any, examples: Sequence[Example], pad_id: int, size: int = 32) -> float:
    total, n = 0.0, 0
    model.eval()
    with torch.inference_mode():
        for b in batches(examples, size, None):
            loss, k = batch_loss(model, b, pad_id)
            total += float(loss)
            n += k
    return total / max(n, 1)


# -- evaluation -----------------------------------------------------------------------------------


def words(text: str, k: int) -> list[str]:
    """The first k complete words, lower-cased, without punctuation."""
    return [text[a:b].lower().replace("\u2019", "'") for a, b in V.complete_words(text, ended=True)[:k]]


def match_rates(
    model: Any, tokenizer: Any, system: str, examples: Sequence[Example], progress: bool = False
) -> dict[str, Any]:
    """Greedy drafts (the engine's procedure) vs the slow model's answer: first 1 / 3 / 5 words equal."""
    from tqdm import tqdm

    stops = V.stop_token_ids(tokenizer)
    hits = {1: 0, 3: 0, 5: 0}
    samples = []
    copies = {"draft": 0, "slow": 0, "n": 0}
    for e in tqdm(examples, desc="drafting", disable=not progress):
        d = V.draft(
            model, tokenizer, e.prompt, stop_ids=stops, max_words=max(hits)
        )  # 5 words: all three rates
        for k in hits:
            want = words(e.answer, k)
            hits[k] += int(bool(want) and words(d.text, k) == want)
        if e.history:
            copies["n"] += 1
            copies["draft"] += int(copies_history(d.text, e.history))
            copies["slow"] += int(copies_history(e.answer, e.history))
        if len(samples) < 12:
            samples.append(
                {"text": e.text, "slow": e.answer[:60], "draft": d.text}
                | ({"history": e.history[-2:]} if e.history else {})
            )
    n = max(len(examples), 1)
    out = {"n": len(examples), **{f"match_{k}w": hits[k] / n for k in hits}}
    if copies["n"]:
        # the live failure this guards: a draft that starts like an earlier answer of the session
        out |= {
            "with_history": copies["n"],
            "copy_rate": copies["draft"] / copies["n"],
            "slow_copy_rate": copies["slow"] / copies["n"],
        }
    return out | {"samples": samples}


def copies_history(text: str, history: Sequence[Sequence[str]], k: int = 3) -> bool:
    """`text` starts with the same `k` words as an earlier assistant turn."""
    head = words(text, k)
    return len(head) == k and any(words(c, k) == head for r, c in history if r == "assistant")


def decode_ms(model: Any, tokenizer: Any, n: int = 40) -> float:
    """P50 decode time per token (ms) of `model` as the service runs it: int8, the lean forward."""
    from transformers import DynamicCache

    from dialogue.fast_decoder import FastDecoder
    from dialogue.llm_weights import quantize_int8_dynamic

    m = quantize_int8_dynamic(copy.deepcopy(model), tokenizer)
    dec = FastDecoder.for_model(m)
    assert dec is not None
    cache = DynamicCache(config=m.config)
    ids = tokenizer.encode("Hello, can you tell me what the weather is like in Lisbon during the spring?")
    times = []
    with torch.inference_mode():
        h = dec.forward(cache, ids, 0)[:, -1]
        pos = len(ids)
        for _ in range(n):
            t = time.perf_counter()
            tok = int(torch.argmax(m.lm_head(h)[0]))
            h = dec.forward(cache, [tok], pos)[:, -1]
            times.append(time.perf_counter() - t)
            pos += 1
    times.sort()
    return 1000 * times[len(times) // 2]


# -- main -------------------------------------------------------------------------------------------


@dataclass
class TrainConfig:
    layers: int = 20
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    lr: float = 5e-4
    weight_decay: float = 0.0
    batch: int = 16
    epochs: int = 2
    warmup: int = 20
    seed: int = 0


def main(argv: Sequence[str] | None = None) -> int:
    from tqdm import tqdm

    from dialogue import llm_weights
    from duplex.base.config import load_profile

    ap = argparse.ArgumentParser(
        prog="python -m dialogue.training.train_drafter", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--layers", type=int, default=TrainConfig.layers, help="decoder layers kept (of 30)")
    ap.add_argument("--rank", type=int, default=TrainConfig.rank)
    ap.add_argument("--epochs", type=int, default=TrainConfig.epochs)
    ap.add_argument("--lr", type=float, default=TrainConfig.lr)
    ap.add_argument("--batch", type=int, default=TrainConfig.batch)
    ap.add_argument("--limit", type=int, default=None, help="train on a seeded sample of N examples")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=DA.DEFAULT_ADAPTER)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    progress = not args.no_progress
    cfg = TrainConfig(layers=args.layers, rank=args.rank, lr=args.lr, batch=args.batch, epochs=args.epochs)
    torch.manual_seed(cfg.seed)
    t0 = time.time()

    splits = {dp.key: dp.split for dp in DD.drafter_prompts()}
    # the split comes from the prompt set (a row made before a prompt was excluded is left out)
    rows = [r | {"split": splits[k]} for k, r in DD.read_targets().items() if k in splits]
    if not rows:
        raise SystemExit(
            f"no targets in {DD.TARGETS_FILE}: run `python -m dialogue.training.drafter_data` first"
        )
    system = str(load_profile("cpu").component("llm").options.get("system_prompt", "")).strip()
    model, tok = llm_weights.load(RF.DRAFTER, "float32", progress=progress)
    model.train()
    examples = build_examples(tok, system, rows)
    by_split = {s: [e for e in examples if e.split == s] for s in ("train", "val", "heldout")}
    if args.limit:
        by_split["train"] = random.Random(cfg.seed).sample(
            by_split["train"], min(args.limit, len(by_split["train"]))
        )
    print(f"examples: { {k: len(v) for k, v in by_split.items()} }", file=sys.stderr)

    base_eval: dict[str, Any] = {}
    base_multi: dict[str, Any] = {}
    if not args.limit:
        base_eval = match_rates(
            model, tok, system, [e for e in by_split["heldout"] if not is_multi(e)], progress
        )
        base_eval["decode_ms"] = decode_ms(model, tok)
        base_multi = match_rates(
            model, tok, system, [e for e in by_split["heldout"] if is_multi(e)], progress
        )
        print(
            f"stock drafter, held-out: {json.dumps({k: v for k, v in base_eval.items() if k != 'samples'})}",
            file=sys.stderr,
        )

    n_layers = len(model.model.layers)
    kept = list(range(n_layers))
    bi: list[float] = []
    if cfg.layers < n_layers:
        sample = random.Random(cfg.seed).sample(by_split["train"], min(64, len(by_split["train"])))
        bi = block_influence(model, [e.prompt + e.target for e in sample])
        kept = choose_layers(bi, cfg.layers)
        DA.keep_layers(model, kept)
        print(f"kept layers {kept}", file=sys.stderr)
    lora = add_lora(model, cfg.rank, cfg.alpha, cfg.dropout)
    params = [p for p in model.parameters() if p.requires_grad]
    print(
        f"trainable parameters: {sum(p.numel() for p in params)} in {len(lora)} LoRA projections + norms",
        file=sys.stderr,
    )
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    rng = random.Random(cfg.seed)
    steps_per_epoch = math.ceil(len(by_split["train"]) / cfg.batch)
    total_steps = steps_per_epoch * cfg.epochs

    def lr_at(step: int) -> float:
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        frac = (step - cfg.warmup) / max(1, total_steps - cfg.warmup)
        return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))

    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    history = []
    best: tuple[float, int, dict[str, torch.Tensor]] = (
        mean_loss(model, by_split["val"], pad),
        -1,
        adapter_tensors(model),
    )
    print(f"val loss before training {best[0]:.3f}", file=sys.stderr)
    step = 0
    for epoch in range(cfg.epochs):
        model.train()
        bar = tqdm(
            batches(by_split["train"], cfg.batch, rng),
            desc=f"epoch {epoch + 1}/{cfg.epochs}",
            disable=not progress,
        )
        run, seen = 0.0, 0
        for b in bar:
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            loss, n = batch_loss(model, b, pad)
            opt.zero_grad()
            (loss / n).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            run += float(loss.detach())
            seen += n
            step += 1
            bar.set_postfix(loss=f"{run / seen:.3f}")
        val = mean_loss(model, by_split["val"], pad)
        history.append({"epoch": epoch + 1, "train_loss": run / max(seen, 1), "val_loss": val})
        print(f"epoch {epoch + 1}: train {run / max(seen, 1):.3f}, val {val:.3f}", file=sys.stderr)
        if val < best[0]:
            best = (val, epoch + 1, adapter_tensors(model))
    # the kept epoch's weights into the model, then measure it the way the engine drafts
    with torch.no_grad():
        own = dict(model.named_parameters())
        for name, t in best[2].items():  # LoRA A/B and the norm weights: all parameters of the model
            own[name].copy_(t)
    merged = merge_lora(model)
    merged.eval()
    val_eval = match_rates(merged, tok, system, by_split["val"], progress)
    ho_eval = match_rates(merged, tok, system, [e for e in by_split["heldout"] if not is_multi(e)], progress)
    ho_eval["decode_ms"] = decode_ms(merged, tok)
    ho_multi = match_rates(merged, tok, system, [e for e in by_split["heldout"] if is_multi(e)], progress)
    print(
        f"distilled drafter, held-out conversations: "
        f"{json.dumps({k: v for k, v in ho_multi.items() if k != 'samples'})}",
        file=sys.stderr,
    )
    print(
        f"distilled drafter, held-out: {json.dumps({k: v for k, v in ho_eval.items() if k != 'samples'})}",
        file=sys.stderr,
    )

    from safetensors.torch import save_file

    meta = {
        "format": DA.FORMAT,
        "base": {k: RF.DRAFTER[k] for k in ("name", "package", "file", "version")},
        "base_sha256": RF.DRAFTER["sha256"],
        "kept_layers": kept,
        "block_influence": [None if not math.isfinite(x) else round(x, 5) for x in bi] or None,
        "rank": cfg.rank,
        "alpha": cfg.alpha,
        "targets": list(LORA_TARGETS) + ["input_layernorm", "post_attention_layernorm", "norm (whole)"],
        "config": asdict(cfg),
        "data": {
            "file": str(DD.TARGETS_FILE.relative_to(DD.TARGETS_FILE.parents[2])),
            "examples": {k: len(v) for k, v in by_split.items()},
            "target_tokens": TARGET_TOKENS,
        },
        "train": {"best_epoch": best[1], "best_val_loss": best[0], "history": history},
        "stock_heldout": base_eval,
        "stock_heldout_conversations": base_multi,
        "val": val_eval,
        "heldout": ho_eval,
        # held-out conversations (dialogue/training/multi_turn.py): earlier answers in the history
        "heldout_conversations": ho_multi,
        "seconds": round(time.time() - t0),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.to(torch.float16 if "lora_" in k else torch.float32).contiguous() for k, v in best[2].items()},
        str(args.out),
        metadata={"format": f"duplex-drafter-adapter-{DA.FORMAT}"},
    )
    args.out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    print(
        f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB) and {args.out.with_suffix('.json')} "
        f"in {time.time() - t0:.0f}s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
