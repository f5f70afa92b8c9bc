"""Multi-turn prompts: single-turn prompts chained into conversations with earlier answers in the history.

Why: a drafter distilled on single-turn prompts learned to start answers the way the slow model
starts them, but in a live session it copies the *shape* of the previous answers in its context
("The day after Monday is Tuesday." -> "How many legs does a spider have?" -> "The spider that comes
after Monday ..."). The relay eval and the verifier's data had almost no history either, so neither
could see it. This module makes conversations the way a session grows them:

* 1-4 earlier exchanges before the user turn being answered, drawn from prompts of the *same split*
  (train / val / held-out, as `dialogue.training.drafter_data` splits them), so a held-out question never
  appears in the history of a training conversation and the other way round;
* the earlier answers are the slow model's own (`data/dialogue/drafter_targets.jsonl`), cut at their
  last sentence end as the service would have said them;
* often (`SAME_SOURCE`) the earlier exchanges come from the same source as the last one (trivia after
  trivia, bookings after bookings): answers of the same shape are the trap;
* sometimes (`BARGE_IN`) the last answer was interrupted: the history keeps only the words that were
  heard (as `SessionCore.truncate` does) and the user turn starts with a cue such as "stop" or "wait".

Each conversation is a `train_verifier.Prompt` whose group is the last prompt's group plus
`GROUP_SUFFIX`, so `split_of` puts it in the same split as its last prompt, whatever else is added.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from dialogue import verifier as V
from dialogue.training import relay_prompts as RP
from duplex.base.cues import TRAINING_CUES  # what callers say when they cut the assistant off

#: a conversation's group is its last prompt's group + this (its split is that group's split)
GROUP_SUFFIX = "#multi"
SOURCE = "multi"
SAME_SOURCE = 0.5
BARGE_IN = 0.25
MAX_EXCHANGES = 4
#: per split: how many conversations (the drafter trains on `train`; val picks its epoch; held-out
#: prompts go to the relay eval)
DEFAULT_COUNTS = {"train": 1200, "val": 150, "heldout": 150}


def spoken_answer(answer: str, ended: bool) -> str:
    """What the service would have said of a (possibly cut-off) answer: whole sentences, one line."""
    text = " ".join(str(answer).split())
    if not ended:
        ends = [m.end() for m in re.finditer(r"[.!?](?=\s|$)", text)]
        if ends and ends[-1] >= 12:
            text = text[: ends[-1]]
        else:
            words = text.split()
            text = " ".join(words[:-1]) if len(words) > 1 else text
    return text[: RP.HISTORY_CHARS].strip()


def heard_words(answer: str, rng: random.Random) -> str:
    """The first few words of an answer, as heard before a barge-in (no closing punctuation)."""
    words = answer.split()
    n = rng.randint(2, max(2, min(12, len(words) - 1)))
    return re.sub(r"[.,!?;:]+$", "", " ".join(words[:n]))


def split_of(group: str, base_split: Mapping[str, str]) -> str | None:
    """The split of a group: a conversation's is its last prompt's."""
    return base_split.get(group.removesuffix(GROUP_SUFFIX))


def is_multi(p: RP.Prompt) -> bool:
    return p.group.endswith(GROUP_SUFFIX)


def conversations(
    rows: Sequence[Mapping[str, Any]], counts: Mapping[str, int] | None = None, seed: int = 0
) -> list[tuple[RP.Prompt, str]]:
    """(prompt, split) for `counts[split]` conversations per split, from answered single-turn `rows`.

    `rows` are `drafter_targets.jsonl` rows (text, answer, ended, group, source, split, history);
    only rows without history are chained. Deterministic for a seed and the same rows.
    """
    counts = dict(DEFAULT_COUNTS if counts is None else counts)
    rng = random.Random(seed)
    out: list[tuple[RP.Prompt, str]] = []
    for split in sorted(counts):
        pool = [
            r
            for r in rows
            if r.get("split") == split
            and not r.get("history")
            and str(r.get("answer", "")).strip()
            and not V.is_markup(str(r["answer"]))
        ]
        pool.sort(key=lambda r: (r["group"], r["text"]))
        if len(pool) < MAX_EXCHANGES + 2:
            continue
        by_source: dict[str, list[Mapping[str, Any]]] = {}
        for r in pool:
            by_source.setdefault(str(r["source"]), []).append(r)
        seen: set[tuple[Any, ...]] = set()
        made = tries = 0
        while made < counts[split] and tries < 20 * counts[split]:
            tries += 1
            last = rng.choice(pool)
            k = rng.randint(1, MAX_EXCHANGES)
            same = by_source[str(last["source"])]
            src = same if rng.random() < SAME_SOURCE and len(same) > k + 1 else pool
            earlier = [r for r in rng.sample(src, min(len(src), k + 3)) if r["text"] != last["text"]][:k]
            history: list[tuple[str, str]] = []
            for r in earlier:
                history += [
                    ("user", str(r["text"])),
                    ("assistant", spoken_answer(r["answer"], bool(r["ended"]))),
                ]
            text = str(last["text"])
            if rng.random() < BARGE_IN:
                history[-1] = ("assistant", heard_words(history[-1][1], rng))
                text = f"{rng.choice(TRAINING_CUES)} {text[:1].lower()}{text[1:]}"
            key = (tuple(history), text)
            if key in seen or not history[-1][1]:
                continue
            seen.add(key)
            out.append((RP.Prompt(str(last["group"]) + GROUP_SUFFIX, SOURCE, tuple(history), text), split))
            made += 1
    return out
