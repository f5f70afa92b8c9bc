"""Labels for the relay verifier from the judge the relay is measured by: does committing this draft
cost the answer?

The first verifier learned *typical acceptance*: would the slow model have found the draft's words
likely enough? That label is blind to what the relay is judged on. "I'm sorry, but" is a likely
opening for the slow model after almost anything, so a refusal draft passes it, and then the slow
model, continuing from those words, refuses a question it would have answered. On the relay
benchmark the typical-acceptance verifier ranks the drafts by the answer quality they lose at an
AUROC of only 0.56.

This module labels each draft by its consequence instead, with the likelihood judge of
`dialogue.training.judge` (the slow model's per-token log-probability of an answer after the caller's words,
against after a neutral "Hello."):

* the slow model's own greedy answer (the drafter's distillation target, `drafter_targets.jsonl`,
  at most `LABEL_TOKENS` tokens; made here when a prompt has none);
* the relay's answer: the committed prefix, then the slow model's greedy continuation of it, to the
  same `LABEL_TOKENS`;
* `loss` = judge(slow-only) - judge(relay), each the judge's per-token PMI floored at 0 (the answers
  are cut at `LABEL_TOKENS`, so the judge's P(turn ends) factor is left out: a cut answer does not end).

A prefix the slow model's own answer starts with costs nothing (its greedy continuation *is* that
answer), so about half the drafts need neither the continuation nor the judge. The result per draft
is cached next to its features (`<key>.judge<LABEL_VERSION>.json`), so a rerun resumes, and
`python -m dialogue.training.train_verifier` writes every draft's result to `data/dialogue/relay_labels.jsonl`
(`SHIPPED`), which is read before the cache: the shipped verifier's labels are in the repository, and
its recipe reruns from a fresh clone without the ~30 min of judging.

`judge_label` turns a loss into the verifier's target: acceptable iff it loses at most `MARGIN`.
The rules of `train_verifier.forced_negative` that the engine's veto also holds (empty, another
script, markup) still make a draft unacceptable whatever the judge says; an echo of the question is
judged by the answer it leads to, like any other opening.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dialogue import verifier as V
from duplex.base.paths import DATA_ROOT

#: answer tokens each side is judged on (the drafter's targets hold this many)
LABEL_TOKENS = 32
#: a draft is acceptable iff the relay answer loses at most this much per-token PMI (nats)
MARGIN = 0.3
#: bump when the label procedure changes, so cached labels are made again
LABEL_VERSION = 1
#: the judge's result for each draft the shipped verifier was trained, tuned and tested on
SHIPPED = DATA_ROOT / "dialogue" / "relay_labels.jsonl"
#: what a result holds (the judge's two scores only where it had to judge: see `judge_dataset`)
RESULT_KEYS = ("slow", "relay", "same", "loss", "judge_slow", "judge_relay")


def starts_with_prefix(answer: str, prefix: str) -> bool:
    """The slow model's own answer begins with the committed words (then the relay changes nothing)."""
    a, p = " ".join(answer.split()), " ".join(prefix.split())
    return bool(p) and a.startswith(p) and (len(a) == len(p) or not (a[len(p)].isalnum() and p[-1].isalnum()))


def relay_answer(slow: Any, ids: Sequence[int], prefix: str, max_tokens: int = LABEL_TOKENS) -> str:
    """The relay's answer: `prefix` (the committed words, fed after the assistant header exactly as
    the engine feeds them) and the slow model's greedy continuation, `max_tokens` in all.
    `slow` is a `train_verifier.WarmModel`."""
    from dialogue.training.drafter_data import slow_answer

    pids = list(slow.tokenizer.encode(prefix, add_special_tokens=False))
    cont, _ = slow_answer(slow, list(ids) + pids, max(0, max_tokens - len(pids)))
    return (prefix + slow.tokenizer.decode(cont, skip_special_tokens=True)).strip()


def judged(
    judge: Any, history: Sequence[dict[str, str]], text: str, slow_answer_text: str, relay_text: str
) -> dict[str, float]:
    """The judge's per-token PMI (floored at 0) of both answers and the loss between them."""
    s, r = judge.score(history, text, [slow_answer_text, relay_text])
    q_s, q_r = max(0.0, s.pmi), max(0.0, r.pmi)
    return {"judge_slow": q_s, "judge_relay": q_r, "loss": q_s - q_r}


def judge_label(result: Mapping[str, Any], margin: float = MARGIN) -> int:
    """1 iff committing the draft loses at most `margin` of the judge's per-token PMI."""
    return int(float(result["loss"]) <= margin)


def relay_loss(scores: Sequence[float], losses: Sequence[float], share: float, cap: float = 3.0) -> float:
    """Mean loss per draft (judge PMI, each capped at `cap`; an empty prefix counts `cap`) when the
    `share` of drafts with the highest `scores` is committed and the rest answered by the slow model
    alone: the relay's quality loss that a verifier's ranking buys, on drafts with known losses."""
    if not losses:
        return float("nan")
    order = sorted(range(len(losses)), key=lambda i: -scores[i])[: int(share * len(losses))]
    return sum(min(cap, losses[i]) if math.isfinite(losses[i]) else cap for i in order) / len(losses)


def label_path(feature_file: Path) -> Path:
    return feature_file.with_name(f"{feature_file.stem}.judge{LABEL_VERSION}.json")


def judge_dataset(
    examples: Sequence[Mapping[str, Any]],
    feature_files: Sequence[Path],
    progress: bool = True,
    shipped: Path | None = SHIPPED,
) -> list[dict[str, Any]]:
    """The judge's result for every example (`train_verifier.build_dataset`'s, with their feature
    files): read from the `shipped` labels, else from its cache file, else made (the slow model is
    loaded only if one is missing)."""
    from tqdm import tqdm

    from dialogue.training import drafter_data as DD
    from dialogue.training import relay_prompts as RP

    paths = [label_path(f) for f in feature_files]
    shipped_rows = read_shipped(shipped)
    results: list[dict[str, Any] | None] = []
    for ex, f in zip(examples, feature_files, strict=True):
        row = shipped_rows.get(Path(f).stem)
        # the key holds everything the draft depends on; the prefix is checked all the same
        ok = row is not None and row["prefix"] == str(ex["prefix"]).strip()
        results.append({k: row[k] for k in RESULT_KEYS if k in row} if ok else None)
    todo = [i for i, p in enumerate(paths) if results[i] is None and not p.is_file()]
    n_shipped = sum(r is not None for r in results)
    print(
        f"judge labels: {n_shipped} shipped ({shipped}), {len(paths) - n_shipped - len(todo)} cached, "
        f"{len(todo)} to make",
        file=sys.stderr,
    )
    if todo:
        from dialogue.training.judge import LikelihoodJudge

        targets = DD.read_targets()
        slow, system = DD.load_slow_model(progress)
        tok = slow.tokenizer
        judge = LikelihoodJudge(slow.model, tok, system)
        for i in tqdm(todo, desc="judging drafts", disable=not progress, smoothing=0.05):
            if paths[i].is_file():  # made meanwhile by another run on the same cache
                continue
            ex = examples[i]
            prompt = RP.Prompt(ex["group"], ex["source"], tuple(tuple(h) for h in ex["history"]), ex["text"])
            history = prompt.messages()
            ids = V.chat_ids(tok, system, history, ex["text"])
            target = targets.get(DD.prompt_key(prompt))
            if target is not None and target.get("n_tokens", LABEL_TOKENS) <= LABEL_TOKENS:
                own = str(target["answer"]).strip()
            else:
                toks, _ = DD.slow_answer(slow, ids, LABEL_TOKENS)
                own = tok.decode(toks, skip_special_tokens=True).strip()
            prefix = str(ex["prefix"]).strip()
            if not prefix:
                res = {"slow": own, "relay": "", "same": False, "loss": float("inf")}
            elif starts_with_prefix(own, prefix):
                res = {"slow": own, "relay": own, "same": True, "loss": 0.0}
            else:
                relay = relay_answer(slow, ids, prefix)
                res = {"slow": own, "relay": relay, "same": relay == own}
                res |= judged(judge, history, ex["text"], own, relay)
            tmp = paths[i].with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(res))
            os.replace(tmp, paths[i])
    return [r if r is not None else json.loads(p.read_text()) for r, p in zip(results, paths, strict=True)]


def read_shipped(path: Path | None = SHIPPED) -> dict[str, dict[str, Any]]:
    """Shipped judge results by feature key (rows of another `LABEL_VERSION` are left out)."""
    rows: dict[str, dict[str, Any]] = {}
    if path is None or not Path(path).is_file():
        return rows
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        if row.get("version") == LABEL_VERSION:
            row["loss"] = math.inf if row["loss"] is None else float(row["loss"])  # null: no prefix to judge
            rows[row["key"]] = row
    return rows


def write_shipped(
    examples: Sequence[Mapping[str, Any]], results: Sequence[Mapping[str, Any]], path: Path = SHIPPED
) -> None:
    """One line per draft: its feature key, the caller's words, the committed prefix and the judge's
    result (`RESULT_KEYS`; an infinite loss, for no prefix, as null), in the examples' order."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with tmp.open("w") as f:
        for ex, res in zip(examples, results, strict=True):
            row = {
                "key": Path(ex["feature_file"]).stem,
                "version": LABEL_VERSION,
                "text": ex["text"],
                "prefix": str(ex["prefix"]).strip(),
            }
            row |= {k: res[k] for k in RESULT_KEYS if k in res}
            row["loss"] = float(row["loss"]) if math.isfinite(float(row["loss"])) else None
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def rule(margin: float = MARGIN) -> str:
    """The label rule, in words, for the verifier's metadata."""
    return (
        "label 1 iff the prefix is non-empty, Latin script, no markup/code, and "
        f"the relay's answer (the prefix, then the slow model's greedy continuation, {LABEL_TOKENS} tokens) "
        f"loses at most {margin} of the likelihood judge's per-token PMI (floored at 0) against the slow "
        "model's own answer; a prefix the slow model's own answer starts with loses nothing"
    )


def label_examples(
    examples: Sequence[dict[str, Any]], results: Sequence[Mapping[str, Any]], margin: float = MARGIN
) -> list[int]:
    """1 = committing the draft keeps the answer; sets ex['label'], ex['reason'] and ex['loss'] too.
    Reasons: a forced negative of `train_verifier.forced_negative`, "own" (the slow model's answer
    starts with the prefix), "kept" or "loses"."""

    labels = []
    for ex, res in zip(examples, results, strict=True):
        why = forced_negative(ex, echo=False)  # an echo is judged by what it leads to, like any opening
        ok = judge_label(res, margin)
        ex["reason"] = why or ("own" if res.get("same") else ("kept" if ok else "loses"))
        ex["label"] = int(why is None and bool(ok))
        ex["loss"] = float(res["loss"])
        labels.append(ex["label"])
    return labels


def forced_negative(ex: Mapping[str, Any], echo: bool = True) -> str | None:
    """Why a draft is unacceptable whatever its scores (None if it is not); `echo`: an echo of the
    question is one (typical-acceptance labels; judge labels judge it by the answer it leads to)."""
    prefix = str(ex["prefix"])
    if not prefix:
        return "empty"
    if V.is_foreign(prefix):
        return "foreign"
    if V.is_markup(prefix):
        return "markup"
    if echo and V.repeats_question(prefix, str(ex["text"])):
        return "echo"
    return None
