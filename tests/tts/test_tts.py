"""Phrase segmenter and hibari TTS stage: split-invariant phrases and audio, early first phrase, timing."""

from __future__ import annotations

import random
import re
import sys
import threading
import time

import numpy as np
import pytest

from asr.vad import ModelError
from duplex.base.config import ComponentConfig, ConfigError, load_profile
from duplex.base.phrases import PhraseSegmenter, clean_text
from tts.hibari_tts import (
    SAMPLE_RATE,
    HibariSynth,
    HibariTtsStage,
    TtsChunk,
    TtsInput,
    load_tts_stage,
    trim_silence,
)

TEXTS = [
    "The capital of France is Paris. It is a beautiful city, with many museums and cafés!",
    "Sure thing, I can help with that: Dr. Smith in the U.S. pays $9.99 for 3.5 GB of data each month, "
    "which is quite a lot when you think about it for more than a minute or two. Right?",
    "**Great question!** 😀 Here's the `answer`:\n- one\n- two #tags",
    "Well... hmm, okay",
    "   ",
    "",
    "*** ## `` 🎉🎉",
]


def splits(text: str, how: str, seed: int = 0) -> list[str]:
    if how == "whole":
        return [text]
    if how == "chars":
        return list(text)
    if how == "words":  # as LLM tokens come: leading space, then the word
        return re.findall(r"\s*\S+|\s+$", text)
    rng = random.Random(seed)
    cuts = (
        sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        if len(text) > 1
        else []
    )
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def segment(seg: PhraseSegmenter, deltas: list[str]) -> list[str]:
    state = seg.init_state()
    phrases: list[str] = []
    for d in deltas:
        out, state = seg.step(state, d)
        phrases += out
    out, state = seg.step(state, "", final=True)
    assert state.pending == ""
    return phrases + out


@pytest.mark.parametrize("text", TEXTS)
def test_phrases_do_not_depend_on_how_text_is_split(text: str) -> None:
    seg = PhraseSegmenter(first_phrase_words=3, max_phrase_words=12)
    offline = segment(seg, splits(text, "whole"))
    for how in ("chars", "words"):
        assert segment(seg, splits(text, how)) == offline, how
    for seed in range(20):
        assert segment(seg, splits(text, "random", seed)) == offline, seed
    # nothing is lost but markdown, emojis, whitespace and list bullets
    assert re.sub(r"\W", "", "".join(offline)) == re.sub(r"\W", "", clean_text(text))


def test_phrase_rules() -> None:
    seg = PhraseSegmenter(first_phrase_words=3, max_phrase_words=12)
    # a phrase cut for length ends before its last phrase opener ("of"), not inside the phrase
    assert segment(seg, [TEXTS[0]]) == [
        "The capital",
        "of France is Paris.",
        "It is a beautiful city,",
        "with many museums and cafés!",
    ]
    assert segment(seg, ["Yes, of course it is."]) == ["Yes,", "of course it is."]  # clause punctuation first
    long = " ".join(f"w{i}" for i in range(30)) + "."
    phrases = segment(seg, [long])
    # no opener: cut at the limit, which doubles from the first phrase's up to max_phrase_words, so
    # the next phrase is written before the short first one has played
    assert [len(p.split()) for p in phrases] == [3, 6, 12, 9]
    assert segment(seg, ["The sky on a clear day is blue and the sea is green and very deep today."]) == [
        "The sky",
        "on a clear day",
        "is blue and the sea is green and very deep today.",
    ]
    assert segment(seg, ["Once the ship sank."]) == ["Once the ship", "sank."]  # two words before a cut
    assert segment(seg, ["Dr. Smith lives in the U.S. now. J. K. Rowling too."]) == [
        "Dr. Smith lives",
        "in the U.S. now.",
        "J. K. Rowling too.",
    ]
    assert segment(seg, [TEXTS[2]]) == ["Great question!", "Here's the answer:", "one", "two tags"]
    assert segment(seg, ["Hi!"]) == ["Hi!"] and segment(seg, ["... !"]) == []


def test_first_phrase_after_three_words() -> None:
    seg = PhraseSegmenter(first_phrase_words=3)
    state = seg.init_state()
    got = []
    for d in ["The", " capital", " of", " France", " is"]:
        out, state = seg.step(state, d)
        got.append(out)
    # "of" is complete only when the space before "France" arrives: "of" could have been "often";
    # then the phrase is cut before it, where the phrase "of France" starts
    assert got == [[], [], [], ["The capital"], []]


@pytest.fixture(scope="module")
def stage() -> HibariTtsStage:
    return load_tts_stage(load_profile("cpu").component("tts"))


def speak(stage: HibariTtsStage, deltas: list[str]) -> list[TtsChunk]:
    state = stage.init_state()
    chunks: list[TtsChunk] = []
    for d in deltas:
        out, state = stage.step(state, TtsInput(d))
        chunks += out
    out, state = stage.step(state, TtsInput("", final=True))
    return chunks + out


@pytest.mark.integration
def test_audio_does_not_depend_on_how_text_is_split(stage: HibariTtsStage) -> None:
    text = TEXTS[0]
    offline = speak(stage, [text])
    assert [c.text for c in offline] == segment(stage.segmenter, [text])
    for deltas in (splits(text, "chars"), splits(text, "words"), splits(text, "random", 3)):
        streamed = speak(stage, deltas)
        assert [c.text for c in streamed] == [c.text for c in offline]
        for a, b in zip(streamed, offline, strict=True):
            assert a.audio.dtype == np.float32 and np.array_equal(a.audio, b.audio)
    for c in offline:
        seconds = c.audio.size / SAMPLE_RATE
        assert 0.3 < seconds < 0.5 * len(c.text.split()) + 0.5 and np.abs(c.audio).max() > 0.05


@pytest.mark.integration
@pytest.mark.parametrize("text", ["", "   ", "\n\n", "*** ## ``", "🎉🎉 ✨", "... - !"])
def test_empty_or_markdown_only_gives_no_audio(stage: HibariTtsStage, text: str) -> None:
    assert speak(stage, [text]) == []
    assert speak(stage, list(text)) == []


@pytest.mark.integration
def test_concurrent_threads_give_identical_audio(stage: HibariTtsStage) -> None:
    expected = speak(stage, [TEXTS[1]])
    results: list[list[TtsChunk]] = []

    def worker() -> None:
        results.append(speak(stage, splits(TEXTS[1], "words")))

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for chunks in results:
        assert [c.text for c in chunks] == [c.text for c in expected]
        assert all(np.array_equal(a.audio, b.audio) for a, b in zip(chunks, expected, strict=True))


def test_trim_silence() -> None:
    audio = np.concatenate([np.zeros(7200), 0.2 * np.ones(2400), np.zeros(9000)]).astype(np.float32)
    out = trim_silence(audio, pause_seconds=0.1)
    assert out.size == round(0.02 * SAMPLE_RATE) + 2400 + round(0.1 * SAMPLE_RATE)
    assert trim_silence(np.zeros(100, np.float32), 0.1).size == 0


def test_missing_package_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "hibari", None)
    with pytest.raises(ModelError, match="pip install hibari-tts"):
        HibariSynth()


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="hibari"):
        load_tts_stage(ComponentConfig(name="tts", backend="kokoro"))
    # a voice that is not in the package would be downloaded: refused before any network access
    with pytest.raises(ConfigError, match="not shipped"):
        load_tts_stage(ComponentConfig(name="tts", backend="hibari", options={"voice": "emma"}))
    with pytest.raises(ValueError):
        PhraseSegmenter(first_phrase_words=0)


@pytest.mark.integration
def test_time_to_first_chunk(stage: HibariTtsStage) -> None:
    times = []
    for text in (
        "Sure, let me check that for you.",
        "The capital of France is Paris.",
        "I think it will rain today.",
    ):
        state = stage.init_state()
        for d in splits(text, "words"):
            t0 = time.perf_counter()
            out, state = stage.step(state, TtsInput(d))
            if out:
                times.append(time.perf_counter() - t0)
                break
    print(
        f"\nTTS: time to first chunk after the delta that completes it: "
        f"{', '.join(f'{t * 1e3:.1f} ms' for t in times)}"
    )
    assert len(times) == 3 and max(times) < 0.25  # models.yaml tts chunk budget
