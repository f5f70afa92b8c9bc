"""What the conversation bench asks beyond speed (issue 21): factual questions scored by keywords,
mid-sentence pauses, multi-turn memory; the scoring rules, and a run against the tone server."""

from __future__ import annotations

import argparse
import json
import re

import numpy as np
import pytest

from duplex.base.config import load_profile
from duplex.bench.common import FACTS_PATH, BenchError, Fact, MemoryCase, Rx, load_facts
from duplex.bench.conversation import (
    answer_started,
    answer_tokens,
    answer_vocabulary,
    draft_wrong_keyword,
    keywords_match,
    memory_verdict,
)
from duplex.bench.report import format_table
from duplex.bench.serve import run_bench
from duplex.runtime.service import DuplexService
from duplex.testing.fakes import VOCAB, fake_stages, fake_turn_stages, scripted_answer, tone_speech
from duplex.transports.native import DuplexServer, ServerSettings

# -- the keyword matcher -------------------------------------------------------------------


def test_number_words_and_digits_are_the_same() -> None:
    assert keywords_match("A spider has 8 legs.", [["eight", "8"]])
    assert keywords_match("A spider has eight legs.", [["8"]])
    assert keywords_match("There are twenty-four hours in a day.", [["24"]])
    assert keywords_match("There are twenty four hours in a day.", [["twenty four"]])
    assert keywords_match("A leap year has three hundred and sixty six days.", [["366"]])
    assert keywords_match("It has 1,000 pages.", [["one thousand"]])
    assert not keywords_match("Twenty-five hours.", [["24", "twenty four"]])
    assert answer_tokens("Six times seven is forty-two!") == ["6", "times", "7", "is", "42"]


def test_keywords_match_whole_words_only() -> None:
    assert not keywords_match("I am bored.", [["red"]])
    assert not keywords_match("Eighteen legs.", [["eight", "8"]])
    assert not keywords_match("It is 18.", [["8"]])
    assert keywords_match("RED, of course.", [["red"]])
    assert keywords_match("The dog's bark.", [["dog"]])  # a possessive names the dog
    assert keywords_match("Dogs bark.", [["dog", "dogs"]])


def test_keywords_match_needs_every_group() -> None:
    groups = [["carbon dioxide", "co2"], ["plants", "plant"]]
    assert keywords_match("Plants take in carbon dioxide.", groups)
    assert keywords_match("A plant breathes CO2.", groups)
    assert not keywords_match("Plants take in carbon and dioxide.", groups)  # a phrase is consecutive
    assert not keywords_match("Carbon dioxide.", groups)
    assert keywords_match("anything", [])


# -- memory and drafts -----------------------------------------------------------------------

NAME = MemoryCase(
    "My name is Anna.", "What is my name?", (("anna",),), r"\bmy name is\b|\bi(?: am|'m) anna\b"
)


def test_memory_verdict() -> None:
    assert memory_verdict("Your name is Anna.", NAME) == (True, "")
    assert memory_verdict("You told me you are Anna!", NAME) == (True, "")
    ok, why = memory_verdict("My name is Anna.", NAME)
    assert not ok and "role confusion" in why
    ok, why = memory_verdict("I'm Anna, nice to meet you.", NAME)
    assert not ok and "role confusion" in why
    ok, why = memory_verdict("I don't know your name.", NAME)
    assert not ok and why == "fact missing"
    ok, why = memory_verdict("Anna.", NAME)
    assert not ok and "your" in why
    assert not memory_verdict("Your name is Annabel.", NAME)[0]  # whole words


def test_memory_verdict_refuses_making_the_caller_the_one_the_fact_is_about() -> None:
    brother = MemoryCase(
        "My brother is called Tom.", "What is my brother called?", (("tom",),), r"\bmy brother\b"
    )
    assert memory_verdict("Your brother is called Tom.", brother) == (True, "")
    assert memory_verdict("You told me your brother's name is Tom.", brother) == (True, "")
    for wrong in ("You are Tom.", "Your name is Tom.", "You're Tom, right?"):
        ok, why = memory_verdict(wrong, brother)
        assert not ok and "identity confusion" in why, wrong
    # the caller's own name stays right said either way
    assert memory_verdict("You are Anna.", NAME) == (True, "")


def test_held_out_memory_cases_are_other_cases_graded_alike() -> None:
    from duplex.eval.answers import MEMORY_CASES, MEMORY_FRESH, MEMORY_HELDOUT

    assert not {c.statement for c in MEMORY_HELDOUT} & {c.statement for c in MEMORY_CASES}
    assert not {c.statement for c in MEMORY_FRESH} & {c.statement for c in MEMORY_CASES + MEMORY_HELDOUT}
    for case in MEMORY_FRESH:  # each is gradable: its keyword, said to the caller, is right
        assert memory_verdict(f"You told me: {case.answer[0][0]}.", case)[0], case
    # a third party's fact said of the caller is wrong; a fact of the caller's own, reframed, is not
    fresh = {c.question: c for c in MEMORY_FRESH}
    for question, wrong in [
        ("Who is my best friend?", "You are Sam."),
        ("Where does my mother live?", "You live in Rome."),
        ("What sport does my son play?", "You are playing football."),
        ("What is my favourite animal?", "You are the horse."),
        ("What's my wife's name?", "Your name is Maria."),
    ]:
        assert "identity confusion" in memory_verdict(wrong, fresh[question])[1], wrong
    assert memory_verdict("Your mother lives in Rome.", fresh["Where does my mother live?"]) == (True, "")
    assert memory_verdict("You are a mango lover.", MEMORY_HELDOUT[4]) == (True, "")
    for case, right, own in [
        (MEMORY_HELDOUT[0], "Your brother is called Tom.", "My brother is called Tom."),
        (MEMORY_HELDOUT[1], "You live in Madrid.", "I live in Madrid."),
        (MEMORY_HELDOUT[5], "You have 3 children.", "I have three children."),
        (MEMORY_HELDOUT[7], "Yes, your name is Peter.", "Yes, my name is Peter."),
    ]:
        assert memory_verdict(right, case) == (True, "")
        assert "role confusion" in memory_verdict(own, case)[1]


def test_draft_wrong_keyword() -> None:
    facts = [
        Fact("How many legs does a spider have?", (("eight", "8"),)),
        Fact("Which planet is closest to the sun?", (("mercury",),)),
        Fact("Which planet is the largest?", (("jupiter",),)),
    ]
    vocab = answer_vocabulary(facts)
    assert draft_wrong_keyword("A spider has six", facts[0], vocab) == "6"
    assert draft_wrong_keyword("A spider has", facts[0], vocab) is None
    assert draft_wrong_keyword("Jupiter is the", facts[1], vocab) == "jupiter"
    assert draft_wrong_keyword("The closest planet", facts[1], vocab) is None
    assert draft_wrong_keyword("Mercury is", facts[1], vocab) is None


def test_answer_started_ignores_the_service_backchannel() -> None:
    log = [
        Rx(0.0, {"type": "turn.decision", "decision": "listen"}),
        Rx(0.1, {"type": "backchannel", "source": "service", "text": "Mm-hmm."}),
        Rx(0.2, None, 0.04),
        Rx(0.5, {"type": "response.audio.started", "turn_id": 1}),
        Rx(0.6, None, 0.04),
    ]
    assert answer_started(log, 0, before=0.4) is None
    assert answer_started(log, 0, before=0.55) == 3
    assert answer_started([Rx(0.1, None, 0.04)], 0, before=0.4) == 0  # audio with no event first


# -- the shipped question set --------------------------------------------------------------------


def test_the_factual_question_set() -> None:
    facts = load_facts()
    assert len(facts) >= 60
    assert len({f.q for f in facts}) == len(facts)
    for f in facts:
        assert f.q.endswith("?") and f.any and all(f.any), f
        # each question's own keywords score as right, and a bare "I don't know" as wrong
        assert keywords_match(" ".join(g[0] for g in f.any), f.any), f
        assert not keywords_match("I do not know.", f.any), f
    assert FACTS_PATH.name == "facts_eval.jsonl"


def test_load_facts_names_a_bad_row(tmp_path) -> None:
    path = tmp_path / "facts.jsonl"
    path.write_text('{"q": "ok?", "any": [["yes"]]}\n{"question": "no"}\n')
    with pytest.raises(BenchError, match=":2:"):
        load_facts(path)


def test_heldout_voice_without_its_engines_names_the_make_target(monkeypatch) -> None:
    import asr.training.speakers as speakers
    from duplex.bench.common import make_synth

    monkeypatch.setattr(speakers, "available_engines", lambda: ("espeak", "hibari"))
    with pytest.raises(BenchError, match="make asr-voices"):
        make_synth("heldout")


def test_case_options_default_off() -> None:
    from duplex.bench.cli import add_case_arguments

    p = argparse.ArgumentParser()
    add_case_arguments(p)
    args = p.parse_args([])
    assert (args.facts, args.pauses, args.memory, args.voice, args.seed) == (0, 0, 0, "hibari", 0)
    assert p.parse_args(["--voice", "heldout", "--facts", "60"]).facts == 60


# -- against the tone server --------------------------------------------------------------------


def tone_synth(text: str) -> np.ndarray:
    words = [w for w in re.findall(r"[a-z]+", text.lower()) if w in VOCAB]
    return tone_speech(" ".join(words) or "hello")


def remembering(history: list[dict[str, str]]) -> str:
    """scripted_answer, and "what am i" answered from what the user said before."""
    if history[-1]["content"] == "what am i":
        told = any(m["role"] == "user" and m["content"] == "i am a cat" for m in history[:-1])
        return "you are a cat" if told else "i am fine thanks"
    return scripted_answer(history)


FACTS = [
    Fact("What is the capital of France?", (("paris",),)),
    Fact("What is two plus two?", (("four", "4"),)),
    Fact("Hello, how are you?", (("eight", "8"),)),  # "i am fine thanks": wrong
]
MEMORY = [
    MemoryCase("I am a cat.", "What am I?", (("cat",),), r"\bi am a cat\b"),
    MemoryCase("I am fine.", "How am I?", (("fine",),), r"\bi am fine\b"),  # "i am fine thanks"
]
PAUSE = [("What is the capital of", "France?")]


async def _serve(stages):
    service = DuplexService(load_profile("cpu"), stages)
    srv = DuplexServer(service, ServerSettings(host="127.0.0.1", port=0))
    await srv.start()
    return service, srv


async def test_cases_against_the_tone_server(tmp_path) -> None:
    """No turn head: silence alone ends the turn, so a 1.0-1.5 s mid-sentence pause is taken over."""
    service, srv = await _serve(fake_stages(remembering))
    lines: list[str] = []
    try:
        result = await run_bench(
            f"ws://127.0.0.1:{srv.port}/v1/duplex",
            turns=0,
            barge_ins=0,
            synth=tone_synth,
            out_dir=tmp_path,
            facts=3,
            pauses=1,
            memory=2,
            fact_set=FACTS,
            pause_pairs=PAUSE,
            memory_cases=MEMORY,
            progress=lines.append,
        )
    finally:
        await srv.close()
        service.close()
    data = json.loads((tmp_path / "bench.json").read_text())
    s = data["summary"]
    assert s == json.loads(json.dumps(result["summary"]))
    assert {f["q"] for f in data["samples"]["facts"]} == {f.q for f in FACTS}
    assert (
        s["facts"]["n"] == 3
        and s["facts"]["correct"] == 2
        and s["facts"]["rate"] == pytest.approx(2 / 3, abs=1e-3)
    )
    (wrong,) = s["facts"]["wrong"]
    assert wrong["q"] == "Hello, how are you?" and wrong["answer"] == "i am fine thanks"
    assert s["facts"]["failed"] == 0 and s["facts"]["draft_committed"] == 0
    assert s["facts"]["wrong_with_committed_draft"] == 0 and s["facts"]["wrong_from_draft"] == 0

    (case,) = data["samples"]["pauses"]
    assert case["taken_over"] and 0 < case["taken_after_s"] < case["pause_s"]
    assert case["recovered"] and case["answer"]
    assert s["pause_takeover"] == {"n": 1, "taken": 1, "rate": 1.0, "recovered": 1}

    assert s["memory"]["n"] == 2 and s["memory"]["correct"] == 1 and s["memory"]["rate"] == 0.5
    (mwrong,) = s["memory"]["wrong"]
    assert mwrong["question"] == "How am I?" and "role confusion" in mwrong["why"]
    assert data["samples"]["memory"][0]["answer"] == "you are a cat"

    # every answer is an onset sample of its kind; the classic kinds are untouched
    kinds = [t["kind"] for t in data["samples"]["turns"]]
    assert kinds == ["fact"] * 3 + ["pause"] + ["memory"] * 4
    assert all(t["ok"] for t in data["samples"]["turns"]), data["samples"]["turns"]
    assert s["onset_by_kind_s"]["fact"]["n"] == 3 and s["onset_by_kind_s"]["question"]["n"] == 0
    assert data["settings"]["facts"] == 3 and data["settings"]["pause_s"] == [1.0, 1.5]
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = format_table(result)
    assert "facts: 2/3 correct (67%)" in table
    assert "pause takeover: 1/1" in table and "memory: 1/2 correct" in table
    assert sum(line.startswith("[fact ") and "] WRONG" in line for line in lines) == 1


async def test_a_turn_head_waits_through_the_pause(tmp_path) -> None:
    """The scripted turn head hears "... capital of" as unfinished: the service waits, then answers
    the whole sentence."""
    service, srv = await _serve(fake_turn_stages(scripted_answer))
    try:
        result = await run_bench(
            f"ws://127.0.0.1:{srv.port}/v1/duplex",
            turns=0,
            barge_ins=0,
            synth=tone_synth,
            out_dir=None,
            pauses=1,
            pause_pairs=PAUSE,
            progress=None,
        )
    finally:
        await srv.close()
        service.close()
    (case,) = result["samples"]["pauses"]
    assert case["taken_over"] is False, case
    assert any(d["decision"] == "listen" for d in case["decisions"]), case
    assert case["transcript"] == "what is the capital of france"
    assert case["answer"] == "paris is the capital of france"
    assert result["summary"]["pause_takeover"] == {"n": 1, "taken": 0, "rate": 0.0, "recovered": 1}
    # nothing asked, nothing reported
    assert result["summary"]["facts"]["n"] == 0 and result["summary"]["memory"]["rate"] is None
    assert "facts:" not in format_table(result)


def test_compare_relay_runs_each_variant_on_one_server(tmp_path) -> None:
    """--compare-relay: the same plan in three sessions (relay off / exact / verifier) on one server;
    each variant's options reach the session, and one table compares them."""
    import argparse

    from duplex.bench import cli as bench_cli
    from duplex.bench.common import InProcessServer
    from duplex.testing.fakes import fake_turn_stages

    stages = fake_turn_stages(remembering)
    service = DuplexService(load_profile("cpu"), stages)
    server = InProcessServer(service)
    url = server.start()
    args = argparse.Namespace(turns=1, barge_ins=0, out=str(tmp_path))
    try:
        rc = bench_cli._compare_sessions(
            url,
            args,
            tone_synth,
            {},
            0,
            "hibari",
            {"facts": 0, "pauses": 0, "memory": 0},
            "compare-relay",
            bench_cli.RELAY_VARIANTS,
        )
    finally:
        server.stop()
        service.close()
    assert rc == 0
    names = ("relay-off", "relay-exact", "relay-verifier", "relay-grounded")
    assert stages.llm.relays == [False, True, True, True]
    assert stages.llm.relay_checks == [None, "exact", "verifier", "grounded"]
    table = (tmp_path / "compare-relay.txt").read_text()
    assert all(name in table for name in names)
    assert all((tmp_path / name / "bench.json").is_file() for name in names)
    # every variant's answers were played through: no gap inside them
    gaps = json.loads((tmp_path / "relay-off" / "bench.json").read_text())["summary"]["answer_gaps"]
    assert gaps["answers"] >= 1 and gaps["count"] == 0
    assert "gaps" in table and f"0/{gaps['answers']}" in table
    assert (tmp_path / "compare-relay.png").stat().st_size > 10_000  # the plot of the table


def test_compare_early_answers_the_same_plan_with_early_answers_off_then_on(tmp_path) -> None:
    """--compare-early: with early answers off no answer is prepared while the caller talks; on, the scripted
    head is sure at the question's last word, so answers are prepared early and counted."""
    import argparse
    import dataclasses
    import json

    from duplex.base.turn_policy import TurnPolicy
    from duplex.bench import cli as bench_cli
    from duplex.bench.common import InProcessServer
    from duplex.testing.fakes import fake_turn_stages

    # the scripted head's 0.9 for a finished question is a sure end with this policy (predictive end of turn)
    policy = TurnPolicy(
        speak_threshold=0.5, backchannel_threshold=0.5, take_threshold=0.6, fast_take_threshold=0.85
    )
    service = DuplexService(
        load_profile("cpu"), dataclasses.replace(fake_turn_stages(remembering), policy=policy)
    )
    server = InProcessServer(service)
    url = server.start()
    args = argparse.Namespace(turns=3, barge_ins=0, out=str(tmp_path))
    try:
        rc = bench_cli._compare_sessions(
            url,
            args,
            tone_synth,
            {},
            0,
            "hibari",
            {"facts": 0, "pauses": 0, "memory": 0},
            "compare-early",
            bench_cli.EARLY_VARIANTS,
        )
    finally:
        server.stop()
        service.close()
    assert rc == 0
    early = {
        name: json.loads((tmp_path / name / "bench.json").read_text())["summary"]["early_answers"]
        for name in ("early-off", "early-on")
    }
    assert early["early-off"] == 0 and early["early-on"] >= 1, early
    assert "early-on" in (tmp_path / "compare-early.txt").read_text()


@pytest.mark.parametrize("kind, profile", [("tts", "cpu-flow"), ("asr", "cpu-streaming")])
def test_compare_stage_needs_serve(capsys, kind: str, profile: str) -> None:
    from duplex.cli import main as duplex_main

    assert duplex_main(["bench", f"--compare-{kind}", profile]) == 2
    assert f"--compare-{kind} needs --serve" in capsys.readouterr().err


class _PairSynth:
    """tone_synth with `pair`: the whole sentence and its first words, one voice."""

    def __call__(self, text: str) -> np.ndarray:
        return tone_synth(text)

    def pair(self, whole: str, prefix: str) -> tuple[np.ndarray, np.ndarray]:
        return tone_synth(whole), tone_synth(prefix)


def test_a_pause_case_is_cut_from_its_whole_sentence() -> None:
    """The first part of a pause case is the whole sentence's audio up to where its words end (a speaker
    who stops mid-flow), the rest is what follows; a synth without `pair` speaks the parts alone."""
    from duplex.bench.common import SR, pause_speech, trim_speech

    first, rest = PAUSE[0]
    head, tail = pause_speech(_PairSynth(), first, rest)
    whole = trim_speech(tone_synth(f"{first} {rest}"))
    alone = trim_speech(tone_synth(first))
    assert abs(len(head) - len(alone)) <= 0.05 * SR  # cut where the first words end
    assert np.array_equal(head, whole[: len(head)])  # ... out of the whole sentence's own audio
    assert 0 < len(tail) and len(head) + len(tail) <= len(whole)
    assert np.array_equal(tail, whole[len(whole) - len(tail) :])
    plain_head, plain_tail = pause_speech(tone_synth, first, rest)
    assert np.array_equal(plain_head, alone) and np.array_equal(plain_tail, trim_speech(tone_synth(rest)))


def test_pause_audio_option_defaults_to_whole_sentences() -> None:
    from duplex.bench.cli import add_case_arguments

    p = argparse.ArgumentParser()
    add_case_arguments(p)
    assert p.parse_args([]).pause_audio == "whole"
    assert p.parse_args(["--pause-audio", "alone"]).pause_audio == "alone"


def test_compare_table_counts_wrong_facts_after_a_committed_draft() -> None:
    """The comparison's draft column: wrong facts after a committed draft, and in brackets those whose draft
    itself held the wrong keyword (the log line's two counts)."""
    from duplex.bench.cli import _from_draft

    assert _from_draft({"wrong_with_committed_draft": 2, "wrong_from_draft": 0}) == "2 (0)"
    assert _from_draft({}) == "-"


def test_heard_counts_exact_transcripts_and_lists_other_questions() -> None:
    from duplex.bench.serve import heard

    turns = [
        {"ok": True, "text": "What colour is the sky?", "transcript": "What color is the sky?"},
        {"ok": True, "text": "Who wrote Romeo and Juliet?", "transcript": "Here I'll grow me, Angelia,"},
        {
            "ok": True,
            "text": "How many legs does a spider have?",
            "transcript": "How many legs does the spider have?",
        },
        {"ok": False, "text": "Tell me a joke.", "error": "timed out"},
    ]
    h = heard(turns)
    assert h["n"] == 3 and h["word_for_word"] == 1  # British spelling is not an error; "the" for "a" is
    assert [m["text"] for m in h["misheard"]] == ["Who wrote Romeo and Juliet?"]
