"""The cache-aware streaming ASR backend on tiny seeded NeMo models built here (no weights needed).

Proves: incremental log-mel == offline log-mel; chunk-by-chunk encoder output and greedy transcript ==
the full-context forward, for every lookahead (CTC and RNNT); N sessions stepped together == each alone,
with sessions joining and leaving mid-stream; a `.nemo` file written here loads through the same code as
a user's checkpoint, selected by models.yaml options.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("nemo.collections.asr", reason="the streaming ASR backend needs nemo-toolkit[asr]")
import torch  # noqa: E402

from asr.nemo_streaming import (  # noqa: E402
    NemoStreamingAsrStage,
    NemoStreamingModel,
    complete_frames,
    load_streaming_asr_stage,
)
from asr.training.streaming_model import ATT_CONTEXT_SIZES, build_model, model_config, train_tokenizer  # noqa: E402
from duplex.base.config import ComponentConfig, ConfigError  # noqa: E402
from duplex.base.messages import AsrChunk  # noqa: E402
from tests.speech import synthesize  # noqa: E402

TEXT = [
    "hello how are you today",
    "what is the capital of france",
    "book a table for four at seven",
    "the quick brown fox jumps over the lazy dog",
    "stop what is two plus two",
    "thank you very much",
]


def lookahead0_startup_frames(left_context: int, n_layers: int) -> int:
    """NeMo's known start-up frames at lookahead 0: the first chunk is one feature frame and the second
    one's pre-encode cache is 8 zero feature frames, where the offline forward pads the subsampling's
    *intermediate* activations instead, so the first 2 encoder frames differ; every layer's attention
    then carries that to `left_context` more frames. Beyond these, streaming equals offline."""
    return 2 + left_context * n_layers


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tok = train_tokenizer(TEXT * 20, tmp_path_factory.mktemp("tok"), vocab_size=40)
    models = {}
    for kind in ("ctc", "hybrid"):
        cfg = model_config(
            tok,
            d_model=32,
            n_layers=2,
            n_heads=2,
            conv_kernel_size=5,
            subsampling_conv_channels=16,
            decoder=kind,
            dropout=0.0,
        )
        torch.manual_seed(1)
        m = build_model(cfg).eval()
        with torch.no_grad():  # a random head emits blanks and tokens alike: transcripts are not empty
            head = m.decoder if kind == "ctc" else m.ctc_decoder
            head.decoder_layers[0].bias[-1] -= 1.0
        models[kind] = m
    return models


@pytest.fixture(scope="module")
def speech():
    return np.concatenate(
        [synthesize("What is the capital of France? I would like to know."), np.zeros(4000, np.float32)]
    )


def offline(model: NemoStreamingModel, audio: np.ndarray):
    m = model.model
    x = torch.from_numpy(audio)[None]
    with torch.inference_mode():
        feats, flen = m.preprocessor(input_signal=x, length=torch.tensor([audio.size]))
        enc, elen = m.encoder(audio_signal=feats, length=flen)
    return feats[0, :, : int(flen[0])], enc[0, :, : int(elen[0])]


def stream(stage: NemoStreamingAsrStage, audio: np.ndarray, sizes: list[int]):
    state, out, i, k = stage.init_state(), None, 0, 0
    while i < audio.size:
        n = sizes[k % len(sizes)]
        out, state = stage.step(state, AsrChunk(audio[i : i + n], transcribe=True))
        i, k = i + n, k + 1
    out, state = stage.step(state, AsrChunk(np.zeros(0, np.float32), transcribe=True, final=True))
    return out, state


def test_incremental_features_equal_offline(tiny, speech):
    model = NemoStreamingModel(tiny["ctc"])
    ref, _ = offline(model, speech)
    for sizes in ([160], [1000, 37, 2560], [7, 5000]):
        state, got, i, k = model.model and NemoStreamingAsrStage(model).init_state(), [], 0, 0
        while i < speech.size:
            n = sizes[k % len(sizes)]
            state, f = model.features_for(state, speech[i : i + n], final=False)
            if f is not None:
                got.append(f)
            assert state.next_frame == complete_frames(min(i + n, speech.size))
            i, k = i + n, k + 1
        state, f = model.features_for(state, np.zeros(0, np.float32), final=True)
        got.append(f)
        feats = torch.cat(got, dim=1)
        assert feats.shape == ref.shape
        torch.testing.assert_close(feats, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["ctc", "hybrid"])
@pytest.mark.parametrize("context", ATT_CONTEXT_SIZES, ids=lambda c: f"lookahead{c[1]}")
def test_streaming_equals_offline(tiny, speech, kind, context):
    model = NemoStreamingModel(
        tiny[kind], att_context_size=context, decoder="ctc" if kind == "ctc" else "rnnt"
    )
    model.keep_encoded = True
    stage = NemoStreamingAsrStage(model)
    skip = 0
    if context[1] == 0:  # long enough to have frames after the start-up ones
        speech = np.concatenate([speech] * 3)
        skip = lookahead0_startup_frames(context[0], len(model.model.encoder.layers))
    _, ref_enc = offline(model, speech)
    assert ref_enc.shape[1] > skip + 10
    texts = set()
    for sizes in ([512], [2560, 300], [16000]):  # 32 ms packets, uneven ones, whole seconds
        if context[1] == 0 and sizes == [512]:
            continue  # (slow at 1 frame per chunk; the other two cover it)
        out, state = stream(stage, speech, sizes)
        enc = torch.cat(state.encoded, dim=1)
        assert enc.shape == ref_enc.shape, (enc.shape, ref_enc.shape)
        torch.testing.assert_close(enc[:, skip:], ref_enc[:, skip:], atol=2e-4, rtol=1e-3)
        texts.add(out.text)
        assert out.is_final and state.finished and len(out.words) == len(out.text.split())
    assert len(texts) == 1  # the same transcript however the audio was packetised
    if context[1] > 0:  # and the same as greedy decoding of the offline forward
        if kind == "ctc":
            with torch.inference_mode():
                lp = model.ctc_head(encoder_output=ref_enc[None])
            labels, ids, prev = lp.argmax(-1)[0].tolist(), [], -1
            for lab in labels:
                if lab != prev and lab != model.blank:
                    ids.append(lab)
                prev = lab
            expected = model.tokenizer.ids_to_text(ids)
        else:
            with torch.inference_mode():
                hyps = model.model.decoding.rnnt_decoder_predictions_tensor(
                    encoder_output=ref_enc[None],
                    encoded_lengths=torch.tensor([ref_enc.shape[1]]),
                    return_hypotheses=True,
                )
            hyps = hyps[0] if isinstance(hyps, tuple) else hyps
            expected = model.tokenizer.ids_to_text([int(t) for t in hyps[0].y_sequence])
        assert " ".join(expected.split()) == texts.pop()
        assert expected.strip(), "a random head should still emit something"


@pytest.mark.parametrize("kind", ["ctc", "hybrid"])
def test_batched_sessions_equal_each_alone(tiny, kind):
    """Four sessions with different audio, joining and leaving mid-stream, stepped as one batch."""
    model = NemoStreamingModel(
        tiny[kind], att_context_size=[70, 6], decoder="ctc" if kind == "ctc" else "rnnt"
    )
    model.keep_encoded = True
    stage = NemoStreamingAsrStage(model)
    audios = [synthesize(t) for t in TEXT[:4]]
    joins = [0, 3, 5, 9]  # tick at which each session starts; 0.1 s per tick
    packet = 1600
    alone = [stream(stage, a, [packet]) for a in audios]
    states = [None] * 4
    pos = [0] * 4
    finals: list = [None] * 4
    tick = 0
    while any(f is None for f in finals):
        items, who = [], []
        for s in range(4):
            if tick < joins[s] or finals[s] is not None:
                continue
            if states[s] is None:
                states[s] = stage.init_state()
            a = audios[s]
            done = pos[s] >= a.size
            items.append(
                (
                    states[s],
                    AsrChunk(
                        a[pos[s] : pos[s] + packet] if not done else np.zeros(0, np.float32),
                        transcribe=True,
                        final=done,
                    ),
                )
            )
            who.append(s)
            pos[s] += packet
        assert len(items) >= 1
        for s, (out, st) in zip(who, stage.step_batch(items), strict=False):
            states[s] = st
            if out.is_final:
                finals[s] = (out, st)
        tick += 1
    for s in range(4):
        (out_b, st_b), (out_a, st_a) = finals[s], alone[s]
        assert out_b.text == out_a.text and out_b.words == out_a.words
        torch.testing.assert_close(
            torch.cat(st_b.encoded, 1), torch.cat(st_a.encoded, 1), atol=1e-5, rtol=1e-5
        )


def test_nemo_file_loads_through_models_yaml_path(tiny, speech, tmp_path):
    path = tmp_path / "tiny_streaming.nemo"
    tiny["ctc"].save_to(str(path))
    cfg = ComponentConfig(
        name="asr",
        backend="nemo-streaming",
        weights={"path": str(path)},
        options={"lookahead_ms": 480, "decoder": "ctc", "eou_silence_ms": 320},
    )
    stage = load_streaming_asr_stage(cfg)
    assert stage.m.att_context_size == [70, 6] and stage.m.lookahead_ms == 480 and stage.m.chunk_ms == 560
    direct = NemoStreamingAsrStage(NemoStreamingModel(tiny["ctc"], att_context_size=[70, 6]))
    assert stream(stage, speech, [4000])[0].text == stream(direct, speech, [4000])[0].text
    with pytest.raises(ConfigError, match="lookahead_ms 500 is not one of the model's"):
        load_streaming_asr_stage(
            ComponentConfig("asr", "nemo-streaming", {"path": str(path)}, {"lookahead_ms": 500})
        )
    with pytest.raises(ConfigError, match="needs an RNNT"):
        load_streaming_asr_stage(
            ComponentConfig("asr", "nemo-streaming", {"path": str(path)}, {"decoder": "rnnt"})
        )
    from duplex.base.errors import ModelError

    with pytest.raises(ModelError, match="does not exist"):
        load_streaming_asr_stage(
            ComponentConfig("asr", "nemo-streaming", {"path": str(tmp_path / "no.nemo")})
        )
    bad = tmp_path / "bad.nemo"
    bad.write_bytes(b"not a tar file")
    with pytest.raises(ModelError, match="cannot load NeMo checkpoint"):
        load_streaming_asr_stage(ComponentConfig("asr", "nemo-streaming", {"path": str(bad)}))


def test_bad_input_and_reuse_after_final(tiny):
    stage = NemoStreamingAsrStage(NemoStreamingModel(tiny["ctc"]))
    with pytest.raises(ValueError, match="mono 1-D"):
        stage.step(stage.init_state(), AsrChunk(np.zeros((2, 100), np.float32)))
    out, state = stage.step(stage.init_state(), AsrChunk(np.zeros(100, np.float32), final=True))
    assert out.is_final and out.text == "" and not out.eou
    with pytest.raises(ValueError, match="finalised"):
        stage.step(state, AsrChunk(np.zeros(100, np.float32)))


def test_missing_shipped_model_says_how_to_get_one(tmp_path, monkeypatch):
    import asr.nemo_streaming as ns
    from duplex.base.errors import ModelError

    monkeypatch.setattr(ns, "SHIPPED", tmp_path / "fc_small.nemo")
    with pytest.raises(ModelError, match="not trained yet.*asr.training.train_streaming"):
        load_streaming_asr_stage(ComponentConfig("asr", "nemo-streaming", {"shipped": True}))
    with pytest.raises(ConfigError, match="weights need one of"):
        load_streaming_asr_stage(ComponentConfig("asr", "nemo-streaming", {}))


def test_eval_asr_command_scores_each_lookahead_and_times_words_by_the_synthesiser(tiny, tmp_path):
    pytest.importorskip("espeakng_loader")
    import json

    from duplex.cli import main as cli_main

    path = tmp_path / "tiny.nemo"
    tiny["ctc"].save_to(str(path))
    out = tmp_path / "eval"
    rc = cli_main(
        [
            "eval",
            "asr",
            "--model",
            str(path),
            "-n",
            "3",
            "--lookaheads",
            "480,0",
            "--no-moonshine",
            "--no-progress",
            "--out",
            str(out),
        ]
    )
    assert rc == 0 and (out / "asr.png").exists()
    result = json.loads((out / "asr.json").read_text())
    held = result["sets"]["heldout-voices"]
    assert held["n"] == 3 and held["words"] >= 9 and set(held["streaming"]) == {"480", "0"}
    for la, entry in held["streaming"].items():
        assert entry["lookahead_ms"] == float(la) and entry["wer"] >= 0 and entry["rtf"] > 0
        assert entry["first_partial_after_word_end_ms"]["word_end"] == "synthesiser"
        assert len(entry["examples"]) == 3 and all(e["ref"] for e in entry["examples"])
