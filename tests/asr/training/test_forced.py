"""A known transcript spelled as Moonshine's decoder would write it (asr/training/forced.py): the constraint
lets the decoder choose case, punctuation and token split, never the words."""

from __future__ import annotations

import numpy as np
import pytest

from asr.moonshine import EOS
from asr.training.forced import Spelling, forced_ids, normalise

M = "\u2581"
VOCAB = [b"<unk>", b"<s>", b"</s>"] + [
    t.encode()
    for t in [f"{M}What", f"{M}what", f"{M}is", "?", f"{M}the", f"{M}cap", "ital", f"{M}capital", ",",
              f"{M}of", f"{M}France", f"{M}Fr", "ance", f"{M}(", "\u4e2d", f"{M}whatever"]
]  # fmt: skip
ID = {t.decode(): i for i, t in enumerate(VOCAB)}


class PreferenceModel:
    """Stands in for Moonshine: greedy over fixed per-token scores, restricted to the allowed tokens."""

    def __init__(self, scores: dict[int, float], after: dict[int, dict[int, float]]) -> None:
        self.tokens = VOCAB
        self.scores, self.after = scores, after  # after[last token][token]: scores in that context

    def decode_frames_constrained(self, hidden, n_samples, allowed):
        ids: list[int] = []
        while len(ids) < 40:
            ok = list(allowed(ids))
            if not ok:
                return None
            context = self.after.get(ids[-1] if ids else -1, {})
            best = max(ok, key=lambda i: context.get(i, self.scores.get(i, 0.0)))
            if best == EOS:
                return ids
            ids.append(best)
        return ids


def test_normalise_keeps_words_only():
    assert normalise("What is the capital of France?") == " what is the capital of france"
    assert normalise("  don't  (stop), NOW ") == " don't stop now"
    assert normalise("?!") == ""


def test_the_constraint_allows_spellings_of_the_next_words_and_eos_at_the_end():
    sp = Spelling(VOCAB)
    c = sp.constraint("what is the capital of france")
    first = set(c.allowed([]))
    assert {ID[f"{M}What"], ID[f"{M}what"]} <= first and EOS not in first
    assert ID[f"{M}whatever"] not in first and ID["\u4e2d"] not in first  # other words, non-ASCII
    assert ID[f"{M}is"] not in first
    after_the = set(c.allowed([ID[f"{M}What"], ID[f"{M}is"], ID[f"{M}the"]]))
    assert {ID[f"{M}capital"], ID[f"{M}cap"], ID[","]} <= after_the and ID[f"{M}("] not in after_the
    assert ID["ital"] in c.allowed([ID[f"{M}What"], ID[f"{M}is"], ID[f"{M}the"], ID[f"{M}cap"]])
    done = [ID[t] for t in (f"{M}What", f"{M}is", f"{M}the", f"{M}capital", f"{M}of", f"{M}Fr", "ance")]
    assert EOS in c.allowed(done) and ID["?"] in c.allowed(done)
    # punctuation is free but bounded: one mark at a time
    assert ID[","] not in c.allowed(done + [ID["?"]])
    # punctuation goes between words, never inside one
    assert ID[","] not in c.allowed([ID[f"{M}What"], ID[f"{M}is"], ID[f"{M}the"], ID[f"{M}cap"]])
    # a wrong word is never allowed to continue
    assert c.allowed([ID[f"{M}whatever"]]) == []


def test_the_decoder_chooses_case_punctuation_and_split():
    sp = Spelling(VOCAB)
    prefer = {ID[f"{M}What"]: 2.0, ID[f"{M}what"]: 1.0, ID[f"{M}capital"]: 1.0, ID[f"{M}Fr"]: 1.5}
    prefer.update({ID["?"]: -1.0, ID[","]: -1.0, ID[f"{M}("]: -1.0, EOS: -1.0})
    model = PreferenceModel(prefer, {ID["ance"]: {ID["?"]: 3.0}, ID["?"]: {EOS: 1.0}})
    ids = forced_ids(model, sp, np.zeros((1, 10, 416)), 16000, "what is the capital of france")
    assert ids is not None
    text = b"".join(VOCAB[i] for i in ids).decode().replace(M, " ")
    assert text == " What is the capital of France?"
    # a text the vocabulary cannot spell is refused, not approximated
    assert forced_ids(model, sp, np.zeros((1, 10, 416)), 16000, "what is zebra") is None
    assert forced_ids(model, sp, np.zeros((1, 10, 416)), 16000, "?") is None


@pytest.mark.integration
def test_moonshine_spells_a_heard_question_as_it_would_write_it():
    from asr.moonshine import MoonshineModel, decode_tokens
    from tests.speech import silence, synthesize

    model = MoonshineModel(threads=1)
    audio = np.concatenate([silence(0.2), synthesize("What is the capital of France?"), silence(0.3)])
    hidden = model._encoder.run(None, {"input_values": audio[None, :]})[0]
    heard = model.decode_frames(hidden, audio.size)
    ids = forced_ids(model, Spelling(model.tokens), hidden, audio.size, "what is the capital of france")
    assert ids == heard  # heard right: the spelling is its own transcript
    ids = forced_ids(model, Spelling(model.tokens), hidden, audio.size, "what is the capital of spain")
    # audio that says otherwise: still the text's words, whatever the decoder's marks and spaces
    assert ids is not None and normalise(decode_tokens(model.tokens, ids)) == " what is the capital of spain"
