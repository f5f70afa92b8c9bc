"""What the caller said about themselves, restated for the slow model when they ask it back.

Small chat models mix up whose fact is whose: after "My dog is called Max." the question "What is my
dog called?" comes back as "My dog is called Max." or "You're Max!". Rewriting the caller's first-person
statements in the third person ("their dog is called Max") and adding them to a later question about the
caller removes the pronoun the model trips over. The note is appended to that user message as the slow
model reads it, computed only from the messages before it, so a conversation always renders the same way
(the KV cache is never rolled back for it) and a note costs its ~20 tokens once.

Even with the note, a 0.5B model answers "What is my sister called?" with "You are Clara." and "In which
month was I born?" with "In March.": it knows the fact but not whose it is. `answer_lead` gives the
answer's first words when a question asks about a fact the caller stated ("Your sister", "You were
born"), and the engine makes the slow model's answer start with them, so the rest says the fact about
the right person.

Pure text: no model, no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

# first-person statements -> third person ("their ...", "they ..."); the object is cut at the first
# clause break, and a statement that is a question is not a fact
_WORD = r"[a-z][a-z'-]*"
_OBJ = r"([^.,;!?]+?)"
_END = r"(?=\s*(?:[.,;!?]|\band\b|\bbut\b|$))"
_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p, re.IGNORECASE), t)
    for p, t in (
        (rf"\bmy name(?:'s| is) {_OBJ}{_END}", "their name is {0}"),
        (rf"\b(?:i am|i'm) called {_OBJ}{_END}", "their name is {0}"),
        (rf"\bcall me {_OBJ}{_END}", "their name is {0}"),
        (rf"\bmy ({_WORD}(?: {_WORD})?) (?:is|are) (called|named) {_OBJ}{_END}", "their {0} is {1} {2}"),
        (rf"\bmy ({_WORD}(?: {_WORD})?)(?:'s| is| are) (?!called\b|named\b){_OBJ}{_END}", "their {0} is {1}"),
        (rf"\bmy ({_WORD}) ((?!is\b|was\b){_WORD}s) {_OBJ}{_END}", "their {0} {1} {2}"),
        (rf"\bi was born (in|on|at) {_OBJ}{_END}", "they were born {0} {1}"),
        (rf"\bi live in {_OBJ}{_END}", "they live in {0}"),
        (rf"\b(?:i am|i'm|i come) from {_OBJ}{_END}", "they are from {0}"),
        (rf"\bi work (as|at|for|in) {_OBJ}{_END}", "they work {0} {1}"),
        (rf"\b(?:i am|i'm) (an? {_WORD}(?: {_WORD})?){_END}", "they are {0}"),
        (rf"\b(?:i am|i'm) (\d+|{_WORD}) years old{_END}", "they are {0} years old"),
        (rf"\bi have {_OBJ}{_END}", "they have {0}"),
        (rf"\bi (like|love|hate|play|speak|drive|study) {_OBJ}{_END}", "they {0} {1}"),
    )
)
# "I'm Tom": a capitalised word after "I am" is a name (case-sensitive, unlike the patterns above)
_NAME = re.compile(r"\b(?:I am|I'm) ([A-Z][a-z]+)(?=\s*(?:[.,;!?]|\band\b|$))")
_PRONOUNS = {"my": "their", "me": "them", "i": "they", "mine": "theirs", "myself": "themselves"}
_ABOUT_CALLER = re.compile(r"\b(?:my|mine|me|i|i'm|am i|do i|did i|have i)\b", re.IGNORECASE)
# a question without its question mark (the ASR often ends one with a comma or nothing): it opens with
# a question word or an auxiliary, after at most a preposition ("In which month was I born,")
_ASKS = re.compile(
    r"^\W*(?:(?:in|on|at|from|for|to|with|and|so|then|but) )?(?:what|what's|which|where|when|who|who's|whose|"
    r"how|why|do|does|did|am|is|are|was|were|can|could|will|would|have|has|tell me|remind me)\b",
    re.IGNORECASE,
)
#: at most this many facts in a note (the newest), so a long call does not grow every question
MAX_FACTS = 6


def caller_facts(text: str) -> list[str]:
    """The caller's statements about themselves in `text`, in the third person ("their dog is called
    Max", "they live in Boston"); none for a question."""
    out: list[str] = []
    for sentence in re.split(r"(?<=[.!?])\s+", text.strip()):
        if is_question(sentence):
            continue
        taken: list[tuple[int, int]] = []
        for pattern, template in _PATTERNS:
            for m in pattern.finditer(sentence):
                if any(a < m.end() and m.start() < b for a, b in taken):
                    continue  # one fact per stretch of words: the first (most specific) pattern wins
                groups = [_third_person(g.strip()) for g in m.groups()]
                if not all(groups):
                    continue
                taken.append(m.span())
                fact = template.format(*groups)
                if fact not in out:
                    out.append(fact)
        for m in _NAME.finditer(sentence):
            if not any(a < m.end() and m.start() < b for a, b in taken):
                out.append(f"their name is {m[1]}")
    return out


def _third_person(words: str) -> str:
    return re.sub(r"\b(my|me|i|mine|myself)\b", lambda m: _PRONOUNS[m[1].lower()], words, flags=re.IGNORECASE)


def is_question(text: str) -> bool:
    """Ends with a question mark, or reads as a question ("In which month was I born,")."""
    return text.rstrip().endswith("?") or bool(_ASKS.search(text))


def asks_about_caller(text: str) -> bool:
    """A question that mentions the caller ("What is my name?", "Where do I live?")."""
    return is_question(text) and bool(_ABOUT_CALLER.search(text))


# "my sister", "my favourite colour": the caller's thing a question asks about
_MY_THING = re.compile(rf"\bmy ({_WORD}(?: {_WORD})?)", re.IGNORECASE)
# a question about what the caller does or is, and the fact (in the third person) that answers it
_I_VERBS: tuple[tuple[re.Pattern[str], str, str], ...] = tuple(
    (re.compile(q, re.IGNORECASE), fact, lead)
    for q, fact, lead in (
        (r"\b(?:was|were) i born\b", "they were born ", "You were born"),
        (r"\b(?:do|did) i live\b", "they live in ", "You live in"),
        (r"\bdo i have\b", "they have ", "You have"),
        (r"\bam i from\b|\bdo i come from\b", "they are from ", "You are from"),
        (r"\bhow old am i\b", "they are ", "You are"),
        (r"\bwhat do i do\b|\bmy (?:job|work)\b", "they work ", "You work"),
        (r"\bwhat do i do\b|\bmy (?:job|work)\b", "they are a", "You are"),
    )
)


def answer_lead(messages: Sequence[Mapping[str, str]]) -> str | None:
    """The first words of the answer to the last message when it asks about a fact the caller stated
    earlier ("What is my sister called?" after "My sister is called Clara." -> "Your sister"; "In which
    month was I born?" -> "You were born"); None otherwise."""
    if not messages or messages[-1].get("role") != "user":
        return None
    question = str(messages[-1].get("content") or "")
    if not is_question(question):
        return statement_lead(question)
    if not asks_about_caller(question):
        return None
    facts: list[str] = []
    for m in messages[:-1]:
        if m.get("role") == "user" and isinstance(m.get("content"), str):
            facts.extend(caller_facts(m["content"]))
    if not facts:
        return None
    for pattern, fact_start, lead in _I_VERBS:
        if pattern.search(question) and any(f.startswith(fact_start) for f in facts):
            return lead
    for m in _MY_THING.finditer(question):
        words = m[1].lower().split()
        for i, w in enumerate(words):  # "my wife's name": the thing is the wife
            if w.endswith("'s"):
                words = [*words[:i], w[:-2]]
                break
        # the longest "their <thing>" a fact starts with: "my favourite colour" before "my favourite"
        for k in range(len(words), 0, -1):
            thing = " ".join(words[:k])
            if any(f.startswith(f"their {thing} ") for f in facts):
                return f"Your {thing}"
    return None


#: a statement longer than this is more than a fact to confirm ("I have a headache and I need ...")
STATEMENT_WORDS = 8


def statement_lead(text: str) -> str | None:
    """The first words of the acknowledgement of a short statement of the caller's own facts, which
    confirms whose they are: "My sister is called Clara." -> "Got it, your sister" ("You are Clara."
    before); "I live in Boston." -> "Got it, you live". None for anything else."""
    words = re.findall(r"[\w']+", text)
    if not words or len(words) > STATEMENT_WORDS or is_question(text):
        return None
    facts = caller_facts(text)
    if not facts:
        return None
    fact = facts[0]
    if fact.startswith("their "):
        m = re.match(r"their (.+?) (?:is|are|[a-z]+s)\b", fact)
        return f"Got it, your {m[1]}" if m else None
    first = fact.split()[:2]  # "they live ..." -> "you live"
    return f"Got it, you {first[1]}" if len(first) == 2 and first[0] == "they" else None


def note_for(facts: Sequence[str]) -> str:
    return f" (The caller told you earlier: {'; '.join(facts[-MAX_FACTS:])}. Answer them with 'your'.)"


def with_caller_notes(messages: Sequence[Mapping[str, str]]) -> list[dict[str, str]]:
    """`messages` with a note of the caller's earlier facts appended to each user question about the
    caller; the rest unchanged. A message's note depends only on the messages before it."""
    facts: list[str] = []
    out: list[dict[str, str]] = []
    for m in messages:
        msg = dict(m)
        if msg.get("role") == "user" and isinstance(msg.get("content"), str):
            text = msg["content"]
            if facts and asks_about_caller(text):
                msg["content"] = text.rstrip() + note_for(facts)
            for fact in caller_facts(text):
                if fact in facts:
                    facts.remove(fact)
                facts.append(fact)
        out.append(msg)
    return out
