"""The LLMs' `device` option (issue 22): parsed and validated without a GPU, a clear failure where CUDA is
asked for but absent, int8-dynamic refused on CUDA, and bfloat16 decode through `CachedLM` (one session and
`feed_batch`) with the model on an explicit device. Runs on the CPU; the CUDA run is scripts/gpu_check.sh."""

from __future__ import annotations

import random

import pytest
import torch

from dialogue import llm_weights
from dialogue.engine import DrafterOptions, SlowOptions, load_dialogue_stage
from dialogue.kv_cache import CachedLM
from dialogue.llm import LlmOptions
from duplex.base.config import ConfigError, load_profile
from tests.dialogue.test_kv_cache import rand_ids, tiny_model


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# -- the option ---------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [LlmOptions, SlowOptions, DrafterOptions])
def test_device_defaults_to_cpu_and_parses(cls: type) -> None:
    assert cls.from_mapping({}).device == "cpu"
    for device in ("cpu", "cuda", "cuda:1"):
        opts = cls.from_mapping({"device": device, "dtype": "bfloat16"})
        assert opts.device == device and opts.dtype == "bfloat16"


@pytest.mark.parametrize("cls", [LlmOptions, SlowOptions, DrafterOptions])
@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "CUDA", ""])
def test_bad_device_is_a_config_error(cls: type, device: str) -> None:
    with pytest.raises(ConfigError, match="is not cpu, cuda or cuda:N"):
        cls.from_mapping({"device": device, "dtype": "bfloat16"})


@pytest.mark.parametrize("cls", [LlmOptions, SlowOptions, DrafterOptions])
def test_int8_dynamic_on_cuda_is_refused(cls: type) -> None:
    with pytest.raises(ConfigError, match="int8-dynamic runs on the CPU only"):
        cls.from_mapping({"device": "cuda", "dtype": "int8-dynamic"})


def test_load_refuses_int8_on_cuda_before_reading_weights() -> None:
    with pytest.raises(ConfigError, match="int8-dynamic runs on the CPU only"):
        llm_weights.load({"path": "/nonexistent/model"}, "int8-dynamic", progress=False, device="cuda")


def test_gpu_profile_runs_both_llms_on_cuda_in_bf16() -> None:
    gpu = load_profile("gpu")
    for name, cls in (("llm", SlowOptions), ("drafter", DrafterOptions)):
        opts = cls.from_mapping(gpu.component(name).options)
        assert (opts.device, opts.dtype) == ("cuda", "bfloat16")
    cpu = load_profile("cpu")  # the anchors the gpu block merges leave the cpu profile as it was
    assert SlowOptions.from_mapping(cpu.component("llm").options).device == "cpu"
    assert DrafterOptions.from_mapping(cpu.component("drafter").options).dtype == "int8-dynamic"
    # the voice: the project's flow voice on CUDA (hibari has no CUDA path); cpu keeps hibari
    tts = gpu.component("tts")
    assert (tts.backend, tts.options["device"]) == ("flow", "cuda") and cpu.component(
        "tts"
    ).backend == "hibari"


# -- no CUDA: fail clearly ------------------------------------------------------------------------


def test_cuda_without_cuda_fails_naming_the_option(no_cuda: None) -> None:
    with pytest.raises(ConfigError) as err:
        llm_weights.load({"path": "/nonexistent/model"}, "bfloat16", progress=False, device="cuda")
    msg = str(err.value)
    assert "device: cuda" in msg and "--profile cpu" in msg and "torch.cuda.is_available() is False" in msg


def test_gpu_profile_without_cuda_fails_at_load(no_cuda: None) -> None:
    gpu = load_profile("gpu")
    with pytest.raises(ConfigError, match=r"llm: the profile's option `device: cuda`.*--profile cpu"):
        load_dialogue_stage(gpu.component("llm"), gpu.component("drafter"), progress=False)


def test_gpu_profile_voice_without_cuda_fails_at_load(no_cuda: None) -> None:
    from tts.flow_tts import load_flow_tts_stage

    with pytest.raises(ConfigError, match=r"tts: the profile's option `device: cuda`.*--profile cpu"):
        load_flow_tts_stage(load_profile("gpu").component("tts"))


def test_drafter_on_cuda_without_cuda_fails_before_loading(no_cuda: None) -> None:
    gpu = load_profile("gpu")
    cpu = load_profile("cpu")
    # a remote slow model needs no weights, so the drafter's check is the first to run
    remote = type(cpu.component("llm"))(
        name="llm", backend="openai-chat", options={"base_url": "http://127.0.0.1:9/v1", "model": "m"}
    )
    with pytest.raises(ConfigError, match=r"drafter: the profile's option `device: cuda`"):
        load_dialogue_stage(remote, gpu.component("drafter"), progress=False)


def test_cuda_index_past_the_gpus_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="names GPU 3, but torch sees 1"):
        llm_weights.require_device("cuda:3", "llm")
    assert llm_weights.require_device("cpu") == torch.device("cpu")


# -- bfloat16 decode on an explicit device ----------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_decode_through_cached_lm(arch: str) -> None:
    device = torch.device("cpu")
    model = tiny_model(arch, seed=5).to(device=device, dtype=torch.bfloat16)
    lm = CachedLM(model, sink_tokens=4, window_tokens=64, evict_chunk=8)
    assert lm.fast is not None  # the lean decoder runs plain bf16 Linears
    assert lm._device() == device
    rng = random.Random(3)
    prompts = [rand_ids(rng, n) for n in (9, 17, 5)]
    ref = [lm.new() for _ in prompts]
    bat = [lm.new() for _ in prompts]
    for a, b, p in zip(ref, bat, prompts, strict=True):
        lm.feed(a, p)
        lm.feed(b, p)
    agree = total = 0
    for _ in range(70):  # past the window: eviction re-rotates bf16 keys on the device too
        ta = [int(torch.argmax(c.logits)) for c in ref]
        tb = [int(torch.argmax(c.logits)) for c in bat]
        for c, t in zip(ref, ta, strict=True):
            lm.feed(c, [t])
        res = lm.feed_batch(bat, [[t] for t in tb])
        agree += sum(int(x == y) for x, y in zip(ta, tb, strict=True))
        total += len(ta)
        for r in res:
            assert r.logits.device == device and r.logits.dtype == torch.float32
            assert torch.isfinite(r.logits).all() and torch.isfinite(r.hidden).all()
    assert all(c.evicted > 0 for c in ref + bat)
    for c in ref + bat:
        assert c.cache.get_seq_length() == len(c.ids) <= lm.capacity
        assert all(layer.keys.dtype == torch.bfloat16 for layer in c.cache.layers)
    # batched bf16 rounds a little differently, so a near-tie may flip; most tokens must agree
    assert agree / total >= 0.8


def test_bf16_load_cast_and_move(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    """`load` casts on the CPU, then moves to the device: here the device is the CPU, so only the cast shows."""
    model = tiny_model("qwen2", seed=1)
    monkeypatch.setattr(llm_weights, "prepare", lambda w, progress=True: tmp_path)
    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: object())
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: model.to(k.get("dtype"))
    )
    m, _ = llm_weights.load({"path": str(tmp_path)}, "bfloat16", progress=False, device="cpu")
    assert m.model.embed_tokens.weight.dtype == torch.bfloat16
    assert m.model.embed_tokens.weight.device == torch.device("cpu")
