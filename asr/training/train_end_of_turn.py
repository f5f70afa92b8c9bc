"""Train the acoustic end-of-turn cue (`asr.end_of_turn`): does the voice sound finished where it stopped?

    python -m asr.training.train_end_of_turn [--turns 1600] [--out asr/weights/end_of_turn.json]

1. Renders `--turns` training turns (`dialogue.training.turn_data`'s train split: half complete
   sentences, half mid-sentence cuts spoken inside their whole sentence, `whole_cut.render_turn`) in
   the training voices, each engine in turn (espeak variants, hibari edits, Kokoro blends, flite
   kal/awb/rms; never a held-out voice). Cached under `$DUPLEX_CACHE/end_of_turn/`; a stopped run goes
   on where it stopped (each turn's voice and draws depend only on the seed and its index).
2. Fits a logistic model on the standardised features; the L2 weight is chosen by leave-one-engine-out
   AUROC (the held-out voices are new engines' voices too, so this is what generalises).
3. Reports the AUROC on the held-out turns `duplex eval eot --speech 200 --cut-audio whole` speaks (the
   same audio: flite slt and the held-out Kokoro blend; reported, never fitted on), writes the weights
   with their metadata, and a plot of the held-out probabilities and ROC.

How the session uses the cue, and the operating point, is calibrated by `duplex eval eot`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from asr.end_of_turn import WEIGHTS, EndOfTurnModel, features
from duplex.base.paths import DATA_ROOT


def cache_dir() -> Path:
    """$DUPLEX_CACHE/end_of_turn (default ~/.cache/duplex/end_of_turn)."""
    return Path(os.environ.get("DUPLEX_CACHE", Path.home() / ".cache" / "duplex")) / "end_of_turn"


L2_GRID = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)


def auroc(labels: Sequence[int] | np.ndarray, scores: Sequence[float] | np.ndarray) -> float:
    """Area under the ROC curve (ties count half); labels 1 = complete."""
    y = np.asarray(labels, bool)
    s = np.asarray(scores, np.float64)
    n1, n0 = int(y.sum()), int((~y).sum())
    if not n1 or not n0:
        return float("nan")
    order = s.argsort(kind="mergesort")
    ranks = np.empty(len(s))
    ranks[order] = np.arange(1, len(s) + 1)
    for v in np.unique(s):  # average ranks of ties
        tie = s == v
        ranks[tie] = ranks[tie].mean()
    return float((ranks[y].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float) -> tuple[np.ndarray, float]:
    """L2-regularised logistic regression by L-BFGS (float64, deterministic)."""
    import torch

    xt = torch.tensor(x, dtype=torch.float64)
    yt = torch.tensor(y, dtype=torch.float64)
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=500, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(xt @ w + b, yt) + l2 * (w**2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach().numpy().astype(np.float32), float(b.detach())


# -- turns ------------------------------------------------------------------------------------------


class TurnStore:
    """Rendered turns as int16 audio with label (1 complete, 0 cut), voice, text, index; one .npz."""

    def __init__(self, path: Path, load: bool = True) -> None:
        """The turns saved at `path` (none with `load=False`: a store that replaces them when saved)."""
        self.path = path
        self.audio: list[np.ndarray] = []
        self.labels: list[int] = []
        self.voices: list[str] = []
        self.texts: list[str] = []
        self.index: list[int] = []
        if load and path.exists():
            d = np.load(path)
            lens = d["lens"]
            audio = d["audio"]  # each d[...] reads the array from the file again: once here
            offs = np.concatenate([[0], np.cumsum(lens)])
            self.audio = [audio[offs[i] : offs[i + 1]] for i in range(len(lens))]
            self.labels, self.voices = d["labels"].tolist(), d["voices"].tolist()
            self.texts, self.index = d["texts"].tolist(), d["index"].tolist()

    def add(self, audio: np.ndarray, label: int, voice: str, text: str, index: int) -> None:
        self.audio.append((np.clip(audio, -1, 1) * 32767).astype(np.int16))
        self.labels.append(label)
        self.voices.append(voice)
        self.texts.append(text)
        self.index.append(index)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp.npz")
        np.savez(
            tmp,
            audio=np.concatenate(self.audio) if self.audio else np.zeros(0, np.int16),
            lens=np.array([len(a) for a in self.audio], np.int64),
            labels=np.array(self.labels, np.int64),
            voices=np.array(self.voices),
            texts=np.array(self.texts),
            index=np.array(self.index, np.int64),
        )
        tmp.replace(self.path)

    def float_audio(self, i: int) -> np.ndarray:
        return self.audio[i].astype(np.float32) / 32767


def render_training_turns(n: int, seed: int, store: TurnStore, progress: bool = True) -> TurnStore:
    """Up to `n` training turns (n // 2 complete, n // 2 cut) into `store`, resuming after its last."""
    from tqdm.auto import tqdm

    from asr.training.speakers import Synth, training_speakers
    from asr.training.whole_cut import render_turn
    from dialogue.training.turn_data import build_examples, split_examples
    from duplex.base.turn_policy import SPEAK

    train = [
        e
        for e in split_examples(build_examples(progress=False, heard=False))["train"]
        if e.get("head", "turn") == "turn" and e["kind"] in ("cut", "complete")
    ]
    by_engine: dict[str, list[Any]] = {}
    for s in training_speakers():
        by_engine.setdefault(s.engine, []).append(s)
    engines = sorted(by_engine)
    order = np.random.default_rng(seed).permutation(len(train))
    counts = {"cut": 0, "complete": 0}
    for label in store.labels:
        counts["complete" if label else "cut"] += 1
    start = (int(np.nonzero(order == store.index[-1])[0][0]) + 1) if store.index else 0
    synth = Synth()
    bar = tqdm(total=n, initial=len(store.labels), desc="turns", disable=not progress)
    for j in order[start:]:
        if min(counts.values()) >= n // 2:
            break
        ex = train[int(j)]
        if counts[ex["kind"]] >= n // 2:
            continue
        rng = np.random.default_rng([seed, int(j)])
        pool = by_engine[engines[int(j) % len(engines)]]
        speaker = pool[int(rng.integers(len(pool)))]
        try:
            audio, _ = render_turn(synth, ex, train, speaker, rng)
        except Exception as exc:  # noqa: BLE001 -- a voice that fails on one text: skip the turn, say so
            bar.write(f"skipped: {speaker.name} on {ex['text']!r}: {exc}")
            continue
        if len(audio) < 3200:  # under 0.2 s: nothing to hear
            continue
        store.add(audio, int(int(ex["label"]) == SPEAK), speaker.name, ex["text"], int(j))
        counts[ex["kind"]] += 1
        bar.update(1)
        if len(store.labels) % 50 == 0:
            store.save()
    bar.close()
    store.save()
    return store


def render_heldout_turns(n: int, seed: int, store: TurnStore, progress: bool = True) -> TurnStore:
    """The turns `duplex eval eot --speech n --seed seed --cut-audio whole` speaks, in its order and draws."""
    from tqdm.auto import tqdm

    from asr.training.speakers import Synth, heldout_natural_speakers
    from asr.training.whole_cut import render_turn
    from dialogue.training.turn_sets import heldout_turn_examples, speech_examples
    from duplex.base.turn_policy import SPEAK

    if len(store.labels) >= n:
        return store
    examples = heldout_turn_examples()
    chosen = speech_examples(examples, n, seed)
    speakers = heldout_natural_speakers()
    synth, rng = Synth(), np.random.default_rng(seed)
    fresh = TurnStore(store.path, load=False)
    for i, ex in enumerate(tqdm(chosen, desc="held-out turns", disable=not progress)):
        speaker = speakers[i % len(speakers)]
        audio, _ = render_turn(synth, ex, examples, speaker, rng)
        fresh.add(audio, int(int(ex["label"]) == SPEAK), speaker.name, ex["text"], i)
    fresh.save()
    return fresh


# -- fit and report ---------------------------------------------------------------------------------


def soften_end(audio: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The turn as a live line might carry it: the voice's last 20-100 ms faded out (no synthesiser's hard
    stop, no cut's abrupt edge) and a noise floor 25-60 dB below the speech. Applied to complete turns and
    cuts alike, so neither an abrupt end nor digital silence can tell them apart."""
    from asr.end_of_turn import HOP, WIN, log_mel, trailing_silence_start

    x = np.asarray(audio, np.float32).copy()
    energy = np.log(np.exp(log_mel(x)).sum(axis=1) + 1e-12)
    end = min(len(x), trailing_silence_start(energy) * HOP + WIN)
    n = min(end, int(rng.uniform(0.02, 0.1) * 16000))
    if n:
        x[end - n : end] *= np.cos(np.linspace(0, np.pi / 2, n)) ** 2
    x[end:] = 0
    rms = float(np.sqrt(np.mean(x[:end] ** 2))) if end else 0.0
    noise = rng.standard_normal(len(x)).astype(np.float32) * rms * 10 ** (-rng.uniform(25, 60) / 20)
    return x + noise


def feature_matrix(store: TurnStore, soften_seed: int | None = None, progress: bool = True) -> np.ndarray:
    """Each turn's `features`; with `soften_seed`, of its `soften_end` version (seeded per turn)."""
    from tqdm.auto import tqdm

    rows = []
    for i in tqdm(range(len(store.labels)), desc="features", disable=not progress):
        audio = store.float_audio(i)
        if soften_seed is not None:
            audio = soften_end(audio, np.random.default_rng([soften_seed, store.index[i]]))
        rows.append(features(audio))
    return np.stack(rows) if rows else np.zeros((0, 0), np.float32)


def choose_l2(x: np.ndarray, y: np.ndarray, engines: np.ndarray) -> tuple[float, dict[str, dict[str, float]]]:
    """The L2 weight with the best mean leave-one-engine-out AUROC, and every weight's AUROCs."""
    table: dict[str, dict[str, float]] = {}
    for l2 in L2_GRID:
        scores = {}
        for eng in np.unique(engines):
            tr, te = engines != eng, engines == eng
            w, b = fit_logistic(x[tr], y[tr], l2)
            scores[str(eng)] = auroc(y[te], x[te] @ w + b)
        scores["mean"] = float(np.mean(list(scores.values())))
        table[str(l2)] = scores
    best = max(L2_GRID, key=lambda v: table[str(v)]["mean"])
    return best, table


def train(
    train_store: TurnStore,
    heldout: TurnStore,
    out: Path,
    plot: Path | None,
    command: str,
    progress: bool = True,
) -> dict[str, Any]:
    # every training turn twice: as rendered, and softened (faded end, noise floor)
    x = np.concatenate(
        [feature_matrix(train_store, None, progress), feature_matrix(train_store, 7, progress)]
    )
    y = np.tile(np.array(train_store.labels, np.float64), 2)
    engines = np.tile(np.array([v.split(":")[0] for v in train_store.voices]), 2)
    mean, std = x.mean(axis=0), x.std(axis=0) + 1e-6
    z = (x - mean) / std
    l2, cv = choose_l2(z, y, engines)
    w, b = fit_logistic(z, y, l2)
    xh = feature_matrix(heldout, None, progress)
    yh = np.array(heldout.labels)
    ph = 1.0 / (1.0 + np.exp(-(((xh - mean) / std) @ w + b)))
    soft = 1.0 / (1.0 + np.exp(-(((feature_matrix(heldout, 7, progress) - mean) / std) @ w + b)))
    voices = np.array(heldout.voices)
    report = {
        "train_turns": len(train_store.labels),
        "train_rows": len(y),  # each turn as rendered and softened (`soften_end`)
        "train_engines": {str(e): int((engines == e).sum()) // 2 for e in np.unique(engines)},
        "l2": l2,
        "leave_one_engine_out_auroc": cv,
        "train_auroc": auroc(y, z @ w + b),
        "heldout_auroc": auroc(yh, ph),
        "heldout_auroc_by_voice": {
            str(v): auroc(yh[voices == v], ph[voices == v]) for v in np.unique(voices)
        },
        "heldout_softened_auroc": auroc(yh, soft),
        "heldout_turns": len(yh),
    }
    meta = {
        "what": "P(the turn is complete) from how the voice stopped (asr.end_of_turn.features)",
        "command": command,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        **report,
    }
    EndOfTurnModel(mean.astype(np.float32), std.astype(np.float32), w, b, meta).to_json(out)
    if plot is not None:
        _plot(yh, ph, voices, report, plot)
    return {"report": report, "heldout_p": ph.tolist()}


def _plot(y: np.ndarray, p: np.ndarray, voices: np.ndarray, report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    bins = np.linspace(0, 1, 21)
    a.hist(p[y == 1], bins=bins, alpha=0.6, label="complete turns")
    a.hist(p[y == 0], bins=bins, alpha=0.6, label="mid-sentence cuts")
    a.set_xlabel("P(complete), acoustic")
    a.set_ylabel("held-out turns")
    a.legend()
    for v in np.unique(voices):
        m = voices == v
        order = np.argsort(-p[m])
        tp = np.cumsum(y[m][order] == 1) / max(1, (y[m] == 1).sum())
        fp = np.cumsum(y[m][order] == 0) / max(1, (y[m] == 0).sum())
        b.plot(
            np.r_[0, fp], np.r_[0, tp], label=f"{v} (AUROC {report['heldout_auroc_by_voice'][str(v)]:.2f})"
        )
    b.plot([0, 1], [0, 1], "k:", lw=0.8)
    b.set_xlabel("cuts called complete")
    b.set_ylabel("complete turns called complete")
    b.legend(fontsize=8)
    fig.suptitle(
        f"acoustic end-of-turn cue on held-out voices (n={len(y)}), AUROC {report['heldout_auroc']:.2f}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m asr.training.train_end_of_turn", description=__doc__.split("\n")[0]
    )
    ap.add_argument(
        "--turns", type=int, default=1600, help="training turns to render (half cut, half complete)"
    )
    ap.add_argument(
        "--heldout", type=int, default=200, help="held-out turns (as `duplex eval eot --speech N`)"
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--cache", default=None, help="where rendered turns are kept (default $DUPLEX_CACHE/end_of_turn)"
    )
    ap.add_argument("--out", default=str(WEIGHTS), help="the weights JSON to write")
    ap.add_argument("--plot", default=str(DATA_ROOT.parent / "docs" / "results" / "end-of-turn-acoustic.png"))
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    progress = not args.no_progress
    cache = Path(args.cache) if args.cache else cache_dir()
    train_store = render_training_turns(
        args.turns, args.seed, TurnStore(cache / f"train-s{args.seed}.npz"), progress
    )
    heldout = render_heldout_turns(
        args.heldout, 0, TurnStore(cache / f"heldout-{args.heldout}.npz"), progress
    )
    command = " ".join(
        ["python -m asr.training.train_end_of_turn", *(sys.argv[1:] if argv is None else argv)]
    )
    result = train(
        train_store, heldout, Path(args.out), Path(args.plot) if args.plot else None, command, progress
    )
    print(json.dumps(result["report"], indent=1))
    print(f"wrote {args.out}" + (f" and {args.plot}" if args.plot else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
