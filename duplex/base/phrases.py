"""Cut a stream of LLM text deltas into phrases for TTS, identically however the text is split.

Every decision looks only at text already received, and a cut is made at the first position where
it becomes certain, so feeding the text char by char or all at once yields the same phrases.
A word is complete once whitespace follows it: trailing punctuation belongs to the word, and
"3.5", "U.S." or "Dr." are never cut in the middle (the next token nearly always brings the space).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: punctuation that ends a phrase when it ends a word (clause and sentence ends)
BOUNDARY = frozenset(",;:.!?…")
_CLOSERS = "\"')]}”’»"
_OPENERS = "\"'([{“‘«"
#: a period after these is not a sentence end (lowercase, without the period)
ABBREVIATIONS = frozenset(
    {"mr", "mrs", "ms", "dr", "prof", "st", "jr", "sr", "vs", "mt", "approx", "dept", "fig"}
)

#: words that open a phrase (prepositions, determiners, conjunctions, auxiliaries): a phrase cut for
#: length is moved back to before the last of them, so "The sky on | a clear day" is spoken
#: "The sky | on a clear day" and the join falls where a speaker would breathe, not inside a phrase
PHRASE_OPENERS = frozenset(
    """of in on at to for with from by about into over after before under between through during
    without than like the a an this that these those my your his her its our their some any each
    every and but or nor so because if when while which who whom whose where is are was were be
    been has have had will would can could should may might must do does did""".split()
)

# markdown the LLM may emit despite the prompt: emphasis and headings are dropped, `_` becomes a space
_MARKDOWN = str.maketrans({"*": None, "#": None, "`": None, "~": None, "•": None, "_": " "})
_TOKEN = re.compile(r"(\S+)(\s)")
_ALNUM = re.compile(r"\w")
_BULLET = re.compile(r"^[-–]\s+")  # "- item": a list bullet, which hibari would read as a pause


def _is_emoji(ch: str) -> bool:
    cp = ord(ch)
    return (
        0x1F000 <= cp <= 0x1FAFF  # emoticons, pictographs, flags, ...
        or 0x2600 <= cp <= 0x27BF  # misc symbols, dingbats
        or 0x2B00 <= cp <= 0x2BFF  # stars, arrows
        or 0xE0020 <= cp <= 0xE007F  # tag characters (subdivision flags)
        or cp in (0x200D, 0xFE0E, 0xFE0F, 0x20E3)  # joiners, variation selectors, keycap
    )


def clean_text(text: str) -> str:
    """Remove markdown-ish characters and emojis; works char by char, so it is split-invariant."""
    return "".join(ch for ch in text.translate(_MARKDOWN) if not _is_emoji(ch))


def _ends_phrase(token: str) -> bool:
    core = token.rstrip(_CLOSERS)
    if not core or core[-1] not in BOUNDARY:
        return False
    if core[-1] == ".":
        word = core[:-1].lstrip(_OPENERS)
        if word.lower() in ABBREVIATIONS:
            return False
        if len(word) == 1 and word.isupper() and word != "I":  # an initial: "J. K. Rowling"
            return False
        if "." in word and all(len(part) == 1 for part in word.split(".")):  # "U.S.", "e.g."
            return False
    return True


def _tidy(phrase: str) -> str:
    return _BULLET.sub("", " ".join(phrase.split()))


@dataclass
class PhraseState:
    """Text received but not yet spoken, and how many phrases this response has emitted."""

    pending: str = ""
    emitted: int = 0


class PhraseSegmenter:
    """Decides when a phrase is ready: at punctuation, or after `first_phrase_words` words for the first
    phrase and twice as many for each next one, up to `max_phrase_words`."""

    def __init__(self, first_phrase_words: int = 3, max_phrase_words: int = 12) -> None:
        if first_phrase_words < 1 or max_phrase_words < 1:
            raise ValueError("first_phrase_words and max_phrase_words must be >= 1")
        self.first_phrase_words = first_phrase_words
        self.max_phrase_words = max_phrase_words

    def init_state(self) -> PhraseState:
        return PhraseState()

    def _cut(self, text: str, emitted: int) -> int | None:
        """End index of the next phrase in `text` (leading whitespace stripped), or None if not ready."""
        # the first phrase after `first_phrase_words` words, then twice as many each time up to
        # `max_phrase_words` (3, 6, 12): the next phrase is ready before the short one before it has
        # played, so the audio does not wait for the LLM to write a long second phrase
        limit = min(self.max_phrase_words, self.first_phrase_words * 2 ** min(emitted, 8))
        words = 0
        ends: list[int] = []  # end index of each word so far
        opens: list[bool] = []  # whether each word opens a phrase
        for m in _TOKEN.finditer(text):
            token = m.group(1)
            if _ALNUM.search(token):
                words += 1
                ends.append(m.end(1))
                opens.append(token.strip(_OPENERS + _CLOSERS).lower() in PHRASE_OPENERS)
            # a phrase with no word (a stray "..." or "-") waits for the next word
            if words and (_ends_phrase(token) or m.group(2) == "\n"):
                return m.end(1)
            if words and words >= limit:
                # cut for length: before the last phrase opener in the second half (two words
                # at least before it), if any
                for k in range(words - 1, max(2, words // 2) - 1, -1):
                    if opens[k]:
                        return ends[k - 1]
                return m.end(1)
        return None

    def step(self, state: PhraseState, delta: str, final: bool = False) -> tuple[list[str], PhraseState]:
        """Add a text delta; return the phrases now ready (all the rest when `final`). State is not modified."""
        pending = state.pending + clean_text(delta)
        emitted = state.emitted
        phrases: list[str] = []
        while True:
            pending = pending.lstrip()
            end = self._cut(pending, emitted)
            if end is None:
                break
            phrases.append(_tidy(pending[:end]))
            emitted += 1
            pending = pending[end:]
        if final:
            rest = _tidy(pending)
            if _ALNUM.search(rest):  # punctuation or symbols alone are not worth synthesising
                phrases.append(rest)
                emitted += 1
            pending = ""
        return phrases, PhraseState(pending=pending, emitted=emitted)


def first_phrase_ready(text: str, done: bool, words: int = 3, max_words: int = 12) -> bool:
    """Whether an answer's text so far holds a first phrase the TTS would speak now: what
    `PhraseSegmenter` cuts (`words` complete words, or a clause / sentence end, a word being
    complete once whitespace follows it), or the whole answer when it is `done`.

    The session core waits for this before it speaks, and the dialogue engine's first step decodes
    until it holds, so the first audio waits neither for a fixed number of tokens nor for a phrase
    the TTS would not yet cut."""
    if done:
        return True
    segmenter = PhraseSegmenter(words, max_words)
    phrases, _ = segmenter.step(segmenter.init_state(), text)
    return bool(phrases)
