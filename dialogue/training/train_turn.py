"""Train the turn-taking heads (dialogue/turn_taking.py) on the drafter's hidden states.

    python -m dialogue.training.train_turn [--out dialogue/weights/turn_heads.safetensors] [--limit N] [--epochs E]

1. builds the labelled examples (dialogue/training/turn_data.py; writes the held-out set to
   data/dialogue/turn_eval.jsonl),
2. runs the int8 drafter on each example's exact engine input (`render_user_prefix`) and keeps the
   last hidden state; features are cached per example under $DUPLEX_CACHE/turn_features (default
   ~/.cache/duplex), keyed by a hash of the drafter, the system prompt and the token ids, so a
   rerun (or a rerun on grown data) only computes what is new,
3. trains both heads (AdamW, class-balanced loss, feature noise, early stopping on validation),
4. tunes the thresholds on validation: speak_threshold is the lowest one that takes over at most
   8 % of the mid-sentence pauses (LISTEN examples), so complete turns are answered as often as
   that allows; backchannel_threshold maximises F1 of "mm-hmm" decisions; interrupt_threshold the
   balanced accuracy of the overlap head,
5. reports held-out metrics (also with the engine's slice-by-slice prefill) and writes the weights
   and their metadata.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import hashlib
import json
import math
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dialogue.llm_weights import cache_root
from dialogue.training import turn_data as D
from dialogue.training.turn_data import HEARD_FILE, HEARD_KIND, is_heard
from dialogue.turn_taking import (
    BACKCHANNEL,
    DEFAULT_WEIGHTS,
    LABELS,
    LISTEN,
    METADATA_FORMAT,
    SPEAK,
    TurnHeads,
    TurnPolicy,
    render_user_prefix,
)

DTYPE = "int8-dynamic"  # what the engine runs: features must come from the same arithmetic
#: bump when the feature procedure changes, so cached features are recomputed
FEATURE_VERSION = 1
#: a LISTEN pause may be taken over this often on validation (the held-out target is 10 %)
MAX_VAL_TAKEOVER = 0.08
#: SPEAK recall given up (at most) on validation to take over fewer story pauses (BACKCHANNEL)
RECALL_SLACK = 0.02
#: tokens per slice when emulating the engine's incremental prefill (about one ASR partial)
ENGINE_SLICE_TOKENS = 3


def system_prompt() -> str:
    """The system prompt the engine renders (the `llm` component's, stripped)."""
    from duplex.base.config import load_profile

    return str(load_profile().component("llm").options["system_prompt"]).strip()


# -- features ------------------------------------------------------------------------------------


def hidden_state(model: Any, ids: Sequence[int]) -> torch.Tensor:
    """The drafter's last hidden state (after the final norm) for one whole prompt, float32 [H]."""
    from dialogue.fast_decoder import decoder_hidden

    with torch.inference_mode():
        return decoder_hidden(model, ids)[0, -1].float().clone()


def sliced_hidden_state(
    model: Any, ids: Sequence[int], open_from: int, slice_tokens: int = ENGINE_SLICE_TOKENS
) -> torch.Tensor:
    """Like the engine: everything before the user's words prefilled at once, then their tokens a
    few at a time into the KV cache. int8 activations are quantised per call, so this differs a
    little from `hidden_state`; the heads must not care."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = list(ids)
    cuts = [min(open_from, len(ids) - 1)]
    while cuts[-1] + slice_tokens < len(ids):
        cuts.append(cuts[-1] + slice_tokens)
    cuts.append(len(ids))
    from dialogue.fast_decoder import decoder_hidden

    out = None
    with torch.inference_mode():
        start = 0
        for end in cuts:
            if end > start:
                out = decoder_hidden(model, ids[start:end], cache)
                start = end
    assert out is not None
    return out[0, -1].float().clone()


def features_dir() -> Path:
    """$DUPLEX_CACHE/turn_features (default ~/.cache/duplex/turn_features)."""
    return cache_root() / "turn_features"


class FeatureStore:
    """Hidden states on disk, one key per (drafter, system prompt, token ids, procedure).

    New features are appended in small safetensors shards written by atomic rename, so an
    interrupted extraction keeps what it finished and a rerun resumes where it stopped.
    """

    def __init__(self, root: Path, drafter_sha: str, shard_size: int = 256) -> None:
        from safetensors.torch import load_file

        self.dir = root / f"{D.DRAFTER['name']}-{drafter_sha[:12]}-{DTYPE}-v{FEATURE_VERSION}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.shard_size = shard_size
        self.tag = f"{FEATURE_VERSION}:{drafter_sha}:{DTYPE}"
        self.mem: dict[str, torch.Tensor] = {}
        #: features read from disk / computed in this process (for the log and the metadata)
        self.hits = self.misses = 0
        self.pending: dict[str, torch.Tensor] = {}
        for shard in sorted(self.dir.glob("shard-*.safetensors")):
            try:
                keys = json.loads(shard.with_suffix(".json").read_text())
                data = load_file(str(shard))["h"]
            except (OSError, ValueError, KeyError):
                continue  # a damaged shard is recomputed
            if len(keys) == data.shape[0]:
                self.mem.update(zip(keys, data, strict=True))

    def key(self, ids: Sequence[int], procedure: str = "full") -> str:
        """Hash of everything the feature depends on."""
        raw = json.dumps([self.tag, procedure, list(ids)]).encode()
        return hashlib.sha256(raw).hexdigest()[:32]

    def get(self, key: str) -> torch.Tensor | None:
        h = self.mem.get(key)
        if h is None:
            self.misses += 1
        else:
            self.hits += 1
        return h

    def put(self, key: str, h: torch.Tensor) -> None:
        self.mem[key] = h
        self.pending[key] = h
        if len(self.pending) >= self.shard_size:
            self.flush()

    def flush(self) -> None:
        """Write the pending features as one shard (keys JSON first, tensor last: the marker)."""
        from safetensors.torch import save_file

        if not self.pending:
            return
        name = f"shard-{time.time_ns():020d}"
        keys = list(self.pending)
        (self.dir / f"{name}.json").write_text(json.dumps(keys))
        tmp = self.dir / f".{name}.tmp"
        save_file({"h": torch.stack([self.pending[k] for k in keys]).contiguous()}, str(tmp))
        tmp.replace(self.dir / f"{name}.safetensors")
        self.pending = {}


def extract_features(
    model: Any,
    tok: Any,
    examples: Sequence[Mapping[str, Any]],
    system: str,
    store: FeatureStore | None = None,
    procedure: str = "full",
    progress: bool = True,
    desc: str = "drafter hidden states",
) -> torch.Tensor:
    """[N, H] hidden states of the examples' engine inputs (overlap examples: no history)."""
    from tqdm.auto import tqdm

    rows: list[torch.Tensor] = []
    try:
        for ex in tqdm(examples, desc=desc, disable=not progress, unit="ex", smoothing=0.05):
            hist = list(ex["history"]) if ex["head"] == "turn" else []
            ids = render_user_prefix(tok, system, hist, str(ex["text"]))
            key = store.key(ids, procedure) if store is not None else ""
            h = store.get(key) if store is not None else None
            if h is None:
                if procedure == "full":
                    h = hidden_state(model, ids)
                else:
                    open_from = len(render_user_prefix(tok, system, hist, ""))
                    h = sliced_hidden_state(model, ids, open_from)
                if store is not None:
                    store.put(key, h)
            rows.append(h)
    finally:
        if store is not None:
            store.flush()
    return torch.stack(rows) if rows else torch.zeros(0, int(model.config.hidden_size))


# -- training --------------------------------------------------------------------------------------


@dataclass
class TrainConfig:
    """Hyper-parameters of both heads (the same for each)."""

    epochs: int = 80
    lr: float = 2e-3
    weight_decay: float = 0.05
    batch: int = 128
    patience: int = 10
    #: Gaussian noise on the features, relative to their RMS: the engine's sliced int8 prefill
    #: moves the hidden state by about 10 % of its norm, so the heads are trained to ignore that
    noise: float = 0.10
    dim: int = 64
    dropout: float = 0.1
    seed: int = 0


def class_weights(y: torch.Tensor, n_classes: int) -> torch.Tensor:
    """N / (K * count_k): each class weighs as much as the others in the loss."""
    counts = torch.bincount(y, minlength=n_classes).float().clamp(min=1)
    return counts.sum() / (n_classes * counts)


def _fit(
    module: nn.Module,
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    xv: torch.Tensor,
    yv: torch.Tensor,
    cfg: TrainConfig,
    name: str,
    progress: bool,
) -> dict[str, Any]:
    """AdamW with early stopping on the validation loss; `module` ends with its best weights."""
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(module.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, cfg.epochs))
    best, best_state, best_epoch, history = math.inf, copy.deepcopy(module.state_dict()), 0, []
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    for epoch in range(1, cfg.epochs + 1):
        module.train()
        perm = torch.randperm(len(x), generator=gen)
        total = 0.0
        for b in range(0, len(x), cfg.batch):
            idx = perm[b : b + cfg.batch]
            xb = x[idx] + cfg.noise * rms[idx] * torch.randn(len(idx), x.shape[1], generator=gen)
            loss = loss_fn(logits_fn(xb), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        sched.step()
        module.eval()
        with torch.no_grad():
            val = float(loss_fn(logits_fn(xv), yv))
        history.append((total / len(x), val))
        if val < best - 1e-4:
            best, best_state, best_epoch = val, copy.deepcopy(module.state_dict()), epoch
        elif epoch - best_epoch >= cfg.patience:
            break
    module.load_state_dict(best_state)
    module.eval()
    if progress:
        print(
            f"{name} head: best validation loss {best:.4f} at epoch {best_epoch}/{len(history)}",
            file=sys.stderr,
        )
    return {
        "best_epoch": best_epoch,
        "epochs_run": len(history),
        "val_loss": best,
        "train_loss": history[best_epoch - 1][0],
    }


def train_heads(
    feats: Mapping[str, torch.Tensor], ys: Mapping[str, torch.Tensor], cfg: TrainConfig, progress: bool = True
) -> tuple[TurnHeads, dict[str, Any]]:
    """Both heads: feats/ys are keyed "turn:train", "turn:val", "overlap:train", "overlap:val"."""
    torch.manual_seed(cfg.seed)
    hidden = int(next(iter(feats.values())).shape[1])
    heads = TurnHeads(hidden, dim=cfg.dim, dropout=cfg.dropout)
    info: dict[str, Any] = {}
    wt = class_weights(ys["turn:train"], 3)
    ce = nn.CrossEntropyLoss(weight=wt)
    info["turn"] = _fit(
        heads.turn_mlp,
        heads.turn_logits,
        ce,
        feats["turn:train"],
        ys["turn:train"],
        feats["turn:val"],
        ys["turn:val"],
        cfg,
        "turn",
        progress,
    )
    wo = class_weights(ys["overlap:train"], 2)

    def bce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        w = wo[y]
        return (
            w * nn.functional.binary_cross_entropy_with_logits(logits, y.float(), reduction="none")
        ).sum() / w.sum()

    info["overlap"] = _fit(
        heads.overlap_mlp,
        heads.overlap_logits,
        bce,
        feats["overlap:train"],
        ys["overlap:train"],
        feats["overlap:val"],
        ys["overlap:val"],
        cfg,
        "overlap",
        progress,
    )
    info["class_weights"] = {
        "turn": [round(float(v), 4) for v in wt],
        "overlap": [round(float(v), 4) for v in wo],
    }
    return heads, info


# -- thresholds and metrics ------------------------------------------------------------------------

_GRID = [round(0.01 * i, 2) for i in range(1, 100)] + [0.995, 0.999]


def tune_speak_threshold(
    probs: torch.Tensor,
    y: torch.Tensor,
    max_takeover: float = MAX_VAL_TAKEOVER,
    recall_slack: float = RECALL_SLACK,
) -> float:
    """P(speak) threshold: complete turns (SPEAK) answered as often as possible while at most
    `max_takeover` of the mid-sentence pauses (LISTEN) are taken over.

    The lowest threshold meeting the LISTEN constraint has the highest SPEAK recall; of the
    thresholds within `recall_slack` of that recall the highest is taken, because the last points
    of recall are bought by answering in the middle of stories (BACKCHANNEL pauses).
    """
    ps = probs[:, SPEAK]
    grid = sorted(set(_GRID) | {round(0.001 * i, 3) for i in range(1, 1000)})
    ok = [t for t in grid if float((ps[y == LISTEN] >= t).float().mean()) <= max_takeover]
    if not ok or not int((y == SPEAK).sum()):
        return grid[-1]
    recall = {t: float((ps[y == SPEAK] >= t).float().mean()) for t in ok}
    best = recall[ok[0]]
    return float(max(t for t in ok if recall[t] >= best - recall_slack))


def tune_take_threshold(
    probs: torch.Tensor, y: torch.Tensor, max_takeover: float = MAX_VAL_TAKEOVER
) -> float:
    """P(not listen) threshold of the take rule (`TurnPolicy.take_threshold`): the lowest, so the most
    complete turns and story pauses are taken, with at most `max_takeover` of the validation
    mid-sentence pauses (LISTEN) taken, as speech or as "mm-hmm": both end the user's turn."""
    take = 1.0 - probs[:, LISTEN]
    grid = sorted({round(0.005 * i, 3) for i in range(1, 200)})
    ok = [t for t in grid if float((take[y == LISTEN] >= t).float().mean()) <= max_takeover]
    return float(ok[0]) if ok else grid[-1]


def decide_turns(probs: torch.Tensor, policy: TurnPolicy) -> torch.Tensor:
    """The session core's rule on a batch of turn-head outputs."""
    return torch.tensor([policy.decide_turn(p) for p in probs.tolist()], dtype=torch.long)


def tune_backchannel_threshold(
    probs: torch.Tensor, y: torch.Tensor, speak_threshold: float, tolerance: float = 0.005
) -> float:
    """P(backchannel) threshold with the best F1 of "mm-hmm" decisions (given speak_threshold).

    F1 is often flat over a wide range (the session rule also wants p_bc >= p_listen); among the
    thresholds within `tolerance` of the best F1 the one closest to 0.5 is taken, away from the
    edges where a small shift of the hidden states would flip many decisions.
    """
    f1s = {}
    for t in _GRID:
        d = decide_turns(probs, TurnPolicy(speak_threshold, t, 0.5))
        tp = int(((d == BACKCHANNEL) & (y == BACKCHANNEL)).sum())
        fp = int(((d == BACKCHANNEL) & (y != BACKCHANNEL)).sum())
        fn = int(((d != BACKCHANNEL) & (y == BACKCHANNEL)).sum())
        f1s[t] = 2 * tp / max(1, 2 * tp + fp + fn)
    best = max(f1s.values())
    return float(min((t for t, f in f1s.items() if f >= best - tolerance), key=lambda t: abs(t - 0.5)))


def tune_interrupt_threshold(p: torch.Tensor, y: torch.Tensor) -> float:
    """P(interruption) threshold with the best balanced accuracy (ties: closest to 0.5)."""
    best, best_t = -1.0, 0.5
    for t in sorted(_GRID, key=lambda v: abs(v - 0.5)):
        d = p >= t
        bal = 0.5 * (float(d[y == 1].float().mean()) + float((~d[y == 0]).float().mean()))
        if bal > best + 1e-9:
            best, best_t = bal, t
    return float(best_t)


def _rate(mask: torch.Tensor, of: torch.Tensor) -> dict[str, Any]:
    n = int(of.sum())
    k = int((mask & of).sum())
    return {"rate": round(k / n, 4) if n else None, "k": k, "n": n}


def turn_metrics(
    probs: torch.Tensor,
    y: torch.Tensor,
    policy: TurnPolicy,
    sources: Sequence[str] | None = None,
    kinds: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Takeover rates, the 3-class confusion matrix (rows: label, columns: decision) and counts;
    by source, and typed text vs the ASR's transcripts of it (`kinds` ending "+heard") apart.
    `pause_answered` counts a "mm-hmm" at a mid-sentence pause too (the session answers after
    `backchannel_turn_silence_ms` there), as `duplex eval dialogue` does."""
    d = decide_turns(probs, policy)
    conf = [[int(((y == i) & (d == j)).sum()) for j in range(3)] for i in range(3)]
    out: dict[str, Any] = {
        "pause_takeover": _rate(d == SPEAK, y == LISTEN),
        "complete_takeover": _rate(d == SPEAK, y == SPEAK),
        # the turn taken as speech or as "mm-hmm" (the session answers after a longer silence then):
        # what `duplex eval dialogue` counts
        "pause_answered": _rate(d != LISTEN, y == LISTEN),
        "complete_answered": _rate(d != LISTEN, y == SPEAK),
        "backchannel_recall": _rate(d == BACKCHANNEL, y == BACKCHANNEL),
        "backchannel_takeover": _rate(d == SPEAK, y == BACKCHANNEL),
        "listen_backchanneled": _rate(d == BACKCHANNEL, y == LISTEN),
        "accuracy": round(float((d == y).float().mean()), 4) if len(y) else None,
        "confusion": {"labels": list(LABELS), "rows_label_cols_decision": conf},
        "n": {LABELS[i]: int((y == i).sum()) for i in range(3)},
    }
    if len(y) and int((y == LISTEN).sum()) and int((y == SPEAK).sum()):
        keep = (y == LISTEN) | (y == SPEAK)
        out["speak_vs_listen_auroc"] = round(auroc(probs[keep, SPEAK], (y[keep] == SPEAK).long()), 4)
    if kinds is not None and any(k.endswith(HEARD_KIND) for k in kinds):
        heard = torch.tensor([k.endswith(HEARD_KIND) for k in kinds])
        out["by_form"] = {
            form: {
                "pause_takeover": _rate(d == SPEAK, (y == LISTEN) & m),
                "pause_answered": _rate(d != LISTEN, (y == LISTEN) & m),
                "complete_takeover": _rate(d == SPEAK, (y == SPEAK) & m),
            }
            for form, m in (("typed", ~heard), ("heard", heard))
        }
    if sources is not None:
        by: dict[str, Any] = {}
        for src in sorted({s.split("/")[0] for s in sources}):
            m = torch.tensor([s.split("/")[0] == src for s in sources])
            by[src] = {
                "pause_takeover": _rate(d == SPEAK, (y == LISTEN) & m),
                "complete_takeover": _rate(d == SPEAK, (y == SPEAK) & m),
            }
        out["by_source"] = by
    return out


def overlap_metrics(p: torch.Tensor, y: torch.Tensor, policy: TurnPolicy) -> dict[str, Any]:
    """Accuracy of backchannel vs interruption, per class too."""
    d = (p >= policy.interrupt_threshold).long()
    return {
        "accuracy": round(float((d == y).float().mean()), 4) if len(y) else None,
        "backchannel_kept_talking": _rate(d == 0, y == 0),
        "interruption_stopped": _rate(d == 1, y == 1),
        "auroc": round(auroc(p, y), 4) if len(y) else None,
        "n": {"backchannel": int((y == 0).sum()), "interruption": int((y == 1).sum())},
    }


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney with average ranks); nan with a single class."""
    s = scores.double().reshape(-1)
    y = labels.reshape(-1).bool()
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = torch.argsort(s)
    ranks = torch.empty_like(s)
    ranks[order] = torch.arange(1, len(s) + 1, dtype=torch.float64)
    for v in torch.unique(s):  # ties share their average rank
        m = s == v
        if int(m.sum()) > 1:
            ranks[m] = ranks[m].mean()
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def metrics_from_features(
    heads: TurnHeads, policy: TurnPolicy, examples: Sequence[Mapping[str, Any]], feats: torch.Tensor
) -> dict[str, Any]:
    """Metrics of both heads on examples whose hidden states are already computed."""
    out: dict[str, Any] = {}
    with torch.no_grad():
        for head in ("turn", "overlap"):
            idx = [i for i, ex in enumerate(examples) if ex["head"] == head]
            if not idx:
                continue
            x = feats[idx]
            y = torch.tensor([int(examples[i]["label"]) for i in idx], dtype=torch.long)
            if head == "turn":
                out["turn"] = turn_metrics(
                    heads.turn(x),
                    y,
                    policy,
                    [str(examples[i]["source"]) for i in idx],
                    [str(examples[i].get("kind", "")) for i in idx],
                )
            else:
                out["overlap"] = overlap_metrics(heads.overlap(x), y, policy)
    return out


def evaluate_turn_heads(
    model: Any,
    tok: Any,
    heads: TurnHeads,
    policy: TurnPolicy,
    examples: Sequence[Mapping[str, Any]],
    *,
    system: str | None = None,
    procedure: str = "full",
    store: FeatureStore | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Held-out style metrics of the heads on labelled examples (e.g. data/dialogue/turn_eval.jsonl).

    `procedure` "full" runs each prompt in one forward (the training input); "sliced" prefills the
    user's words a few tokens at a time like the engine does.
    """
    feats = extract_features(
        model,
        tok,
        examples,
        system if system is not None else system_prompt(),
        store=store,
        procedure=procedure,
        progress=progress,
        desc=f"evaluate ({procedure})",
    )
    return metrics_from_features(heads, policy, examples, feats)


def format_report(m: Mapping[str, Any], title: str) -> str:
    """Human-readable metrics with sample sizes."""
    lines = [f"== {title}"]
    t = m.get("turn")
    if t:

        def r(x: Mapping[str, Any]) -> str:
            return f"{x['rate']:.1%} ({x['k']}/{x['n']})" if x["rate"] is not None else "n/a (n=0)"

        lines += [
            f"pause takeover (LISTEN decided SPEAK, target <= 10%): {r(t['pause_takeover'])}",
            f"complete-turn takeover (SPEAK decided SPEAK, target >= 90%): {r(t['complete_takeover'])}",
            f"turn taken (speak or mm-hmm) at a pause: {r(t['pause_answered'])}, after a complete turn: "
            f"{r(t['complete_answered'])}",
            f"backchannel recall: {r(t['backchannel_recall'])}; backchannel taken over: {r(t['backchannel_takeover'])}",
            f"speak-vs-listen AUROC: {t.get('speak_vs_listen_auroc')}; 3-class accuracy: {t['accuracy']}",
            "confusion (rows: label, columns: decision listen/backchannel/speak):",
        ]
        for name, row in zip(LABELS, t["confusion"]["rows_label_cols_decision"], strict=True):
            lines.append(f"  {name:>11}: " + " ".join(f"{v:6d}" for v in row))
        for form, v in t.get("by_form", {}).items():
            lines.append(
                f"  {form}: pause takeover {r(v['pause_takeover'])} (with mm-hmm {r(v['pause_answered'])}), "
                f"complete {r(v['complete_takeover'])}"
            )
        for src, v in t.get("by_source", {}).items():
            lines.append(
                f"  {src}: pause takeover {r(v['pause_takeover'])}, complete {r(v['complete_takeover'])}"
            )
    o = m.get("overlap")
    if o:
        lines.append(
            f"overlap accuracy: {o['accuracy']:.1%} (n={sum(o['n'].values())}); backchannel kept talking "
            f"{o['backchannel_kept_talking']['rate']:.1%} of {o['n']['backchannel']}, interruption stopped "
            f"{o['interruption_stopped']['rate']:.1%} of {o['n']['interruption']}; AUROC {o['auroc']}"
        )
    return "\n".join(lines)


# -- main --------------------------------------------------------------------------------------------


def _limit(examples: list[dict[str, Any]], n: int, seed: int) -> list[dict[str, Any]]:
    """A deterministic subsample of n examples, each head keeping its share (for quick runs)."""
    out = []
    for head in ("turn", "overlap"):
        rows = [e for e in examples if e["head"] == head]
        random.Random(f"limit:{seed}:{head}").shuffle(rows)
        out += rows[: max(1, round(n * len(rows) / max(1, len(examples))))]
    return out


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m dialogue.training.train_turn", description=__doc__.split("\n")[0]
    )
    ap.add_argument(
        "--out", type=Path, default=DEFAULT_WEIGHTS, help="weights file; the metadata goes next to it"
    )
    ap.add_argument("--limit", type=int, default=None, help="use at most N examples (quick runs)")
    ap.add_argument("--epochs", type=int, default=TrainConfig.epochs)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--no-engine-check", action="store_true", help="skip the held-out run with sliced prefill"
    )
    ap.add_argument(
        "--adapter",
        default="shipped",
        help="drafter adapter the heads read: shipped (dialogue/weights), a path, or none",
    )
    ap.add_argument(
        "--no-heard",
        action="store_true",
        help="typed text only (without the ASR transcripts of dialogue/training/heard_turns.py)",
    )
    ap.add_argument(
        "--heard-sets",
        default="0",
        help="voice sets of heard_turns.py to learn from, e.g. 0,1 (the shipped heads: 0; with 1 the "
        "2026-11-27 A/B moved the operating point, not the separation: docs/dialogue.md)",
    )
    ap.add_argument(
        "--features-only",
        metavar="K/N",
        default=None,
        help="only fill the feature cache, for the examples whose group hashes to K mod N, and exit: run N "
        "of these at once (one per core), then the plain command trains from the cache",
    )
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    progress = not args.no_progress
    shard: tuple[int, int] | None = None
    if args.features_only:
        try:
            shard = tuple(int(x) for x in args.features_only.split("/"))  # type: ignore[assignment]
            assert shard is not None and len(shard) == 2 and 0 <= shard[0] < shard[1]
        except (ValueError, AssertionError):
            ap.error(f"--features-only {args.features_only!r}: want K/N with 0 <= K < N")
    torch.set_num_threads(1)  # a shared 2-core machine: one thread is what the engine gets too
    t0 = time.time()

    heard_sets = tuple(int(x) for x in args.heard_sets.split(",") if x.strip())
    examples = D.build_examples(
        seed=args.seed, progress=progress, heard=not args.no_heard, heard_sets=heard_sets
    )
    splits = D.split_examples(examples, args.seed)
    # the held-out file stays typed text: `duplex eval dialogue` speaks and transcribes it itself
    if shard is None:  # not from the feature processes, which run side by side
        D.write_jsonl(D.EVAL_FILE, [e for e in splits["heldout"] if not is_heard(e)])
    if args.limit:
        splits = {
            k: _limit(v, max(1, round(args.limit * share)), args.seed)
            for (k, v), (_, share) in zip(splits.items(), D.SPLITS, strict=True)
        }
    sizes = {k: D.summarize(v)["labels"] for k, v in splits.items()}
    print(f"examples: {json.dumps(sizes)}", file=sys.stderr)

    from dialogue.drafter_adapter import adapter_path, adapter_sha256, load_drafter

    adapter = adapter_path(args.adapter)
    adapter_sha = adapter_sha256(adapter)
    model, tok = load_drafter(D.DRAFTER, DTYPE, adapter, progress=progress)
    system = system_prompt()
    drafter_id = (
        D.DRAFTER["sha256"]
        if adapter_sha is None
        else hashlib.sha256(f"{D.DRAFTER['sha256']}+{adapter_sha}".encode()).hexdigest()
    )
    store = FeatureStore(features_dir(), drafter_id)
    if shard is not None:
        k, n = shard
        mine = {name: [e for e in exs if D.shard_of(str(e["group"]), n) == k] for name, exs in splits.items()}
        for split, exs in mine.items():
            extract_features(model, tok, exs, system, store, progress=progress, desc=f"hidden states {split}")
        if not args.no_engine_check:
            extract_features(
                model, tok, mine["heldout"], system, store, "sliced", progress, "sliced held-out"
            )
        print(f"features {k}/{n}: {store.misses} computed, {store.hits} cached", file=sys.stderr)
        return 0
    feats: dict[str, torch.Tensor] = {}
    ys: dict[str, torch.Tensor] = {}
    rows: dict[str, list[dict[str, Any]]] = {}
    t_feat = time.time()
    for split, exs in splits.items():
        x = extract_features(model, tok, exs, system, store, progress=progress, desc=f"hidden states {split}")
        for head in ("turn", "overlap"):
            idx = [i for i, e in enumerate(exs) if e["head"] == head]
            feats[f"{head}:{split}"] = x[idx]
            ys[f"{head}:{split}"] = torch.tensor([int(exs[i]["label"]) for i in idx], dtype=torch.long)
            rows[f"{head}:{split}"] = [exs[i] for i in idx]
    feat_s = time.time() - t_feat

    cfg = TrainConfig(epochs=args.epochs, seed=args.seed)
    t_train = time.time()
    heads, info = train_heads(feats, ys, cfg, progress)
    with torch.no_grad():
        pv = heads.turn(feats["turn:val"])
        ov = heads.overlap(feats["overlap:val"])
    speak_t = tune_speak_threshold(pv, ys["turn:val"])
    bc_t = tune_backchannel_threshold(pv, ys["turn:val"], speak_t)
    int_t = tune_interrupt_threshold(ov, ys["overlap:val"])
    take_t = tune_take_threshold(pv, ys["turn:val"])
    policy = TurnPolicy(speak_t, bc_t, int_t, take_t)
    train_s = time.time() - t_train

    def report(split: str) -> dict[str, Any]:
        exs = rows[f"turn:{split}"] + rows[f"overlap:{split}"]
        x = torch.cat([feats[f"turn:{split}"], feats[f"overlap:{split}"]])
        return metrics_from_features(heads, policy, exs, x)

    val_m, ho_m = report("val"), report("heldout")
    print(
        f"thresholds: take {take_t} (the rule), speak {speak_t}, backchannel {bc_t}, interrupt {int_t}",
        file=sys.stderr,
    )
    print(format_report(val_m, "validation"), file=sys.stderr)
    print(format_report(ho_m, "held-out"), file=sys.stderr)
    engine_m = None
    if not args.no_engine_check:
        engine_m = evaluate_turn_heads(
            model,
            tok,
            heads,
            policy,
            splits["heldout"],
            system=system,
            procedure="sliced",
            store=store,
            progress=progress,
        )
        print(
            format_report(engine_m, f"held-out, engine-style prefill ({ENGINE_SLICE_TOKENS}-token slices)"),
            file=sys.stderr,
        )

    from safetensors.torch import save_file

    args.out.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in heads.state_dict().items()}
    save_file(state, str(args.out))
    gen_file = D.GENERATED_FILE
    meta = {
        "format": METADATA_FORMAT,
        "hidden_size": heads.hidden_size,
        "dim": heads.dim,
        "params": sum(p.numel() for p in heads.parameters()),
        "labels": {"turn": list(LABELS), "overlap": ["backchannel", "interruption"]},
        "thresholds": {"take": take_t, "speak": speak_t, "backchannel": bc_t, "interrupt": int_t},
        "threshold_rules": {
            "take": f"lowest P(not listen) threshold with <= {MAX_VAL_TAKEOVER:.0%} of validation LISTEN pauses "
            "taken (speak or backchannel); the decision rule (TurnPolicy.take_threshold); speak and "
            "backchannel below are the older rule's, kept for comparison",
            "speak": f"highest P(speak) threshold with <= {MAX_VAL_TAKEOVER:.0%} of validation LISTEN pauses taken "
            f"over and SPEAK recall within {RECALL_SLACK:.0%} of the best such threshold's",
            "backchannel": "best F1 (within 0.005, then closest to 0.5) of backchannel decisions on validation "
            "(session rule: p_bc >= threshold and p_bc >= p_listen, when not speaking)",
            "interrupt": "best balanced accuracy on validation",
        },
        "drafter": {k: D.DRAFTER[k] for k in ("name", "package", "file", "version", "sha256")}
        | {
            "dtype": DTYPE,
            "adapter_sha256": adapter_sha,
            "adapter": None if adapter is None else adapter.name,
        },
        "input": {
            "text": 'normalize_user_text (strip . , ! ? ; : " and collapse spaces; case and apostrophes kept)',
            "prompt": "render_user_prefix: chat template of system + history + user text, trailing <|im_end|>\\n cut",
            "hidden": "model.model(input_ids).last_hidden_state[0, -1] (after the final norm), float32",
            "turn_history": "up to 2 previous messages; overlap: none",
            "system_prompt_sha256": hashlib.sha256(system.encode()).hexdigest(),
        },
        "data": {
            "splits": {k: D.summarize(v) for k, v in splits.items()},
            "split_rule": "seeded sha256 of the example group: 70/15/15 train/val/heldout",
            "limit": args.limit,
            "generated_file": {
                "path": str(gen_file.relative_to(gen_file.parents[2])),
                "sha256": _sha256(gen_file),
            },
            "heard_file": None
            if args.no_heard or not HEARD_FILE.is_file()
            else {
                "path": str(HEARD_FILE.relative_to(HEARD_FILE.parents[2])),
                "sha256": _sha256(HEARD_FILE),
                "examples": sum(1 for e in examples if is_heard(e)),
                "voice_sets": list(heard_sets),
            },
            "eval_file": {
                "path": str(D.EVAL_FILE.relative_to(D.EVAL_FILE.parents[2])),
                "sha256": _sha256(D.EVAL_FILE),
            },
        },
        "train": info
        | {
            "config": asdict(cfg),
            "feature_seconds": round(feat_s, 1),
            "features_cached": store.hits,
            "features_computed": store.misses,
            "train_seconds": round(train_s, 1),
            "total_seconds": round(time.time() - t0, 1),
        },
        "val": val_m,
        "heldout": ho_m,
        "heldout_engine_prefill": engine_m,
        "targets": {"pause_takeover_max": 0.10, "complete_takeover_min": 0.90},
        "seed": args.seed,
        "feature_version": FEATURE_VERSION,
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    args.out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    print(
        f"wrote {args.out} and {args.out.with_suffix('.json')} in {time.time() - t0:.0f} s", file=sys.stderr
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
