"""`duplex codec encode|decode|roundtrip` on a tiny seeded codec: the codes file decodes to exactly the round
trip's samples, its length is the input's, the bitrate is the codec's, and bad files get clear errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from safetensors.torch import save_file

from codec.speech_codec import SR
from codec.tool import CodecToolError, main
from duplex.cli import main as duplex_main
from tests.codec.test_speech_codec import TINY, tiny_codec


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    m = tiny_codec(3)
    path = tmp_path / "codec.safetensors"
    sd = {k: v.contiguous() for k, v in m.state_dict().items()}
    save_file(sd, str(path), metadata={"config": json.dumps(TINY.to_dict())})
    return path


def tone(seconds: float, rate: int) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 220 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)


def test_encode_then_decode_equals_the_round_trip(tmp_path: Path, weights: Path) -> None:
    wav = tmp_path / "in.wav"
    sf.write(str(wav), tone(1.3, SR), SR, subtype="PCM_16")
    lines = main("encode", wav, tmp_path / "c.npz", weights)
    assert lines[0].startswith("wrote")
    assert f"{TINY.bitrate:.1f} bps nominal" in "\n".join(lines)
    main("decode", tmp_path / "c.npz", tmp_path / "dec.wav", weights)
    main("roundtrip", wav, tmp_path / "rt.wav", weights)
    dec, rate = sf.read(str(tmp_path / "dec.wav"), dtype="int16")
    rt, _ = sf.read(str(tmp_path / "rt.wav"), dtype="int16")
    assert rate == SR and len(dec) == int(1.3 * SR)  # the input's length, not a whole code frame more
    assert np.array_equal(dec, rt)
    codes = np.load(tmp_path / "c.npz")["codes"]
    assert codes.shape == (math.ceil(int(1.3 * SR) / TINY.samples_per_code), TINY.groups)


def test_any_rate_and_stereo_are_read_as_24k_mono(tmp_path: Path, weights: Path) -> None:
    wav = tmp_path / "in.wav"
    x = tone(0.5, 16000)
    sf.write(str(wav), np.stack([x, x], 1), 16000, subtype="PCM_16")
    main("roundtrip", wav, tmp_path / "rt.wav", weights)
    out, rate = sf.read(str(tmp_path / "rt.wav"))
    assert rate == SR and out.ndim == 1 and len(out) == SR // 2


def test_bad_inputs_are_clear_errors(tmp_path: Path, weights: Path) -> None:
    (tmp_path / "junk.wav").write_bytes(b"not a wav")
    with pytest.raises(CodecToolError, match="cannot read"):
        main("encode", tmp_path / "junk.wav", tmp_path / "c.npz", weights)
    with pytest.raises(CodecToolError, match="not a codes file"):
        main("decode", tmp_path / "junk.wav", tmp_path / "o.wav", weights)
    with pytest.raises(CodecToolError, match="weights not found"):
        main("encode", tmp_path / "junk.wav", tmp_path / "c.npz", tmp_path / "missing.safetensors")
    # codes made with one codec do not decode with another
    wav = tmp_path / "in.wav"
    sf.write(str(wav), tone(0.5, SR), SR)
    main("encode", wav, tmp_path / "c.npz", weights)
    other = tmp_path / "other.safetensors"
    sd = {k: v.contiguous() for k, v in tiny_codec(4).state_dict().items()}
    save_file(sd, str(other), metadata={"config": json.dumps(TINY.to_dict())})
    with pytest.raises(CodecToolError, match="decode with that codec"):
        main("decode", tmp_path / "c.npz", tmp_path / "o.wav", other)
    # ... but they do with the same encoder and a decoder trained further (`train_codec --freeze-encoder`)
    m = tiny_codec(3)
    sd = {k: v + 0.01 if k.startswith("dec_") else v for k, v in m.state_dict().items()}
    tuned = tmp_path / "tuned.safetensors"
    save_file(
        {k: v.contiguous() for k, v in sd.items()},
        str(tuned),
        metadata={"config": json.dumps(TINY.to_dict())},
    )
    main("decode", tmp_path / "c.npz", tmp_path / "o.wav", tuned)
    assert sf.info(str(tmp_path / "o.wav")).frames == SR // 2


def test_the_cli_reports_errors_with_exit_code_2(tmp_path: Path, weights: Path, capsys) -> None:
    rc = duplex_main(
        [
            "codec",
            "encode",
            str(tmp_path / "none.wav"),
            "--out",
            str(tmp_path / "c.npz"),
            "--weights",
            str(weights),
        ]
    )
    assert rc == 2 and "duplex codec: cannot read" in capsys.readouterr().err
