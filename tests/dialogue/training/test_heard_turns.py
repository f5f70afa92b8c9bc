"""Turn-taking examples as the ASR hears them (dialogue/training/heard_turns.py)."""

from __future__ import annotations

import json

import pytest

from dialogue.training import heard_turns as H
from dialogue.training import turn_data as D


def test_heard_variants_keep_label_and_group_and_skip_what_the_head_cannot_tell_apart():
    examples = [
        {"text": "What a thing to", "label": 0, "head": "turn", "group": "g1", "kind": "cut", "source": "s"},
        {
            "text": "What is the capital of France?",
            "label": 2,
            "head": "turn",
            "group": "g2",
            "kind": "complete",
            "source": "s",
        },
        {"text": "stop", "label": 1, "head": "overlap", "group": "g3", "kind": "stop", "source": "s"},
        {
            "text": "never transcribed",
            "label": 0,
            "head": "turn",
            "group": "g4",
            "kind": "cut",
            "source": "s",
        },
    ]
    heard = {
        "What a thing to": "What a thing, too.",
        "What is the capital of France?": "what is the capital of france",
        "stop": "Stop.",
    }
    out = D.heard_variants(examples, heard)
    # only a transcript with other words is new to the head (it sees no punctuation; case aside)
    assert [(e["text"], e["label"], e["group"], e["kind"], e["heard_from"]) for e in out] == [
        ("What a thing, too.", 0, "g1", "cut+heard", "What a thing to")
    ]
    # a text heard in two voice sets: each transcript with other words is one example, once
    two = {"What a thing to": ["What a thing, too.", "what a thing too", "What a think to."]}
    assert [e["text"] for e in D.heard_variants(examples, two)] == ["What a thing, too.", "What a think to."]


def test_voices_are_a_pure_function_of_the_text():
    a, b = H.voice_for("What a thing to"), H.voice_for("What a thing to")
    assert a == b
    names = {H.voice_for(f"sentence number {i}").name() for i in range(200)}
    hibari = sum(H.voice_for(f"sentence number {i}").engine == "hibari" for i in range(200))
    assert 110 <= hibari <= 170 and len(names) > 3  # ~70 % hibari, the rest plain en-US espeak voices


def test_read_heard_resumes_from_the_file(tmp_path):
    path = tmp_path / "heard.jsonl"
    assert D.read_heard(path) == {}
    rows = [
        {"text": "a", "heard": "A.", "voice": "hibari"},
        {"text": "a", "heard": "Eh.", "voice": "flite:kal", "set": 1},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    assert D.read_heard(path) == {"a": ["A.", "Eh."]}
    assert D.read_heard(path, 0) == {"a": ["A."]} and D.read_heard(path, 1) == {"a": ["Eh."]}
    # nothing left to do in either set: no model is loaded
    assert H.transcribe_all(["a"], path=path) == 0 and H.transcribe_all(["a"], path=path, voice_set=1) == 0


def test_the_natural_voice_set_never_speaks_in_a_held_out_voice():
    from asr.training.speakers import HELDOUT_NATURAL, available_engines

    installed = set(available_engines()) & set(H.NATURAL_SHARES)
    if not installed:
        pytest.skip("no natural voice installed")
    voices = [H.natural_voice_for(f"sentence number {i}") for i in range(300)]
    assert voices[:20] == [H.natural_voice_for(f"sentence number {i}") for i in range(20)]  # pure
    assert not {v.name for v in voices} & set(HELDOUT_NATURAL)
    # every natural engine installed here speaks some of 300 sentences, and no other engine does (a fresh
    # machine without `make asr-voices` has hibari alone; with it, flite and Kokoro too)
    assert {v.engine for v in voices} == installed


def test_shipped_transcripts_cover_the_turn_examples():
    heard = D.read_heard()
    typed = {e["text"]: e for e in D.build_examples(progress=False, heard=False) if e["head"] == "turn"}
    texts = set(typed)
    assert heard, "data/dialogue/turn_heard.jsonl is missing: python -m dialogue.training.heard_turns"
    missing = texts - set(D.read_heard(voice_set=0))
    assert len(missing) <= 0.01 * len(texts), f"{len(missing)} of {len(texts)} turn examples not transcribed"
    variants = [e for e in D.build_examples(progress=False) if str(e.get("kind", "")).endswith("+heard")]
    # most transcripts differ from the text in some word: that is why they are examples
    assert len(variants) > 0.2 * len(texts)
    # each is labelled and grouped as the text it was spoken from, so it sits in the same split
    assert all(
        (e["label"], e["group"]) == (typed[e["heard_from"]]["label"], typed[e["heard_from"]]["group"])
        for e in variants
    )
