"""Caller notes (dialogue/caller_notes.py): the caller's facts about themselves, restated in the third
person on a later question about the caller, as the slow model reads the history."""

from __future__ import annotations

import pytest

from dialogue.caller_notes import (
    MAX_FACTS,
    answer_lead,
    asks_about_caller,
    caller_facts,
    is_question,
    note_for,
    statement_lead,
    with_caller_notes,
)


@pytest.mark.parametrize(
    ("said", "facts"),
    [
        ("My name is Anna.", ["their name is Anna"]),
        ("Hi, I'm Tom and I live in Paris.", ["they live in Paris", "their name is Tom"]),
        ("My dog is called Max.", ["their dog is called Max"]),
        ("My favourite colour is green.", ["their favourite colour is green"]),
        ("I work as a nurse.", ["they work as a nurse"]),
        ("I was born in March.", ["they were born in March"]),
        ("My daughter plays the violin.", ["their daughter plays the violin"]),
        ("I have a question about my order.", ["they have a question about their order"]),
        ("I am fine, thanks.", []),  # no article, no capitalised name: not a fact
        ("What is my name?", []),  # a question is not a fact
    ],
)
def test_first_person_facts_are_restated_in_the_third_person(said, facts):
    assert caller_facts(said) == facts


def test_a_question_about_the_caller_gets_the_earlier_facts_appended():
    history = [
        {"role": "user", "content": "My sister is called Clara."},
        {"role": "assistant", "content": "That's a lovely name."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "What is my sister called?"},
    ]
    out = with_caller_notes(history)
    assert out[:4] == history[:4]  # statements, answers and other questions are unchanged
    assert out[4]["content"] == "What is my sister called?" + note_for(["their sister is called Clara"])
    assert "their sister is called Clara" in out[4]["content"] and "'your'" in out[4]["content"]
    assert history[4]["content"] == "What is my sister called?"  # the caller's history is not touched


def test_a_note_depends_only_on_earlier_messages_so_the_cache_never_rolls_back():
    history = [
        {"role": "user", "content": "I live in Boston."},
        {"role": "assistant", "content": "Nice."},
        {"role": "user", "content": "Where do I live?"},
    ]
    before = with_caller_notes(history)
    later = with_caller_notes(
        [
            *history,
            {"role": "assistant", "content": "Boston."},
            {"role": "user", "content": "My name is Ann."},
        ]
    )
    assert later[:3] == before  # what came after a message never changes how it renders
    assert with_caller_notes(history[2:]) == history[2:]  # no earlier facts: no note


def test_notes_keep_the_newest_facts_once_each():
    pets = ["dog", "cat", "fish", "bird", "horse", "goat", "frog", "snake"][: MAX_FACTS + 2]
    msgs = [{"role": "user", "content": f"My {pet} is called Rex."} for pet in pets]
    msgs += [
        {"role": "user", "content": "My dog is called Rex."},
        {"role": "user", "content": "Do I have pets?"},
    ]
    note = with_caller_notes(msgs)[-1]["content"]
    assert note.count("their dog is called Rex") == 1  # said again: moved to the newest, not doubled
    assert "their cat" not in note and "their fish" not in note  # the oldest fell out of the note
    assert note.endswith("their dog is called Rex. Answer them with 'your'.)")
    assert asks_about_caller("Do I have pets?") and not asks_about_caller("Is it raining?")


@pytest.mark.parametrize(
    ("said", "asked", "lead"),
    [
        ("My sister is called Clara.", "What is my sister called?", "Your sister"),
        ("My favourite colour is green.", "What is my favourite colour?", "Your favourite colour"),
        ("My daughter plays the violin.", "Which instrument does my daughter play?", "Your daughter"),
        ("My name is Peter.", "Do you remember my name?", "Your name"),
        ("My wife is called Maria.", "What's my wife's name?", "Your wife"),
        ("I was born in March.", "In which month was I born?", "You were born"),
        ("I live in Madrid.", "Where do I live?", "You live in"),
        ("I have three children.", "How many children do I have?", "You have"),
        ("I am thirty years old.", "How old am I?", "You are"),
        ("I work as a nurse.", "What is my job?", "You work"),
        ("I am a teacher.", "What do I do for work?", "You are"),
        # no fact about the thing asked, a fact with no lead, not a question: the model answers freely
        ("My dog is called Max.", "What is my sister called?", None),
        ("I speak French.", "Which language do I speak?", None),
        ("The sky is blue.", "What is my name?", None),
    ],
)
def test_the_answer_to_a_question_about_a_stated_fact_starts_with_whose_it_is(said, asked, lead):
    msgs = [
        {"role": "user", "content": said},
        {"role": "assistant", "content": "Nice."},
        {"role": "user", "content": asked},
    ]
    assert answer_lead(msgs) == lead
    assert answer_lead(msgs[-1:]) is None  # nothing said before: no lead


@pytest.mark.parametrize(
    ("said", "asked", "lead"),
    [  # as Moonshine writes them: a comma, or nothing, where the full stop or question mark was
        ("I was born in March,", "In which month was I born,", "You were born"),
        ("My sister is called Clara,", "What is my sister called", "Your sister"),
        ("I work as a nurse,", "What is my job,", "You work"),
    ],
)
def test_questions_and_facts_without_their_punctuation(said, asked, lead):
    msgs = [{"role": "user", "content": said}, {"role": "user", "content": asked}]
    assert caller_facts(said) and not caller_facts(asked)
    assert answer_lead(msgs) == lead
    assert with_caller_notes(msgs)[-1]["content"].startswith(asked + " (The caller told you earlier")


@pytest.mark.parametrize(
    ("text", "question"),
    [
        ("What is my name?", True),
        ("In which month was I born,", True),
        ("how old am I", True),
        ("Do you remember my name", True),
        ("I am a teacher,", False),
        ("My dog is called Max", False),
        ("Whatever you say.", False),
    ],
)
def test_a_question_is_told_by_its_words_as_well_as_its_mark(text, question):
    assert is_question(text) == question


@pytest.mark.parametrize(
    ("said", "lead"),
    [
        ("My sister is called Clara.", "Got it, your sister"),
        ("My favourite colour is green,", "Got it, your favourite colour"),
        ("My daughter plays the violin.", "Got it, your daughter"),
        ("I live in Boston", "Got it, you live"),
        ("I'm Tom.", "Got it, your name"),
        # not a short statement of the caller's facts: the model answers freely
        ("I have a headache and I need some advice about it.", None),
        ("What is my sister called?", None),
        ("Hello there.", None),
    ],
)
def test_a_short_statement_of_the_callers_facts_is_confirmed_as_theirs(said, lead):
    assert statement_lead(said) == lead
    assert answer_lead([{"role": "user", "content": said}]) == lead
