"""A known transcript spelled the way Moonshine's decoder would write it: its casing, its punctuation, its
tokens.

The training pool's texts are lower case without punctuation ("what is the capital of france"), while the
decoder writes "What is the capital of France?" in its own sentencepiece tokens, and the tokenizer that made
them is not packaged (only `tokenizer.bin`, id -> bytes). So the transcript is *decoded*, not encoded: greedy
decoding of the full-context frames in which each next token must continue the text, compared lower case with
punctuation ignored (`TextConstraint.allowed`), so the decoder chooses the case, the punctuation and the
split into tokens, and the words are the pool's. Where the full-context model hears the words right this is
its own transcript; where it does not, it is the closest one the decoder would write with the right words.
"""

from __future__ import annotations

import re
from collections import defaultdict

from asr.moonshine import _SPACE_MARK, EOS, N_SPECIAL

_KEEP = re.compile(r"[^a-z0-9' ]+")
#: the punctuation a token may have besides letters, digits, apostrophes and spaces (not compared)
SENTENCE_MARKS = set(".,?!;:")
#: at most this many punctuation-only tokens (marks or a bare space) in a row, so the constraint cannot loop
MAX_PUNCTUATION_RUN = 1


def normalise(text: str) -> str:
    """The compared form of a transcript: ' ' + lower-case words of letters, digits and apostrophes."""
    words = _KEEP.sub(" ", text.lower()).split()
    return " " + " ".join(words) if words else ""


class Spelling:
    """Moonshine's tokens as compared with a transcript: each usable token's lower-case form without
    punctuation (byte-fallback and non-ASCII tokens are left out: English words never need them)."""

    def __init__(self, tokens: list[bytes]) -> None:
        self.norm: dict[int, str] = {}
        by_norm: dict[str, list[int]] = defaultdict(list)
        punctuation: list[int] = []
        for i, raw in enumerate(tokens):
            if i < N_SPECIAL:
                continue
            try:
                written = raw.decode("utf-8").replace(_SPACE_MARK, " ")
            except UnicodeDecodeError:
                continue
            s = written.lower()
            if any(not (c.isascii() and (c.isalnum() or c in "' ")) and c not in SENTENCE_MARKS for c in s):
                continue  # quotes, brackets, dashes: a decoder forced off its own word reaches for them
            letters = [c for c in written if c.isalpha()]
            if any(c.isupper() for c in letters[1:]) or (letters and letters[0].isupper() and s[:1] != " "):
                continue  # capitals only to start a word: not "ER" in "FarmER" (nor acronyms)
            n = "".join(c for c in s if c not in SENTENCE_MARKS)
            self.norm[i] = n
            if s and all(c in SENTENCE_MARKS for c in s):
                punctuation.append(i)  # "," or "?": written freely, compared as nothing
            else:
                by_norm[n].append(i)  # a piece of a word, or a bare space
        self.by_norm = dict(by_norm)
        self.punctuation = punctuation
        self.longest = max(len(k) for k in self.by_norm)

    def is_word(self, i: int) -> bool:
        """Whether token `i` writes part of a word (not only a mark or a space)."""
        return bool(self.norm.get(i, "").strip(" "))

    def written(self, ids: list[int]) -> str:
        """The compared form of what `ids` write (runs of spaces as one)."""
        return re.sub(" +", " ", "".join(self.norm.get(i, "") for i in ids))

    def constraint(self, text: str) -> TextConstraint:
        return TextConstraint(self, text)


class TextConstraint:
    """Which of Moonshine's tokens may come next so that the transcript goes on spelling `text`."""

    def __init__(self, spelling: Spelling, text: str) -> None:
        self.spelling = spelling
        self.target = normalise(text)

    def allowed(self, ids: list[int]) -> list[int]:
        """Tokens after `ids` that keep the transcript a spelling of the text (EOS once it is all written)."""
        sp, done = self.spelling, self.spelling.written(ids)
        if self.target.startswith(done):
            rest = self.target[len(done) :]
        elif done.endswith(" ") and done[:-1] == self.target:
            rest = ""  # the text is written; a punctuation token's space ended it
        else:
            return []
        out: list[int] = []
        for k in range(1, min(len(rest), sp.longest) + 1):
            out.extend(sp.by_norm.get(rest[:k], ()))
        run = 0
        for i in reversed(ids):
            if sp.is_word(i):
                break
            run += 1
        if run < MAX_PUNCTUATION_RUN:
            if not rest or rest.startswith(" ") or done.endswith(" "):
                # between words only: inside one, a decoder forced off its own word would spell it out
                # letter by letter ("s-p-a-i-n"); so "getup" is written so, not "get-up"
                out.extend(sp.punctuation)
        if not rest.strip(" "):
            out.append(EOS)
        return out


def forced_ids(model, spelling: Spelling, hidden, n_samples: int, text: str) -> list[int] | None:
    """Token ids (no BOS/EOS) of `text` as Moonshine's decoder spells it from these frames; None where the text
    is empty or cannot be spelled with its tokens."""
    constraint = spelling.constraint(text)
    if not constraint.target:
        return None
    ids = model.decode_frames_constrained(hidden, n_samples, constraint.allowed)
    if ids is None or normalise(spelling.written(ids)) != constraint.target:
        return None
    return ids
