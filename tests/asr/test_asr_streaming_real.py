"""The shipped streaming FastConformer (asr/weights/fc_small.nemo) on speech synthesised at test time:
what it hears, when partial words appear, and the session core driven by it (real VAD, scripted LLM)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("nemo.collections.asr", reason="the streaming ASR backend needs nemo-toolkit[asr]")

from asr.nemo_streaming import SHIPPED  # noqa: E402
from duplex.base.config import load_profile  # noqa: E402
from duplex.base.messages import AsrChunk  # noqa: E402
from duplex.core.session import SR, SessionCore  # noqa: E402
from tests.speech import synthesize  # noqa: E402

# The shipped model is trained by `python -m asr.training.train_streaming` (docs/asr.md). The weights in the
# repository are an early checkpoint (step 2476, ~87 % held-out WER): the tests below assert what the
# streaming path does with it on real speech (words out while the audio streams in, on time, the
# end-of-utterance signal, the session core's partials and final); what it should *hear* is asserted by
# strict xfails that start passing, and so fail, once a better-trained model is shipped (issue 5).
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not SHIPPED.exists(), reason=f"{SHIPPED.name} is not trained/shipped yet (issue 5)"),
]


@pytest.fixture(scope="module")
def stage():
    import torch

    torch.set_num_threads(1)
    from duplex.runtime.service import load_asr

    return load_asr(load_profile("cpu-fastconformer").component("asr"))


def words_of(text: str) -> set[str]:
    return set(text.lower().replace("?", "").replace(".", "").replace(",", "").split())


QUESTION = "What is the capital of France?"


def stream_question(stage):
    audio = np.concatenate(
        [np.zeros(SR // 4, np.float32), synthesize(QUESTION), np.zeros(SR // 2, np.float32)]
    )
    state, seen_at, packet = stage.init_state(), {}, SR // 50  # 20 ms packets, as a microphone sends
    for i in range(0, audio.size, packet):
        out, state = stage.step(state, AsrChunk(audio[i : i + packet], transcribe=True))
        for k in range(len(out.words)):
            seen_at.setdefault(k, (i + packet) / SR)
    out, state = stage.step(state, AsrChunk(np.zeros(0, np.float32), transcribe=True, final=True))
    return audio, out, seen_at


@pytest.mark.xfail(
    strict=True,
    reason="the shipped checkpoint (step 10000) still hears 'what is the cap of friends' (issue 20)",
)
def test_shipped_model_hears_the_capital_of_france(stage):
    _, out, _ = stream_question(stage)
    assert {"capital", "france"} <= words_of(out.text), out.text


def test_shipped_model_streams_words_within_chunk_plus_lookahead(stage):
    audio, out, seen_at = stream_question(stage)
    assert {"what", "is"} <= words_of(out.text), out.text  # the start of the question is heard
    assert out.is_final and out.words[0].start < out.words[-1].end <= audio.size / SR + 0.1
    bound = (stage.m.chunk_ms + stage.m.lookahead_ms) / 1000 + 0.02
    late = [
        (w.word, seen_at[k] - w.end)
        for k, w in enumerate(out.words)
        if k in seen_at and seen_at[k] - w.end > bound
    ]
    assert not late, (
        f"words that appeared later than one chunk + lookahead ({bound:.2f} s) after they ended: {late}"
    )
    # the decoder's end-of-utterance signal: the trailing half second is blank after the last word
    assert out.trailing_silence_ms >= 240


def test_noise_is_no_word_to_the_decoder(stage):
    """`no_words`: what the session core uses to let a noisy room over an answer neither hold nor stop it
    (tests/duplex/core/test_decoder_eou.py)."""
    noise = (0.05 * np.random.default_rng(0).standard_normal(2 * SR)).astype(np.float32)
    state = stage.init_state()
    for i in range(0, noise.size, SR // 50):
        out, state = stage.step(state, AsrChunk(noise[i : i + SR // 50], transcribe=True))
    assert out.text == "" and not out.words and not out.eou
    assert out.no_words and out.trailing_silence_ms >= 640


def test_session_core_on_the_streaming_asr_transcribes_while_the_user_speaks(stage):
    from asr.vad import load_vad_stage
    from duplex.testing.replay import FakeClock, replay

    profile = load_profile("cpu-fastconformer")
    from duplex.testing.fakes import fake_stages

    stages = fake_stages(lambda history: "paris is the capital of france")
    import dataclasses

    stages = dataclasses.replace(
        stages, vad=load_vad_stage(profile.component("vad")), asr=stage, asr_streaming=stage.streaming
    )
    clock = FakeClock()
    core = SessionCore("s1", profile, stages, clock, options=profile.session)
    speech = synthesize("Could you tell me what the capital of France is?")
    audio = np.concatenate([np.zeros(SR // 2, np.float32), speech, np.zeros(SR * 2, np.float32)])
    result = replay(
        core,
        clock,
        audio,
        {
            "vad": 0.002,
            "asr.partial": 0.02,
            "asr.final": 0.05,
            "llm.first": 0.1,
            "llm.step": 0.05,
            "tts": 0.01,
        },
    )
    final = result.events("transcript.final")
    assert final and final[0].text.strip(), final  # a final transcript of the turn (content: see the xfail)
    speech_end = 0.5 + speech.size / SR
    partial_times = [t.t for t in result.outputs if getattr(t.item, "type", "") == "transcript.partial"]
    assert partial_times and min(partial_times) < speech_end - 0.5, (
        "no partial transcript while the user spoke"
    )
    assert result.events("response.done")[0].text == "paris is the capital of france"


def test_training_goes_on_from_the_shipped_model(tmp_path):
    """`--init` seeds a run from the shipped .nemo: same tokenizer and weights, its step, fresh optimiser."""
    import json

    import torch

    from asr.training.streaming_model import build_model, model_config
    from asr.training.train_streaming import RESTART_WARMUP, init_run, lr_at

    meta = init_run(SHIPPED, tmp_path)
    info = json.loads(SHIPPED.with_suffix(".json").read_text())
    ckpt = torch.load(tmp_path / "last.pt", weights_only=False)
    assert ckpt["step"] == info["step"] == meta["restart_step"] and "opt" not in ckpt
    assert {p.name for p in (tmp_path / "tokenizer").iterdir()} >= {"tokenizer.model", "vocab.txt"}
    model = build_model(
        model_config(tmp_path / "tokenizer", d_model=meta["d_model"], n_layers=meta["layers"])
    )
    model.load_state_dict(ckpt["model"])  # strict: every tensor of the shipped model, nothing missing
    assert model.tokenizer.vocab_size == info["vocab"]
    # the learning rate warms up again from the restart step and then follows the original schedule
    step = info["step"]
    assert lr_at(step + 1, 2e-3, 400, step) < lr_at(step + RESTART_WARMUP, 2e-3, 400, step)
    assert lr_at(step + RESTART_WARMUP, 2e-3, 400, step) == lr_at(step + RESTART_WARMUP, 2e-3, 400)


def test_init_from_a_recipe_two_export_keeps_the_recipe_clock(tmp_path):
    """An export of a recipe-2 run records where its recipe started: `--init` from it goes on with the same
    ramps and rate schedule instead of starting them again (a GPU slice continues the CPU run); an export
    without that record starts the recipe at its own step."""
    import json

    from asr.training.train_streaming import init_run

    info = {
        k: v for k, v in json.loads(SHIPPED.with_suffix(".json").read_text()).items() if k != "recipe_start"
    }
    started = int(info["step"]) - 1983
    for name, extra in (("recipe2", {"recipe_start": started}), ("older", {})):
        export = tmp_path / name / "fc_small.nemo"
        export.parent.mkdir()
        export.symlink_to(SHIPPED.resolve())
        export.with_suffix(".json").write_text(json.dumps({**info, **extra}))
        meta = init_run(export, tmp_path / f"run-{name}")
        assert meta["restart_step"] == info["step"]
        assert meta["recipe_start"] == (started if extra else info["step"])
