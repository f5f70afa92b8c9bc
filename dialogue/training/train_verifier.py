"""Train the relay's learned verifier (dialogue/verifier.py) on drafts labelled by the slow model.

    python -m dialogue.training.train_verifier [--limit N] [--out dialogue/weights/verifier.safetensors]

1. Prompts: the user turns of chatterbot_corpus's English conversations (with up to two previous
   utterances as history) and caller requests built from templates below (booking, billing,
   directions, how-to, trivia, small talk, follow-ups with history). User text is normalised like
   the ASR text the engine sees. Plus conversations with earlier answers in the history
   (dialogue/training/multi_turn.py, the drafter's own, built from its answered prompts), each in the split
   of its last prompt.
2. Per prompt (`build_example`): the drafter (SmolLM2-135M, int8) drafts with `verifier.draft`;
   the slow model (the service's Qwen, int8) scores the committed prefix in context
   (`score_prefix`: mean and min token log-prob) and drafts its own first words with the same
   procedure (diagnostics: does the first word match?). Features are cached one file per prompt
   under $DUPLEX_CACHE/verifier_features (default ~/.cache/duplex), so a rerun resumes.
3. Labels, `--labels judge` (the default; dialogue/training/relay_labels.py): acceptable iff committing the
   draft does not cost the answer, by the likelihood judge the relay is evaluated with: the prefix
   plus the slow model's greedy continuation against the slow model's own answer (losing at most
   `relay_labels.MARGIN` nats per token), and the prefix is not empty, another script or markup.
   Each draft's judgement is cached next to its features (~30 min for all, resumable) and written to
   data/dialogue/relay_labels.jsonl, which later runs read first (the shipped verifier's labels).
   `--labels typical` (the first verifier's; `label_examples`, `judge_prefix`): acceptable iff the
   prefix is not empty, not another script, not markup/code and not an echo of the question, and
   either the slow model's own greedy opening or every token passes typical acceptance under the
   slow model (`Acceptance`: Medusa's p >= min(epsilon, delta * exp(-entropy))).
4. Split by conversation / template family (seeded) into train/val/held-out; focal loss + AdamW,
   early stopping on val AUROC, `--restarts` training seeds of which the one whose ranking loses
   least on the validation drafts at the latency point's commit share is kept (with judge labels;
   else the best val AUROC), threshold tuned for macro-F1 on val; held-out metrics go into the
   metadata next to the weights, the held-out prompts into data/dialogue/relay_eval.jsonl.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from dialogue import verifier as V
from dialogue.training import multi_turn as MT
from dialogue.training.relay_features import DRAFTER, DTYPE, FEATURE_VERSION, build_dataset, slow_model_info
from dialogue.training.relay_labels import forced_negative
from dialogue.training.relay_metrics import (
    auroc,
    bootstrap_auroc,
    classify_metrics,
    focal_loss,
    tune_threshold,
)
from dialogue.training.relay_prompts import DATA_SEED, Prompt, all_prompts, is_corpus_debris, split_groups
from duplex.base.paths import DATA_ROOT

DATA_DIR = DATA_ROOT / "dialogue"
EVAL_FILE = DATA_DIR / "relay_eval.jsonl"


# -- prompts -------------------------------------------------------------------------------------------


# -- models and features -------------------------------------------------------------------------------


# -- labels --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Acceptance:
    """Typical acceptance (Medusa, Cai et al. 2024) of a prefix under the slow model.

    Every token x of the prefix must have p(x) >= min(epsilon, delta * exp(-H)) under the slow
    model in context, H being the entropy of its next-token distribution there: where the slow
    model is sure, the prefix must say what it would say; where many continuations are fine
    ("Sure" / "Certainly" / "Of course"), a less likely one passes. A wrong name or number, a word
    the slow model would not use, fails. Medusa's defaults: epsilon 0.09, delta 0.3.
    """

    epsilon: float = 0.09
    delta: float = 0.3

    def accepts(self, logprobs: Sequence[float], entropies: Sequence[float]) -> bool:
        if not logprobs or len(logprobs) != len(entropies):
            return False
        return all(
            lp >= math.log(min(self.epsilon, self.delta * math.exp(-h)))
            for lp, h in zip(logprobs, entropies, strict=True)
        )

    @property
    def rule(self) -> str:
        return (
            "label 1 iff the prefix is non-empty, Latin script, no markup/code, not an echo of the question, "
            "and either the slow model's own greedy opening word for word, or every token passes typical "
            f"acceptance under the slow model: p >= min({self.epsilon}, {self.delta} * exp(-entropy))"
        )


def is_own_opening(prefix: str, slow_opening: str) -> bool:
    """The prefix is, word for word (case and punctuation aside), how the slow model itself begins:
    committing it changes nothing the slow model would have said."""
    pw = V.words(prefix)
    return bool(pw) and V.words(slow_opening)[: len(pw)] == pw


def judge_prefix(ex: Mapping[str, Any], acc: Acceptance) -> str:
    """Why a draft is acceptable ("own", "ok") or not (a forced negative, "atypical").

    Forced negatives first (another script, markup, an echo of the question), whoever wrote them;
    then the slow model's own greedy opening is acceptable by definition; any other prefix must
    pass typical acceptance under the slow model (`Acceptance`)."""
    why = forced_negative(ex)
    if why is not None:
        return why
    if is_own_opening(str(ex["prefix"]), str(ex.get("slow_text", ""))):
        return "own"
    if acc.accepts(ex.get("score_logprobs") or [], ex.get("score_entropies") or []):
        return "ok"
    return "atypical"


def label_examples(examples: Sequence[dict[str, Any]], acc: Acceptance) -> list[int]:
    """1 = acceptable prefix; sets ex['label'] and ex['reason'] too."""
    labels = []
    for ex in examples:
        ex["reason"] = judge_prefix(ex, acc)
        ex["label"] = int(ex["reason"] in ("own", "ok"))
        labels.append(ex["label"])
    return labels


# -- splitting, batching, metrics --------------------------------------------------------------------


def collate(
    examples: Sequence[Mapping[str, Any]], max_len: int = V.MAX_DRAFT_TOKENS
) -> tuple[torch.Tensor, ...]:
    """Pad to [B, max_len, H] / [B, max_len, 3] / mask [B, max_len]."""
    size = int(examples[0]["hidden"].shape[-1])
    b = len(examples)
    hidden = torch.zeros(b, max_len, size)
    stats = torch.zeros(b, max_len, 3)
    mask = torch.zeros(b, max_len)
    for i, ex in enumerate(examples):
        t = min(max_len, int(ex["hidden"].shape[0]))
        hidden[i, :t] = ex["hidden"][:t]
        stats[i, :t] = ex["stats"][:t]
        mask[i, :t] = 1
    return hidden, stats, mask


#: the "latency" operating point commits this share of drafts: the onset P90 is a committed draft's
#: only where at least 90 % of drafts commit. A fixed threshold committing 95 % of the validation
#: drafts commits 88 % of the held-out ones (their scores are lower), so the engine keeps the share
#: (`verifier.RollingThreshold`, seeded with the validation scores) rather than the number. Over the
#: 369 held-out prompts a 400-draft window was still half validation scores at the end (90 %
#: committed); 200 drafts adapt within the run (93 %), as does any window once it has seen traffic.
LATENCY_COMMIT = 0.95
LATENCY_WINDOW = 200


def predict(model: V.Verifier, data: tuple[torch.Tensor, ...], batch: int = 512) -> torch.Tensor:
    """P(acceptable) for padded (hidden, stats, mask)."""
    model.eval()
    out = []
    with torch.inference_mode():
        for i in range(0, data[0].shape[0], batch):
            out.append(model(*(t[i : i + batch] for t in data)))
    return torch.cat(out) if out else torch.zeros(0)


@dataclass
class TrainConfig:
    """Optimiser and early-stopping settings."""

    dim: int = 128
    head_dim: int = 64
    dropout: float = 0.2
    lr: float = 2e-3
    weight_decay: float = 0.05
    batch: int = 64
    epochs: int = 300
    patience: int = 40
    gamma: float = 2.0
    alpha: float | None = None  # None: the negative rate of the training set (balances the classes)
    seed: int = 0


def train_verifier(
    train: tuple[torch.Tensor, ...],
    y_train: torch.Tensor,
    val: tuple[torch.Tensor, ...],
    y_val: torch.Tensor,
    cfg: TrainConfig | None = None,
    progress: bool = False,
) -> tuple[V.Verifier, dict[str, Any]]:
    """Focal loss + AdamW, keep the epoch with the best val AUROC (early stop after `patience`)."""
    from tqdm import tqdm

    cfg = cfg or TrainConfig()
    torch.manual_seed(cfg.seed)
    model = V.Verifier(int(train[0].shape[-1]), dim=cfg.dim, head_dim=cfg.head_dim, dropout=cfg.dropout)
    model.set_stats_norm(train[1], train[2])
    y_train = y_train.float()
    alpha = cfg.alpha if cfg.alpha is not None else float(1 - y_train.mean())
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs, eta_min=cfg.lr / 20)
    gen = torch.Generator().manual_seed(cfg.seed)
    best = (-1.0, 0, copy.deepcopy(model.state_dict()))
    history = []
    n = train[0].shape[0]
    bar = tqdm(range(cfg.epochs), desc="training", disable=not progress)
    for epoch in bar:
        model.train()
        perm = torch.randperm(n, generator=gen)
        total = 0.0
        for i in range(0, n, cfg.batch):
            idx = perm[i : i + cfg.batch]
            loss = focal_loss(model.logits(*(t[idx] for t in train)), y_train[idx], alpha, cfg.gamma)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        sched.step()
        val_auc = auroc(predict(model, val), y_val)
        history.append({"epoch": epoch, "loss": total / n, "val_auroc": val_auc})
        if val_auc > best[0]:
            best = (val_auc, epoch, copy.deepcopy(model.state_dict()))
        bar.set_postfix(loss=f"{total / n:.4f}", val_auroc=f"{val_auc:.3f}", best=f"{best[0]:.3f}")
        if epoch - best[1] >= cfg.patience:
            break
    model.load_state_dict(best[2])
    model.eval()
    return model, {
        "best_epoch": best[1],
        "best_val_auroc": best[0],
        "epochs_run": len(history),
        "alpha": alpha,
        "history": history,
    }


# -- main --------------------------------------------------------------------------------------------


def _show(ex: Mapping[str, Any]) -> str:
    hist = " | ".join(f"{r[0]}: {c[:40]}" for r, c in ex["history"])
    return (
        f"[{ex['reason']}] {hist + ' || ' if hist else ''}user: {ex['text'][:70]!r} -> "
        f"draft {ex['prefix']!r} (mean {ex['score_mean']:.2f}, min {ex['score_min']:.2f}); "
        f"slow: {ex['slow_prefix']!r}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Build (or resume) the features, label, split, train, evaluate and write weights + metadata."""
    ap = argparse.ArgumentParser(
        prog="python -m dialogue.training.train_verifier", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--limit", type=int, default=None, help="use a seeded sample of N prompts")
    ap.add_argument(
        "--out", type=Path, default=V.DEFAULT_WEIGHTS, help="weights path (.safetensors; .json beside)"
    )
    ap.add_argument(
        "--eval-out", type=Path, default=EVAL_FILE, help="held-out prompts for the relay benchmark"
    )
    ap.add_argument("--seed", type=int, default=0, help="split and training seed (the prompts stay the same)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the CPU is shared)")
    ap.add_argument(
        "--epsilon", type=float, default=Acceptance.epsilon, help="typical acceptance: p >= min(eps, ...)"
    )
    ap.add_argument(
        "--delta", type=float, default=Acceptance.delta, help="typical acceptance: ... delta * exp(-H))"
    )
    ap.add_argument(
        "--adapter",
        default="shipped",
        help="drafter adapter the verifier reads: shipped (dialogue/weights), a path, or none",
    )
    ap.add_argument(
        "--keep-weights",
        action="store_true",
        help="do not train: score the splits with the verifier at --out and rewrite its metadata "
        "(thresholds, operating points) only",
    )
    ap.add_argument(
        "--no-conversations",
        action="store_true",
        help="single user turns only (no dialogue/training/multi_turn.py conversations)",
    )
    ap.add_argument(
        "--labels",
        choices=("judge", "typical"),
        default="judge",
        help="judge: does committing the draft lose answer quality by the likelihood judge "
        "(dialogue/training/relay_labels.py); typical: typical acceptance of the draft's words",
    )
    ap.add_argument(
        "--labels-out",
        type=Path,
        default=None,
        help="judge labels: where every draft's judge result is written (default: the shipped "
        "data/dialogue/relay_labels.jsonl, read before the cache; not written with --limit)",
    )
    ap.add_argument(
        "--margin",
        type=float,
        default=None,
        help="judge labels: the per-token PMI a committed draft may lose and stay acceptable",
    )
    ap.add_argument(
        "--restarts",
        type=int,
        default=3,
        help="train this many times (training seeds seed, seed+1, ...) and keep the best on validation: "
        "by the judge's loss at the latency point with judge labels, else by AUROC",
    )
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from dialogue.drafter_adapter import adapter_path, adapter_sha256

    adapter = adapter_path(args.adapter)
    progress = not args.no_progress
    t0 = time.time()

    prompts = all_prompts(DATA_SEED, args.limit)
    n_single = len(prompts)
    # conversations with earlier answers in the history (dialogue/training/multi_turn.py), in the split of
    # their last prompt: the drafter's failure in long sessions is there, so the verifier learns it
    multi = [] if args.limit or args.no_conversations else _conversations()
    prompts = prompts + [p for p, _ in multi]
    by_source: dict[str, int] = {}
    for p in prompts:
        key = p.source.split("/")[0]
        by_source[key] = by_source.get(key, 0) + 1
    print(f"prompts: {len(prompts)} {by_source}", file=sys.stderr)
    examples = build_dataset(prompts, progress=progress, adapter=adapter)
    build_s = time.time() - t0

    acc = Acceptance(args.epsilon, args.delta)
    labels = label_examples(examples, acc)
    label_rule = acc.rule
    if args.labels == "judge":
        from dialogue.training import relay_labels as RL

        margin = RL.MARGIN if args.margin is None else args.margin
        results = RL.judge_dataset(examples, [Path(ex["feature_file"]) for ex in examples], progress)
        labels = RL.label_examples(examples, results, margin)
        labels_out = args.labels_out or (None if args.limit else RL.SHIPPED)
        if labels_out is not None:
            RL.write_shipped(examples, results, labels_out)
        label_rule = RL.rule(margin)
    reasons: dict[str, int] = {}
    for ex in examples:
        reasons[ex["reason"]] = reasons.get(ex["reason"], 0) + 1
    usable = [i for i, ex in enumerate(examples) if ex["hidden"].shape[0] > 0]
    print(f"labels: {label_rule}", file=sys.stderr)
    print(
        f"labels: {sum(labels)}/{len(labels)} positive ({sum(labels) / len(labels):.1%}); {reasons}; "
        f"{len(examples) - len(usable)} with no drafted token are left out",
        file=sys.stderr,
    )

    splits = split_groups(examples[:n_single], args.seed)
    for j, (_, split) in enumerate(multi):
        splits[split].append(n_single + j)
    usable_set = set(usable)
    sets = {k: [i for i in v if i in usable_set] for k, v in splits.items()}
    tensors = {k: collate([examples[i] for i in v]) for k, v in sets.items()}
    ys = {k: torch.tensor([labels[i] for i in v]) for k, v in sets.items()}
    for k in sets:
        print(
            f"{k}: {len(sets[k])} examples, {int(ys[k].sum())} positive, "
            f"{len({examples[i]['group'] for i in sets[k]})} groups",
            file=sys.stderr,
        )

    cfg = TrainConfig(seed=args.seed)
    if args.keep_weights:
        model, _, old = V.load_verifier(args.out)
        info = dict(old.get("train") or {})
        cfg = TrainConfig(
            **{
                k: v
                for k, v in (info.pop("config", None) or {}).items()
                if k in TrainConfig.__dataclass_fields__
            }
        )
    else:
        runs = []
        for k in range(max(1, args.restarts)):
            cfg_k = TrainConfig(seed=args.seed + k)
            model_k, info_k = train_verifier(
                tensors["train"], ys["train"], tensors["val"], ys["val"], cfg_k, progress
            )
            p_k = predict(model_k, tensors["val"])
            if args.labels == "judge":
                # what the relay loses on the validation drafts when it commits the share the latency
                # point commits, the drafts taken in the order of this run's scores (lower is better)
                info_k["val_relay_loss"] = RL.relay_loss(
                    p_k.tolist(), [examples[i]["loss"] for i in sets["val"]], LATENCY_COMMIT
                )
                crit = -info_k["val_relay_loss"]
            else:
                crit = float(info_k["best_val_auroc"])
            print(
                f"training run {k + 1}/{args.restarts} (seed {cfg_k.seed}): val AUROC "
                f"{info_k['best_val_auroc']:.3f}"
                + (f", val relay loss {info_k['val_relay_loss']:.4f}" if "val_relay_loss" in info_k else ""),
                file=sys.stderr,
            )
            runs.append((crit, k, model_k, info_k, cfg_k))
        _, _, model, info, cfg = max(runs, key=lambda r: (r[0], -r[1]))
        info["restarts"] = [
            {"seed": c.seed, "best_val_auroc": i["best_val_auroc"], "val_relay_loss": i.get("val_relay_loss")}
            for _, _, _, i, c in runs
        ]
    p_val = predict(model, tensors["val"])
    thr = tune_threshold(p_val, ys["val"])
    thr_latency = V.commit_threshold(p_val, LATENCY_COMMIT)
    p_ho = predict(model, tensors["heldout"])
    ho = classify_metrics(p_ho, ys["heldout"], thr)
    ho["auroc"] = auroc(p_ho, ys["heldout"])
    ho["auroc_ci95"] = bootstrap_auroc(p_ho, ys["heldout"], seed=args.seed)
    val = classify_metrics(p_val, ys["val"], thr)
    val["auroc"] = auroc(p_val, ys["val"])
    # the cheap rules a learned verifier has to beat: the drafter's own confidence
    base = {}
    for name, col, fn in (("mean_logprob", 1, "mean"), ("min_logprob", 1, "min"), ("min_margin", 2, "min")):
        vals = []
        for i in sets["heldout"]:
            x = examples[i]["stats"][:, col]
            vals.append(float(x.mean() if fn == "mean" else x.min()))
        base[f"drafter_{name}_auroc"] = auroc(vals, ys["heldout"])
    ho_idx = sets["heldout"]
    fw = [examples[i]["first_word_match"] for i in ho_idx]
    ho["first_word_match_rate"] = sum(fw) / len(fw) if fw else float("nan")
    committed = [i for i, pp in zip(ho_idx, p_ho.tolist(), strict=True) if pp >= thr]
    ho["first_word_match_committed"] = (
        sum(examples[i]["first_word_match"] for i in committed) / len(committed)
        if committed
        else float("nan")
    )
    ho["baselines"] = base
    # other operating points, for an engine that wants fewer but safer commits
    ho["operating_points"] = [
        {"threshold": t}
        | {
            k: v
            for k, v in classify_metrics(p_ho, ys["heldout"], t).items()
            if k in ("commit_fraction", "committed", "precision_committed", "macro_f1")
        }
        for t in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    ]
    ho["latency"] = classify_metrics(p_ho, ys["heldout"], thr_latency)
    conv = [k for k, i in enumerate(ho_idx) if examples[i]["source"] == MT.SOURCE]
    if conv:
        p_conv, y_conv = p_ho[conv], ys["heldout"][conv]
        ho["conversations"] = classify_metrics(p_conv, y_conv, thr) | {
            "auroc": auroc(p_conv, y_conv),
            "latency": classify_metrics(p_conv, y_conv, thr_latency),
        }

    n_params = sum(p.numel() for p in model.parameters())
    seconds = [float(ex["seconds"]) for ex in examples]
    meta = {
        "format": 1,
        "threshold": thr,
        # named operating points (models.yaml drafter.verifier_threshold); "balanced" is `threshold`
        "thresholds": {"latency": thr_latency},
        "threshold_rules": {
            "balanced": "macro-F1 on the validation drafts",
            "latency": f"commits {LATENCY_COMMIT:.0%} of the latest {LATENCY_WINDOW} drafts "
            f"(rolling; seeded with the validation drafts' scores, where it starts at "
            f"the number given)",
        },
        "rolling": {
            "latency": {
                "commit": LATENCY_COMMIT,
                "window": LATENCY_WINDOW,
                "prior": [round(float(x), 5) for x in p_val.tolist()],
            }
        },
        "hidden_size": model.hidden_size,
        "dim": model.dim,
        "head_dim": cfg.head_dim,
        "params": n_params,
        "drafter": {k: DRAFTER[k] for k in ("name", "package", "file", "version", "sha256")}
        | {
            "dtype": DTYPE,
            "adapter_sha256": adapter_sha256(adapter),
            "adapter": None if adapter is None else adapter.name,
        },
        "slow_model": slow_model_info(),
        "draft_rule": {
            "max_words": V.MAX_DRAFT_WORDS,
            "max_tokens": V.MAX_DRAFT_TOKENS,
            "stop": "EOS/<|im_end|>, >= max_words complete words, sentence end (. ! ?), max_tokens",
            "prefix": "cut back to the last complete word (closing punctuation kept)",
        },
        "label_rule": label_rule,
        "labels": args.labels,
        "acceptance": {"epsilon": acc.epsilon, "delta": acc.delta},
        "judge_labels": (
            {"margin": margin, "answer_tokens": RL.LABEL_TOKENS, "version": RL.LABEL_VERSION}
            if args.labels == "judge"
            else None
        ),
        "data": {
            "prompts": len(prompts),
            "sources": by_source,
            "examples_with_draft": len(usable),
            "positive_rate": sum(labels) / len(labels),
            "reasons": reasons,
            "splits": {k: {"n": len(v), "positives": int(ys[k].sum())} for k, v in sets.items()},
            "first_word_match_rate": sum(ex["first_word_match"] for ex in examples) / len(examples),
            "feature_seconds_mean": sum(seconds) / len(seconds),
        },
        "train": {k: v for k, v in info.items() if k != "history"} | {"config": asdict(cfg)},
        "val": val,
        "heldout": ho,
        "seed": args.seed,
        "feature_version": FEATURE_VERSION,
    }
    save(model, meta, args.out)
    write_eval(examples, splits["heldout"], args.eval_out)

    rng = random.Random(args.seed)
    for lab in (1, 0):
        pool = [ex for ex in examples if ex["label"] == lab]
        print(f"\n-- label {lab}: 10 of {len(pool)}", file=sys.stderr)
        for ex in rng.sample(pool, min(10, len(pool))):
            print("  " + _show(ex), file=sys.stderr)
    print(f"\nheld-out: {json.dumps(ho, indent=1)}", file=sys.stderr)
    print(
        f"threshold {thr:.3f}; val AUROC {val['auroc']:.3f}; params {n_params}; "
        f"features {build_s:.0f}s, total {time.time() - t0:.0f}s; wrote {args.out} and {args.eval_out}",
        file=sys.stderr,
    )
    return 0


def _conversations() -> list[tuple[Prompt, str]]:
    """The drafter's conversations (the same ones, made from its answered prompts), with their split."""
    from dialogue.training import drafter_data as DD

    return [(dp.prompt, dp.split) for dp in DD.multi_turn_prompts()]


def save(model: V.Verifier, meta: Mapping[str, Any], out: Path) -> None:
    """Write X.safetensors and X.json (metadata: threshold, label rule, metrics)."""
    from safetensors.torch import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        str(out),
        metadata={"format": "duplex-relay-verifier-1"},
    )
    out.with_suffix(".json").write_text(json.dumps(_finite(meta), indent=1) + "\n")


def _finite(x: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, Mapping):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def write_eval(examples: Sequence[Mapping[str, Any]], idx: Iterable[int], out: Path) -> None:
    """Held-out prompts (history, text) for the relay-vs-slow quality benchmark, one JSON per line
    (corpus debris left out, `is_corpus_debris`)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for i in idx:
            ex = examples[i]
            if is_corpus_debris(ex["history"], ex["text"]):
                continue
            hist = [{"role": r, "content": c} for r, c in ex["history"]]
            f.write(
                json.dumps(
                    {
                        "history": hist,
                        "text": ex["text"],
                        "group": ex["group"],
                        "source": ex["source"],
                        "label": ex["label"],
                    }
                )
                + "\n"
            )


if __name__ == "__main__":
    raise SystemExit(main())
