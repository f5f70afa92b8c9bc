"""What the relay's drafter is taught: the slow model's own openings, on prompts the relay eval never sees.

The relay pays only when the drafter starts answers the way the slow model would: a draft the slow
model would not have said is discarded (and then costs time) or, worse, committed and spoken. The
stock SmolLM2-135M-Instruct agrees with Qwen2.5-0.5B on the first word of only ~35 % of answers, so
the drafter is distilled on the slow model's greedy answers (sequence-level distillation).

Prompts (`drafter_prompts`):

* the relay verifier's prompt set (`dialogue.training.train_verifier.all_prompts`, chatterbot-corpus user
  turns and caller-request templates), split exactly as the verifier splits it (by conversation /
  template family, seed 0): only its *train* groups teach the drafter, *val* chooses the training
  epoch, *heldout* (data/dialogue/relay_eval.jsonl, the relay benchmark) is never trained on;
* more fills of the train-split template families, the chatterbot assistant lines of train-split
  conversations said back as user turns, the caller lines in data/dialogue/turn_generated.jsonl,
  and the extra caller-request families below (`EXTRA_TEMPLATES`, new phrasings of new topics).

Targets (`generate_targets`): the slow model of the `cpu` profile (int8, as the service runs it),
the service's system prompt, the user text normalised like ASR text (the verifier's convention),
greedy, up to `TARGET_TOKENS` tokens. They are written to data/dialogue/drafter_targets.jsonl
(committed, ~0.5 MB), one line per prompt as it is made, so a rerun resumes and a fresh clone can
retrain the drafter without the slow model.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dialogue import verifier as V
from dialogue.training import relay_features as RF
from dialogue.training import relay_prompts as RP
from duplex.base.paths import DATA_ROOT

DATA_DIR = DATA_ROOT / "dialogue"
TARGETS_FILE = DATA_DIR / "drafter_targets.jsonl"
#: tokens of the slow model's answer kept as the target (the drafter drafts at most 12)
TARGET_TOKENS = 32
#: fills per train-split template family (the verifier's prompt set takes 25)
MORE_FILLS = 60

#: caller requests on topics and in phrasings the verifier's templates do not have (train only)
EXTRA_TEMPLATES: list[tuple[str, dict[str, list[str]]]] = [
    (
        "Hey can you tell me {what}",
        {
            "what": [
                "how to make coffee without a machine",
                "when the bank closes",
                "a good movie to watch tonight",
                "what I should wear for an interview",
                "how far Mars is",
                "how to say hello in Korean",
                "why leaves change color",
                "how many calories are in an apple",
                "who invented the internet",
                "what the tallest building is",
                "how to fix a dripping faucet",
                "the rules of chess",
                "a fun thing to do this weekend",
                "how to make a paper plane",
                "what time it is in Tokyo",
            ]
        },
    ),
    (
        "I'm trying to {goal} {detail}",
        {
            "goal": [
                "find a cheap hotel",
                "get to the museum",
                "cook dinner for six",
                "learn to code",
                "fix my bike",
                "write a birthday card",
                "pay my water bill",
                "sleep better",
            ],
            "detail": ["any ideas", "where do I start", "can you help", "but I'm stuck", "what would you do"],
        },
    ),
    (
        "My {person} {event} {ask}",
        {
            "person": ["son", "wife", "best friend", "neighbor", "boss", "grandmother", "cat", "dog"],
            "event": [
                "has a birthday next week",
                "is sick",
                "just got a new job",
                "is moving away",
                "won't eat",
                "is feeling down",
            ],
            "ask": ["what should I do", "any advice", "what can I get them", "how can I help"],
        },
    ),
    (
        "Do I need {thing} to {goal}",
        {
            "thing": [
                "a visa",
                "a license",
                "an appointment",
                "a passport",
                "insurance",
                "a reservation",
                "cash",
            ],
            "goal": [
                "travel to Canada",
                "drive a boat",
                "see a specialist",
                "rent a car",
                "visit the museum",
                "go fishing",
                "park downtown",
            ],
        },
    ),
    (
        "What happens if I {action}",
        {
            "action": [
                "miss a payment",
                "forget my password",
                "lose my boarding pass",
                "cancel late",
                "eat expired yogurt",
                "leave the oven on",
                "skip breakfast",
                "don't renew my passport",
                "drink too much coffee",
                "overdraw my account",
                "miss my connecting flight",
            ]
        },
    ),
    (
        "Can you give me {what} for {topic}",
        {
            "what": ["a tip", "some ideas", "a quick summary", "a recipe", "advice", "a recommendation"],
            "topic": [
                "saving money",
                "a picnic",
                "staying focused",
                "a rainy afternoon",
                "a long flight",
                "meeting new people",
                "studying for exams",
                "a small garden",
            ],
        },
    ),
    (
        "How often should I {task}",
        {
            "task": [
                "water my cactus",
                "change my car oil",
                "wash my sheets",
                "go to the dentist",
                "exercise",
                "replace my toothbrush",
                "check my tire pressure",
                "back up my computer",
                "feed my fish",
                "update my phone",
                "clean my fridge",
                "get a haircut",
            ]
        },
    ),
    (
        "Is it {adj} to {thing} {when}",
        {
            "adj": ["okay", "normal", "a good idea", "too late", "rude", "expensive"],
            "thing": [
                "call a restaurant",
                "visit Paris",
                "buy a house",
                "start running",
                "ask for a raise",
                "book flights",
                "text my landlord",
            ],
            "when": ["now", "in winter", "at night", "this year", "on a Sunday", "after six"],
        },
    ),
    (
        "Where can I {action}",
        {
            "action": [
                "buy stamps",
                "recycle old batteries",
                "watch the game tonight",
                "get a flu shot",
                "find a good pizza",
                "charge my phone",
                "print documents",
                "rent a bike",
                "donate clothes",
                "learn to dance",
                "get my keys copied",
                "park for free",
            ]
        },
    ),
    (
        "Thanks for {thing} {more}",
        {
            "thing": ["your help", "the tip", "explaining that", "waiting", "the recommendation", "checking"],
            "more": ["", "that's great", "you're the best", "one more question", "have a nice day", "bye"],
        },
    ),
    (
        "Sorry I {problem} {ask}",
        {
            "problem": [
                "missed that",
                "didn't catch the last part",
                "got cut off",
                "was distracted",
                "dropped my phone",
            ],
            "ask": ["", "can you say it again", "what was the price", "where was that", "could you repeat"],
        },
    ),
    (
        "Why does {thing} {happen}",
        {
            "thing": ["my milk", "bread", "the sky", "my laptop", "my dog", "the moon", "ice", "my voice"],
            "happen": [
                "go bad so fast",
                "get moldy",
                "look red at sunset",
                "get hot",
                "bark at night",
                "change shape",
                "float",
                "sound different on recordings",
            ],
        },
    ),
    (
        "I just {event} {ask}",
        {
            "event": [
                "moved to a new city",
                "finished my exams",
                "adopted a puppy",
                "lost my job",
                "got engaged",
                "bought a car",
                "started a diet",
                "came back from vacation",
            ],
            "ask": ["", "any tips", "what should I do first", "I'm so excited", "I'm a bit worried"],
        },
    ),
    (
        "Okay and {what}",
        {
            "what": [
                "how much is that",
                "when does it open",
                "what about tomorrow",
                "is there parking",
                "can I pay by card",
                "how long will it take",
                "do I need to bring anything",
                "what's the address",
                "who should I ask for",
                "is it far from here",
            ]
        },
    ),
    (
        "Give me {n} {things}",
        {
            "n": ["two", "three", "a few", "some"],
            "things": [
                "names for a cat",
                "reasons to learn French",
                "easy dinner ideas",
                "fun facts about space",
                "ways to relax",
                "gift ideas for a teacher",
                "words that rhyme with blue",
            ],
        },
    ),
    (
        "Could you {verb} {what} please",
        {
            "verb": ["explain", "repeat", "spell", "summarize", "check"],
            "what": [
                "that",
                "the last part",
                "my order number",
                "the opening hours",
                "the total",
                "the instructions",
                "your name",
            ],
        },
    ),
    (
        "What's a good {thing} for {who}",
        {
            "thing": ["gift", "name", "snack", "hobby", "book", "game", "pet"],
            "who": [
                "a ten year old",
                "my mom",
                "a coworker",
                "someone who loves cooking",
                "a small apartment",
                "a long car ride",
                "a retired teacher",
            ],
        },
    ),
    (
        "Is {thing} {adj}",
        {
            "thing": [
                "coffee",
                "chocolate",
                "running every day",
                "the tap water here",
                "this weather",
                "a four day work week",
                "eating late at night",
                "bitcoin",
            ],
            "adj": ["healthy", "bad for you", "safe", "normal", "worth it", "a good idea"],
        },
    ),
]


@dataclass(frozen=True)
class DraftPrompt:
    """A user turn, where it comes from, and which split it belongs to."""

    prompt: RP.Prompt
    split: str  # train | val | heldout

    @property
    def key(self) -> str:
        return prompt_key(self.prompt)


def prompt_key(p: RP.Prompt) -> str:
    """Identity of a prompt: its history and text."""
    return hashlib.sha256(json.dumps([list(p.history), p.text]).encode()).hexdigest()[:20]


def _assistant_lines_as_turns(train_groups: set[str]) -> list[RP.Prompt]:
    """chatterbot assistant lines of train-split conversations, said back as user turns (no history)."""
    import importlib.util

    import yaml

    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None or not spec.submodule_search_locations:
        return []
    root = Path(next(iter(spec.submodule_search_locations))) / "data" / "english"
    out = []
    for path in sorted(root.glob("*.yml")):
        convs = (yaml.safe_load(path.read_text()) or {}).get("conversations") or []
        for ci, utts in enumerate(convs):
            group = f"cb:{path.stem}:{ci}"
            if group not in train_groups:
                continue
            for k in range(1, len(utts), 2):
                text = RP.normalise_asr_text(str(utts[k]))
                if 2 <= len(text.split()) <= 25 and not V.is_markup(str(utts[k])):
                    out.append(RP.Prompt(group, "chatterbot-reply", (), text))
    return out


def _generated_lines() -> list[RP.Prompt]:
    """The caller lines the turn-taking data generated (data/dialogue/turn_generated.jsonl)."""
    path = DATA_DIR / "turn_generated.jsonl"
    out = []
    if not path.is_file():
        return out
    for i, line in enumerate(path.read_text().splitlines()):
        row = json.loads(line)
        if row.get("finished") and row.get("text"):
            text = RP.normalise_asr_text(row["text"])
            if 2 <= len(text.split()) <= 30:
                out.append(RP.Prompt(f"gen:{i}", "generated", (), text))
    return out


def multi_turn_prompts(path: Path = TARGETS_FILE, seed: int = 0) -> list[DraftPrompt]:
    """Conversations (`dialogue.training.multi_turn`) chained from the single-turn prompts answered in `path`.

    Empty until the single-turn targets exist: `main` makes those first, then these.
    """
    from dialogue.training import multi_turn as M

    rows = [r for r in read_targets(path).values() if r.get("source") != M.SOURCE]
    return [DraftPrompt(p, split) for p, split in M.conversations(rows, seed=seed)]


def drafter_prompts(seed: int = 0, multi: bool = True) -> list[DraftPrompt]:
    """Every prompt with its split; held-out prompts of the relay eval are kept (to measure), never trained.

    With `multi`, the conversations of `multi_turn_prompts` too (built from the answered prompts).
    """
    base = RP.all_prompts(RP.DATA_SEED)
    splits = RP.split_groups([{"group": p.group} for p in base], seed)
    out: dict[str, DraftPrompt] = {}
    group_split = {}
    for split, idx in splits.items():
        for i in idx:
            dp = DraftPrompt(base[i], split)
            out.setdefault(dp.key, dp)
            group_split[base[i].group] = split
    train_groups = {g for g, s in group_split.items() if s == "train"}
    train_families = sorted(int(g.split(":")[1]) for g in train_groups if g.startswith("tpl:"))
    extra = (
        RP.fill_templates(RP.TEMPLATES, train_families, MORE_FILLS, seed + 1, source="tpl")
        + _assistant_lines_as_turns(train_groups)
        + _generated_lines()
        + RP.fill_templates(EXTRA_TEMPLATES, range(len(EXTRA_TEMPLATES)), 40, seed + 2, "extra", "extra")
    )
    heldout_texts = {dp.prompt.text.lower() for dp in out.values() if dp.split != "train"}
    for p in extra:
        dp = DraftPrompt(p, "train")
        out.setdefault(dp.key, dp)
    # the same words as a val / held-out prompt (with another history, or from another source) are
    # not trained on: the drafter would have seen the relay benchmark's question
    single = [dp for dp in out.values() if dp.split != "train" or dp.prompt.text.lower() not in heldout_texts]
    return single + (multi_turn_prompts(seed=seed) if multi else [])


# -- targets ------------------------------------------------------------------------------------


def read_targets(path: Path = TARGETS_FILE) -> dict[str, dict[str, Any]]:
    """Targets made so far, by prompt key (a torn last line from an interrupted run is ignored)."""
    out: dict[str, dict[str, Any]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            out[row["key"]] = row
    return out


def slow_answer(slow: Any, ids: Sequence[int], max_tokens: int = TARGET_TOKENS) -> tuple[list[int], bool]:
    """Greedy answer of a `train_verifier.WarmModel` after the chat `ids` (its warm cache is reset after)."""
    import torch

    from dialogue.fast_decoder import decoder_hidden

    cache = slow.cache_for(ids)
    out: list[int] = []
    ended = False
    try:
        with torch.inference_mode():
            step = list(ids[cache.get_seq_length() :])
            while len(out) < max_tokens:
                h = decoder_hidden(slow.model, step, cache)[:, -1]
                tok = int(torch.argmax(slow.model.lm_head(h)[0]))
                if tok in slow.stop_ids:
                    ended = True
                    break
                out.append(tok)
                step = [tok]
    finally:
        slow.reset()
    return out, ended


def load_slow_model(progress: bool = True) -> tuple[Any, str]:
    """The `cpu` profile's slow model as the service runs it (int8), warm with the service's system
    prompt (`train_verifier.WarmModel`), and that system prompt."""
    from dialogue import llm_weights
    from duplex.base.config import load_profile

    llm = load_profile("cpu").component("llm")
    system = str(llm.options.get("system_prompt", "")).strip()
    model, tok = llm_weights.load(llm, RF.DTYPE, progress=progress)
    return RF.WarmModel(model, tok, system, str(dict(llm.weights).get("name", "llm"))), system


def generate_targets(
    prompts: Sequence[DraftPrompt],
    path: Path = TARGETS_FILE,
    progress: bool = True,
    limit_s: float | None = None,
) -> int:
    """Make the missing targets (appending to `path`); returns how many were made."""
    from tqdm import tqdm

    have = read_targets(path)
    todo = [dp for dp in prompts if dp.key not in have]
    print(f"drafter targets: {len(have)} made, {len(todo)} to make -> {path}", file=sys.stderr)
    if not todo:
        return 0
    slow, system = load_slow_model(progress)
    tok = slow.tokenizer
    t0 = time.time()
    made = 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for dp in tqdm(todo, desc="slow-model answers", disable=not progress, smoothing=0.05):
            p = dp.prompt
            ids = V.chat_ids(tok, system, p.messages(), p.text)
            toks, ended = slow_answer(slow, ids)
            row = {
                "key": dp.key,
                "split": dp.split,
                "group": p.group,
                "source": p.source,
                "history": [list(h) for h in p.history],
                "text": p.text,
                "answer": tok.decode(toks, skip_special_tokens=True),
                "ended": ended,
                "n_tokens": len(toks),
            }
            f.write(json.dumps(row) + "\n")
            f.flush()
            made += 1
            if limit_s is not None and time.time() - t0 > limit_s:
                break
    return made


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    import torch

    ap = argparse.ArgumentParser(
        prog="python -m dialogue.training.drafter_data", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--minutes", type=float, default=None, help="stop after this long (rerun resumes)")
    ap.add_argument("--stats", action="store_true", help="only count prompts per split and source")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts = drafter_prompts(multi=False)
    counts: dict[str, int] = {}
    for dp in prompts:
        k = f"{dp.split}/{dp.prompt.source.split('/')[0]}"
        counts[k] = counts.get(k, 0) + 1
    print(f"prompts: {len(prompts)} {json.dumps(dict(sorted(counts.items())))}", file=sys.stderr)
    if args.stats:
        return 0
    # val and held-out first: the drafter's evaluation needs them however far training data gets
    order = sorted(prompts, key=lambda dp: dp.split == "train")
    t0 = time.time()
    generate_targets(order, limit_s=None if args.minutes is None else args.minutes * 60)
    # the conversations chain answered single-turn prompts: made once those exist
    left = None if args.minutes is None else args.minutes * 60 - (time.time() - t0)
    if left is None or left > 0:
        multi = sorted(multi_turn_prompts(), key=lambda dp: dp.split == "train")
        generate_targets(multi, limit_s=left)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
