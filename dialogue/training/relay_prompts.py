"""The prompt corpus of the relay recipes: chatterbot conversations and template families as
`Prompt`s (group, source, history, text), split by conversation group so no family is on both sides."""

from __future__ import annotations

import glob
import importlib.util
import itertools
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: assistant history longer than this is cut (chatterbot's coding answers hold whole programs)
HISTORY_CHARS = 300


SPLITS = (("train", 0.60), ("val", 0.20), ("heldout", 0.20))


#: the prompt set is fixed (template fills, --limit sample); --seed only changes the split and training
DATA_SEED = 0


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
    (
        "What time does the {place} {open} {day}",
        {
            "place": [
                "pharmacy",
                "post office",
                "bank",
                "library",
                "supermarket",
                "gym",
                "dentist's office",
                "hardware store",
                "museum",
                "swimming pool",
            ],
            "open": ["open", "close"],
            "day": ["today", "tomorrow", "on Sunday", "on Saturday", "tonight"],
        },
    ),
    (
        "Can you book me a table for {n} at {restaurant} {when}",
        {
            "n": ["two", "four", "six", "three"],
            "restaurant": [
                "an Italian place",
                "the sushi bar downtown",
                "a vegan restaurant",
                "Luigi's",
                "a steakhouse nearby",
            ],
            "when": ["tonight at eight", "tomorrow for lunch", "on Friday evening", "this weekend"],
        },
    ),
    (
        "I'd like to {action} my appointment {when}",
        {
            "action": ["cancel", "reschedule", "confirm", "move"],
            "when": [
                "with doctor Patel",
                "on Thursday",
                "for next week",
                "at the dentist",
                "for tomorrow morning",
            ],
        },
    ),
    (
        "What's the weather going to be like {when} in {city}",
        {
            "when": ["tomorrow", "this weekend", "tonight", "on Monday"],
            "city": ["London", "Paris", "Chicago", "Tokyo", "Sydney", "Berlin", "Toronto", "Madrid"],
        },
    ),
    (
        "How do I {task}",
        {
            "task": [
                "reset my router",
                "change a flat tire",
                "boil an egg",
                "unclog a sink",
                "make pancakes",
                "tie a tie",
                "get a stain out of a shirt",
                "back up my phone",
                "jump start a car",
                "fix a squeaky door",
                "clean a cast iron pan",
                "plant tomatoes",
                "lower my electricity bill",
                "fall asleep faster",
                "improve my credit score",
                "learn to swim as an adult",
            ]
        },
    ),
    (
        "Why is my {thing} {problem}",
        {
            "thing": ["bill", "phone", "internet", "car", "fridge", "package", "account", "heating"],
            "problem": [
                "so high this month",
                "not working",
                "making a strange noise",
                "late",
                "blocked",
                "slow today",
            ],
        },
    ),
    (
        "I was charged twice for {item} can you {fix}",
        {
            "item": ["my last order", "the same subscription", "my hotel room", "a pizza", "my phone bill"],
            "fix": ["help me", "refund one of them", "check what happened", "fix that"],
        },
    ),
    (
        "Where is my {order} {it}",
        {
            "order": ["order", "package", "refund", "replacement card", "delivery"],
            "it": [
                "it was supposed to arrive yesterday",
                "I ordered it two weeks ago",
                "",
                "it says delivered",
            ],
        },
    ),
    (
        "What's the difference between {a} and {b}",
        {
            "a": [
                "a crocodile",
                "weather",
                "a virus",
                "baking soda",
                "a debit card",
                "an ocean",
                "a credit union",
            ],
            "b": ["an alligator", "climate", "bacteria", "baking powder", "a credit card", "a sea", "a bank"],
        },
    ),
    (
        "Who {did} {what}",
        {
            "did": ["invented", "discovered", "wrote", "painted"],
            "what": [
                "the telephone",
                "penicillin",
                "Romeo and Juliet",
                "the Mona Lisa",
                "gravity",
                "the light bulb",
                "Pride and Prejudice",
                "the theory of relativity",
            ],
        },
    ),
    (
        "How {adj} is {thing}",
        {
            "adj": ["far", "big", "old", "tall", "hot"],
            "thing": [
                "the moon",
                "the Eiffel Tower",
                "Mount Everest",
                "the sun",
                "the Great Wall of China",
                "the Pacific Ocean",
            ],
        },
    ),
    (
        "Can you recommend a good {thing} {for_}",
        {
            "thing": ["book", "movie", "podcast", "restaurant", "board game", "hiking trail", "recipe"],
            "for_": ["for a rainy day", "for my kids", "to relax", "for a first date", "for beginners", ""],
        },
    ),
    (
        "Set a {kind} for {when}",
        {
            "kind": ["reminder", "timer", "alarm"],
            "when": [
                "ten minutes",
                "seven am tomorrow",
                "my mom's birthday",
                "the meeting at three",
                "half an hour",
                "noon",
            ],
        },
    ),
    (
        "Remind me to {task} {when}",
        {
            "task": [
                "call my sister",
                "take my medicine",
                "buy milk",
                "pay the rent",
                "water the plants",
                "pick up the kids",
            ],
            "when": ["tonight", "in an hour", "tomorrow morning", "on Friday"],
        },
    ),
    (
        "What's {a} {op} {b}",
        {
            "a": ["twelve", "fifteen", "seven", "a hundred", "thirty six"],
            "op": ["times", "plus", "divided by", "minus"],
            "b": ["four", "nine", "three", "twelve"],
        },
    ),
    (
        "How do you say {phrase} in {lang}",
        {
            "phrase": ["thank you", "good morning", "where is the station", "I love you", "cheers"],
            "lang": ["Spanish", "French", "German", "Italian", "Japanese"],
        },
    ),
    (
        "Is it safe to {thing}",
        {
            "thing": [
                "eat raw cookie dough",
                "fly while pregnant",
                "leave my phone charging overnight",
                "drink tap water in Mexico",
                "swim after eating",
                "take ibuprofen with coffee",
                "give my dog grapes",
                "use my card abroad",
            ]
        },
    ),
    (
        "I {feel} {why}",
        {
            "feel": ["feel really stressed", "am so bored", "can't sleep", "feel lonely", "am nervous"],
            "why": ["today", "about my exam tomorrow", "lately", "about my job interview", "at night"],
        },
    ),
    (
        "Tell me {what}",
        {
            "what": [
                "a joke",
                "a fun fact",
                "something interesting",
                "a short story",
                "a riddle",
                "about yourself",
                "about black holes",
                "about the Roman empire",
                "a joke about cats",
                "the news",
                "what you can do",
                "something to cheer me up",
            ]
        },
    ),
    (
        "Do you know {what}",
        {
            "what": [
                "any good jokes",
                "what day it is",
                "how to cook rice",
                "who won the world cup",
                "what a blockchain is",
                "my name",
                "the capital of Australia",
                "how old you are",
            ]
        },
    ),
    (
        "My {device} {problem} what should I do",
        {
            "device": ["laptop", "phone", "printer", "TV", "washing machine", "car battery", "wifi"],
            "problem": ["keeps restarting", "won't turn on", "is really slow", "is beeping", "died"],
        },
    ),
    (
        "Can I {do} {thing}",
        {
            "do": ["change", "upgrade", "pause", "cancel", "transfer"],
            "thing": [
                "my plan",
                "my flight",
                "my subscription",
                "my membership",
                "my reservation",
                "my phone number",
            ],
        },
    ),
    (
        "How much does it cost to {thing}",
        {
            "thing": [
                "ship a package to Canada",
                "replace a phone screen",
                "rent a car for a week",
                "get a passport",
                "fly to New York",
                "fix a broken window",
                "adopt a cat",
            ]
        },
    ),
    (
        "I need directions to {place}",
        {
            "place": [
                "the nearest hospital",
                "the airport",
                "the train station",
                "a gas station",
                "the city center",
                "the closest ATM",
            ]
        },
    ),
    (
        "{greet}",
        {
            "greet": [
                "Hi there",
                "Hello",
                "Hey how's it going",
                "Good morning",
                "Good evening",
                "Hi can you hear me",
                "Hello is anyone there",
                "Thanks a lot",
                "Thank you so much",
                "Okay bye",
                "Goodbye",
                "See you later",
                "That's all for now",
                "Yes please",
                "No thanks",
                "Sorry what did you say",
                "Can you repeat that",
                "Wait",
                "Never mind",
                "Okay",
                "Sure",
                "Hmm",
                "Yeah",
                "Perfect thanks",
                "Got it",
            ]
        },
    ),
    (
        "What is {thing}",
        {
            "thing": [
                "photosynthesis",
                "inflation",
                "a mortgage",
                "machine learning",
                "the speed of light",
                "a black hole",
                "the stock market",
                "yoga",
                "a haiku",
                "cryptocurrency",
                "DNA",
                "the meaning of life",
                "your name",
                "a good name for a dog",
                "a healthy breakfast",
            ]
        },
    ),
    (
        "Should I {a} or {b}",
        {
            "a": ["take the bus", "buy a new phone", "rent", "learn Spanish", "go running"],
            "b": ["drive", "repair my old one", "buy a house", "learn French", "go swimming"],
        },
    ),
    (
        "Could you {verb} {obj} for me",
        {
            "verb": ["call", "text", "email", "find", "order"],
            "obj": ["a taxi", "my boss", "a pizza", "the plumber", "a cheap flight", "my doctor"],
        },
    ),
    (
        "I want to {goal}",
        {
            "goal": [
                "lose some weight",
                "learn to play guitar",
                "start a small business",
                "travel to Japan",
                "save money",
                "speak to a human",
                "file a complaint",
                "return this jacket",
                "open a bank account",
                "plan a birthday party",
            ]
        },
    ),
    (
        "When is {event}",
        {
            "event": [
                "the next full moon",
                "Thanksgiving this year",
                "the next train to Boston",
                "my next payment due",
                "the best time to visit Italy",
                "sunset tonight",
            ]
        },
    ),
    (
        "Is there a {place} near {where}",
        {
            "place": ["pharmacy", "good coffee shop", "parking garage", "vet", "laundromat", "bike shop"],
            "where": ["here", "the station", "my hotel", "Main Street", "the park"],
        },
    ),
    (
        "Can you explain {topic} {how}",
        {
            "topic": [
                "how vaccines work",
                "what a recession is",
                "quantum computing",
                "how tides work",
                "compound interest",
                "how an engine works",
                "why the sky is blue",
                "how wifi works",
            ],
            "how": ["simply", "in one sentence", "like I'm five", "", "quickly"],
        },
    ),
    (
        "What are the symptoms of {illness}",
        {
            "illness": [
                "the flu",
                "a cold",
                "dehydration",
                "a migraine",
                "food poisoning",
                "strep throat",
                "a concussion",
                "diabetes",
                "burnout",
                "an allergy",
            ]
        },
    ),
    (
        "How long does it take to {thing}",
        {
            "thing": [
                "boil an egg",
                "drive from Boston to New York",
                "get a new passport",
                "learn Spanish",
                "charge an electric car",
                "recover from a cold",
                "bake bread",
                "get to the airport",
                "walk a mile",
                "cook rice",
                "heal a sprained ankle",
                "get a refund",
            ]
        },
    ),
    (
        "I'm calling about {topic}",
        {
            "topic": [
                "my bill",
                "the job opening",
                "my order",
                "an appointment",
                "the apartment for rent",
                "a lost package",
                "my car repair",
                "my insurance claim",
                "the noise complaint",
                "my daughter's school trip",
            ]
        },
    ),
    (
        "What do you think about {topic}",
        {
            "topic": [
                "electric cars",
                "working from home",
                "social media",
                "pineapple on pizza",
                "remote schools",
                "the new iPhone",
                "video games",
                "nuclear power",
                "cats",
                "the weather lately",
                "artificial intelligence",
                "jazz music",
            ]
        },
    ),
    (
        "Can you help me with {thing}",
        {
            "thing": [
                "my homework",
                "a recipe",
                "my resume",
                "a gift idea for my dad",
                "my taxes",
                "a password reset",
                "planning a wedding",
                "a math problem",
                "writing an email",
                "choosing a laptop",
                "my budget",
                "a crossword clue",
            ]
        },
    ),
    (
        "Please {verb} me to {dept}",
        {
            "verb": ["transfer", "connect", "put"],
            "dept": [
                "billing",
                "customer service",
                "a manager",
                "technical support",
                "sales",
                "the front desk",
                "someone who speaks Spanish",
                "the pharmacy",
            ],
        },
    ),
    (
        "What should I cook for {meal} {constraint}",
        {
            "meal": ["dinner", "lunch", "breakfast", "a party"],
            "constraint": [
                "tonight",
                "with chicken and rice",
                "that's vegetarian",
                "in twenty minutes",
                "for my kids",
                "on a budget",
            ],
        },
    ),
    (
        "Which is better {a} or {b}",
        {
            "a": ["coffee", "an iPhone", "running", "Netflix", "a gas stove", "renting a car"],
            "b": [
                "tea",
                "an Android phone",
                "cycling",
                "Disney Plus",
                "an induction stove",
                "taking the train",
            ],
        },
    ),
    (
        "How many {small} are in a {big}",
        {
            "small": ["ounces", "grams", "days", "minutes", "feet", "cups", "seconds"],
            "big": ["pound", "kilogram", "year", "mile", "gallon", "day", "week"],
        },
    ),
    (
        "Who is {person}",
        {
            "person": [
                "Taylor Swift",
                "the president of France",
                "Albert Einstein",
                "Serena Williams",
                "the richest person in the world",
                "Frida Kahlo",
                "Elon Musk",
                "your creator",
                "Marie Curie",
                "the prime minister of Canada",
                "Lionel Messi",
                "Nelson Mandela",
            ]
        },
    ),
    (
        "Can you check {what}",
        {
            "what": [
                "my account balance",
                "if my payment went through",
                "the status of my order",
                "when my contract ends",
                "my data usage",
                "if there is an outage in my area",
                "my last bill",
                "the traffic on the highway",
                "train delays",
                "my flight status",
                "if the store has this in stock",
                "my points balance",
            ]
        },
    ),
    (
        "I think I {problem}",
        {
            "problem": [
                "left my wallet in the taxi",
                "broke my toe",
                "got scammed",
                "missed my flight",
                "locked myself out",
                "sent money to the wrong person",
                "have a flat tire",
                "forgot my password",
                "ate something bad",
                "lost my keys",
                "overpaid my bill",
                "sprained my wrist",
            ]
        },
    ),
    (
        "Is {place} open on {holiday}",
        {
            "place": ["the bank", "the post office", "Walmart", "the library", "the DMV"],
            "holiday": [
                "Christmas Day",
                "New Year's Day",
                "Easter Monday",
                "Labor Day",
                "the fourth of July",
            ],
        },
    ),
]


#: short exchanges: (first user turn, assistant reply, follow-up) families; history is the first two
FOLLOW_UPS: list[tuple[str, str, list[str]]] = [
    (
        "I'd like to book a table for tonight",
        "Sure, for how many people?",
        ["four people", "just me and my wife", "six at around eight", "two please", "how many can you fit"],
    ),
    (
        "I need a taxi",
        "Of course. Where should it pick you up?",
        [
            "at the central station",
            "from my home address",
            "outside the cinema",
            "can it come in ten minutes",
        ],
    ),
    (
        "What's the weather like tomorrow",
        "Tomorrow looks sunny with a high of twenty degrees.",
        ["and on Sunday", "should I bring an umbrella", "what about the evening", "great thanks"],
    ),
    (
        "I lost my credit card",
        "I'm sorry to hear that. Would you like me to block it now?",
        [
            "yes please block it",
            "no I think I'll find it",
            "how long does a new one take",
            "what happens next",
        ],
    ),
    (
        "Can you tell me a joke",
        "Why did the scarecrow win an award? Because he was outstanding in his field.",
        ["that's funny tell me another", "I don't get it", "haha good one", "one about dogs please"],
    ),
    (
        "My internet is down",
        "Let's fix that. Have you tried restarting the router?",
        ["yes twice already", "no how do I do that", "where is the router", "it's still not working"],
    ),
    (
        "I want to cancel my subscription",
        "I can help with that. May I ask why you'd like to cancel?",
        ["it's too expensive", "I don't use it anymore", "I found a better deal", "just cancel it please"],
    ),
    (
        "Who wrote Hamlet",
        "Hamlet was written by William Shakespeare.",
        ["when did he write it", "what else did he write", "is it a tragedy", "where was he born"],
    ),
    (
        "Can you help me plan a trip",
        "I'd love to. Where are you thinking of going?",
        ["somewhere warm in December", "Italy for a week", "I don't know yet", "a weekend in the mountains"],
    ),
    (
        "I need to see a doctor",
        "I can help you find one. Is it urgent?",
        ["yes I have a high fever", "no just a checkup", "kind of my back hurts", "I'm not sure"],
    ),
]


def fill_templates(
    templates: Sequence[tuple[str, dict[str, list[str]]]],
    families: Iterable[int],
    per_family: int,
    seed: int,
    tag: str = "tpl",
    source: str = "template",
) -> list[Prompt]:
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


def is_corpus_debris(history: Iterable[Any], text: str) -> bool:
    """A prompt made from a malformed chatterbot entry: trivia.yml's 14th conversation is one string,
    not a list of lines, and the corpus readers walk it one character at a time ("h", "a", "-", ...).
    Its prompts keep their place in the splits (a reader that skipped them would move every split and
    every conversation chained from the answered prompts, so the shipped data and weights could no
    longer be rebuilt), all held out; they are never written as evaluation prompts."""
    users = [text] + [
        m["content"] if isinstance(m, Mapping) else m[1]
        for m in history
        if (m["role"] if isinstance(m, Mapping) else m[0]) == "user"
    ]
    return any(len(str(u).strip()) <= 1 for u in users)
