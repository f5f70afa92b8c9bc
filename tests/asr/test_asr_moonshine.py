"""Moonshine ASR stage: chunked == whole, recognises synthesised speech, thread-safe, timing."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from asr.moonshine import (
    MIN_SAMPLES,
    AsrChunk,
    AsrResult,
    MoonshineAsrStage,
    MoonshineModel,
    clean_text,
    decode_tokens,
    load_asr_stage,
    load_tokenizer,
)
from asr.vad import ModelError
from duplex.base.config import ComponentConfig, ConfigError, load_profile
from tests.speech import silence, synthesize

pytestmark = pytest.mark.integration

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def stage() -> MoonshineAsrStage:
    return load_asr_stage(load_profile("cpu").component("asr"))


@pytest.fixture(scope="module")
def question() -> np.ndarray:
    return np.concatenate([silence(0.2), synthesize(QUESTION), silence(0.3)])


def test_recognises_synthesised_question(stage: MoonshineAsrStage, question: np.ndarray) -> None:
    out, _ = stage.step(stage.init_state(), AsrChunk(question, transcribe=True, final=True))
    words = out.text.lower() if out.text else ""
    assert "capital" in words and "france" in words, out.text
    assert out.is_final and out.audio_seconds == pytest.approx(question.size / 16000)


@pytest.mark.parametrize("chunk", [320, 1600, 8000])
def test_chunked_equals_whole(stage: MoonshineAsrStage, question: np.ndarray, chunk: int) -> None:
    whole, _ = stage.step(stage.init_state(), AsrChunk(question, transcribe=True, final=True))
    state = stage.init_state()
    partials: list[AsrResult] = []
    for i, start in enumerate(range(0, question.size, chunk)):
        # ask for a partial now and then, as the session does; the last chunk asks for the final
        last = start + chunk >= question.size
        ask = last or i % max(1, 16000 // chunk) == 0
        out, state = stage.step(state, AsrChunk(question[start : start + chunk], transcribe=ask, final=last))
        if not ask:
            assert out.text is None and out.compute_seconds == 0.0
        partials.append(out)
    assert partials[-1].text == whole.text and partials[-1].is_final
    assert state.n_samples == question.size
    assert all(not p.is_final for p in partials[:-1])


def test_short_and_empty_segments_skip_the_model(
    stage: MoonshineAsrStage, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*_args: object) -> list[int]:
        raise AssertionError("the model ran on a segment too short for it")

    # asserted by what runs, not by time (the acoustic end-of-turn cue still runs, and a loaded CPU is slow)
    monkeypatch.setattr(stage.model, "_greedy", never)
    for n in (0, 1, 800, MIN_SAMPLES - 1):  # fewer than ~1000 samples would abort inside onnxruntime
        out, state = stage.step(stage.init_state(), AsrChunk(np.zeros(n, np.float32), transcribe=True))
        assert out.text == "" and state.n_samples == n
    out, _ = stage.step(stage.init_state(), AsrChunk(np.zeros(0, np.float32), final=True))
    assert out.text == "" and out.is_final


def test_step_does_not_modify_input_state(stage: MoonshineAsrStage, question: np.ndarray) -> None:
    state = stage.init_state()
    _, state = stage.step(state, AsrChunk(question[:16000]))
    a, _ = stage.step(state, AsrChunk(question[16000:], transcribe=True))
    b, _ = stage.step(state, AsrChunk(question[16000:], transcribe=True))
    assert a.text == b.text and state.n_samples == 16000


def test_a_draft_changes_the_cost_never_the_transcript(
    stage: MoonshineAsrStage, question: np.ndarray
) -> None:
    """Greedy decoding with a draft keeps only the prefix the decoder would have chosen itself."""
    model = stage.model
    want = model.transcribe_ids(question)
    partial = model.transcribe_ids(question[: question.size // 2])  # what a partial had heard
    assert partial != want and len(want) >= 6
    rng = np.random.default_rng(0)
    drafts = {
        "itself": want,
        "a partial": partial,
        "cut short": want[:-2],
        "wrong from the first token": [int(t) for t in rng.integers(3, 30000, 8)],
        "wrong in the middle": [*want[:3], 4000, *want[4:]],
        "too long": [*want, 500, 600, 700],
        "far too long": want * 20,
    }
    for name, draft in drafts.items():
        assert model.transcribe_ids(question, draft) == want, name


def test_the_state_carries_the_last_transcript_as_the_next_draft(
    stage: MoonshineAsrStage, question: np.ndarray
) -> None:
    half = question.size // 2
    out, state = stage.step(stage.init_state(), AsrChunk(question[:half], transcribe=True))
    assert state.draft and decode_tokens(stage.model.tokens, list(state.draft)) == out.text
    _, state = stage.step(state, AsrChunk(question[half : half + 1600]))  # no transcription: draft unchanged
    assert decode_tokens(stage.model.tokens, list(state.draft)) == out.text
    fresh = stage.restart_state(state)  # the final's state: no audio, the partial's draft
    assert fresh.n_samples == 0 and fresh.draft == state.draft
    final, _ = stage.step(fresh, AsrChunk(question, final=True))
    whole, _ = stage.step(stage.init_state(), AsrChunk(question, final=True))
    assert final.text == whole.text


def test_concurrent_threads(stage: MoonshineAsrStage) -> None:
    texts = [QUESTION, "Hello there, how are you today?"]
    audio = [synthesize(t) for t in texts]
    expected = [stage.step(stage.init_state(), AsrChunk(a, transcribe=True))[0].text for a in audio]
    got: dict[tuple[int, int], str | None] = {}

    def worker(k: int) -> None:
        for j in range(2):
            i = (k + j) % 2
            got[(k, j)] = stage.step(stage.init_state(), AsrChunk(audio[i], transcribe=True))[0].text

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {(k, j): expected[(k + j) % 2] for k in range(2) for j in range(2)}


def test_missing_package_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "moonshine_cpp", None)  # makes `import moonshine_cpp` fail
    with pytest.raises(ModelError, match="pip install moonshine-cpp"):
        MoonshineModel()


def test_never_loads_libmoonshine(stage: MoonshineAsrStage) -> None:
    # libmoonshine.so is built for AVX-512 and dies with SIGILL elsewhere; only its model files are used
    assert "moonshine_cpp" not in sys.modules
    assert stage.model.threads == 2 and len(stage.model.tokens) == 32000


def test_onnx_conversion_runs_like_the_ort_file(stage: MoonshineAsrStage, question: np.ndarray) -> None:
    """The .ort files re-read as ONNX (asr/ort_format.py) compute what onnxruntime computes from the .ort itself."""
    import onnxruntime as ort

    from asr.vad import package_file

    def ort_session(name: str) -> ort.InferenceSession:
        path = package_file("moonshine_cpp", f"models/base-en/{name}.ort", "moonshine-cpp")
        return ort.InferenceSession(path, providers=["CPUExecutionProvider"])

    x = question[None, :]
    want = ort_session("encoder_model").run(None, {"input_values": x})[0]
    got = stage.model._encoder.run(None, {"input_values": x})[0]
    assert got.shape == want.shape and np.allclose(got, want, atol=1e-3), np.abs(got - want).max()
    feed = {
        "input_ids": np.array([[1]], np.int64),
        "encoder_hidden_states": want,
        "use_cache_branch": np.array([False]),
        **{n: np.zeros((1, h, 0, d), np.float32) for n, (h, d) in stage.model._past_shape.items()},
    }
    want_out = ort_session("decoder_model_merged").run(None, feed)
    got_out = stage.model._decoder.run(None, feed)
    assert len(got_out) == len(want_out)
    assert np.allclose(got_out[0], want_out[0], atol=1e-2), np.abs(got_out[0] - want_out[0]).max()
    assert got_out[0][0, -1].argmax() == want_out[0][0, -1].argmax()


def test_not_an_ort_file_is_a_clear_error(tmp_path: Path) -> None:
    from asr.ort_format import ort_to_onnx

    (tmp_path / "x.ort").write_bytes(b"\0" * 64)
    with pytest.raises(ModelError, match="not an ORT-format model"):
        ort_to_onnx(tmp_path / "x.ort")


def test_tokenizer_file_format(tmp_path: Path) -> None:
    long_token = b"x" * 200  # lengths >= 128 take a second byte
    entries = [
        b"<unk>",
        b"<s>",
        b"</s>",
        b"\xc3",
        b"\xa9",
        "\u2581caf".encode(),
        long_token,
        "\u2581ok".encode(),
    ]
    blob = b"".join(
        (bytes([len(e)]) if len(e) < 128 else bytes([0x80 | (len(e) & 0x7F), len(e) >> 7])) + e
        for e in entries
    )
    (tmp_path / "tok.bin").write_bytes(blob)
    tokens = load_tokenizer(tmp_path / "tok.bin")
    assert tokens == entries
    # byte-fallback pieces join into one UTF-8 character; specials and unknown ids are dropped
    assert decode_tokens(tokens, [1, 5, 3, 4, 7, 2, 999]) == "café ok"
    (tmp_path / "bad.bin").write_bytes(blob[:-2])
    with pytest.raises(ModelError, match="runs past the end"):
        load_tokenizer(tmp_path / "bad.bin")


def test_clean_text_and_config_errors() -> None:
    assert clean_text("  What   is\n the capital?  ") == "What is the capital?"
    with pytest.raises(ConfigError, match="moonshine"):
        load_asr_stage(ComponentConfig(name="asr", backend="whisper"))


def test_each_transcript_carries_the_voice_cue(stage: MoonshineAsrStage, question: np.ndarray) -> None:
    res, _ = stage.step(stage.init_state(), AsrChunk(question, final=True))
    assert res.p_complete is not None and 0.0 < res.p_complete < 1.0
    res, _ = stage.step(stage.init_state(), AsrChunk(question[:4000], transcribe=False))
    assert res.p_complete is None  # no transcript, no cue


BROKEN_OFF = (
    ("What is the capital of", "What is the capital of France?"),
    ("Could you tell me how many", "Could you tell me how many legs a spider has?"),
    ("I would like to book a table for", "I would like to book a table for two people tonight."),
    ("Which planet is the", "Which planet is the largest in our solar system?"),
)


def test_the_voice_cue_hears_a_sentence_broken_off(stage: MoonshineAsrStage) -> None:
    """hibari speaks each whole sentence, and the same sentence cut where the first words end (the
    audio up to there, as a speaker who stops mid-sentence sounds): the cue rates the whole ones more
    complete."""
    from asr.training.whole_cut import cut_whole

    whole_p, cut_p = [], []
    for cut, whole in BROKEN_OFF:
        audio = synthesize(whole)
        broken = cut_whole(audio, synthesize(cut))
        for x, out in ((audio, whole_p), (broken, cut_p)):
            res, _ = stage.step(stage.init_state(), AsrChunk(np.concatenate([x, silence(0.2)]), final=True))
            out.append(res.p_complete)
    assert sum(w > c for w, c in zip(whole_p, cut_p, strict=True)) >= 3, (whole_p, cut_p)
    assert np.mean(whole_p) - np.mean(cut_p) > 0.2, (whole_p, cut_p)


def test_the_voice_cue_can_be_switched_off_and_needs_its_weights(tmp_path: Path) -> None:
    off = load_asr_stage(ComponentConfig(name="asr", backend="moonshine", options={"end_of_turn": False}))
    assert off.end_of_turn is None
    with pytest.raises(ConfigError, match="end-of-turn weights"):
        load_asr_stage(
            ComponentConfig(
                name="asr", backend="moonshine", options={"end_of_turn_weights": str(tmp_path / "none.json")}
            )
        )


def test_time_per_second_of_audio(stage: MoonshineAsrStage) -> None:
    results = []
    for text in (
        "Yes, please.",
        QUESTION,
        "I would like to book a table for four people tomorrow at seven in the evening.",
    ):
        audio = synthesize(text)
        t0 = time.perf_counter()
        out, _ = stage.step(stage.init_state(), AsrChunk(audio, transcribe=True))
        results.append((out.audio_seconds, time.perf_counter() - t0))
    print(
        "\nMoonshine: " + ", ".join(f"{a:.2f} s audio -> {c:.3f} s ({c / a:.3f} s per s)" for a, c in results)
    )
    assert sum(c for _, c in results) / sum(a for a, _ in results) < 1.0  # faster than real time


def test_its_thread_pools_sleep_between_runs(stage: MoonshineAsrStage) -> None:
    # a spinning pool steals the cores from the LLM step that follows a transcription (asr/ort_options.py)
    from asr.ort_options import SPINNING

    model = stage.model
    for session in (model._encoder, model._decoder):
        opts = session.get_session_options()
        assert opts.get_session_config_entry(SPINNING) == "0"
        assert opts.intra_op_num_threads == 2  # the profile's threads
