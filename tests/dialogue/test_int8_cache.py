"""The int8 cache: a second int8 load reads the saved int8 weights instead of quantising the float ones,
and gives the same model, number for number; a damaged file is rebuilt."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dialogue import llm_weights as lw
from tests.dialogue.test_llm_options import tiny_model, tiny_tokenizer


@pytest.fixture
def tiny_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DUPLEX_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "tiny"
    tok = tiny_tokenizer()
    tiny_model(len(tok), seed=3).save_pretrained(str(d))
    tok.save_pretrained(str(d))
    return d


def _cache_files(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "cache" / "int8").glob("*.pt"))


def _logits(model, tok) -> torch.Tensor:
    ids = torch.tensor([tok.encode("what is the capital of france?", add_special_tokens=False)])
    with torch.inference_mode():
        return model(input_ids=ids).logits


def test_second_load_reads_the_int8_cache_and_is_identical(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, tok = lw.load({"path": str(tiny_dir)}, "int8-dynamic", progress=False)
    files = _cache_files(tmp_path)
    assert len(files) == 1
    calls: list[int] = []
    real = lw.quantize_int8_dynamic
    monkeypatch.setattr(lw, "quantize_int8_dynamic", lambda *a, **k: calls.append(1) or real(*a, **k))
    second, tok2 = lw.load({"path": str(tiny_dir)}, "int8-dynamic", progress=False)
    assert calls == []  # nothing quantised again
    assert [type(m).__name__ for m in second.modules()] == [type(m).__name__ for m in first.modules()]
    assert torch.equal(_logits(second, tok2), _logits(first, tok))
    # the float weights were never read: no module of the cached model is a float Linear
    assert not any(type(m) is torch.nn.Linear for m in second.modules())
    assert not any(t.is_meta for t in [*second.parameters(), *second.buffers()])


def test_a_damaged_cache_is_rebuilt(tiny_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    first, tok = lw.load({"path": str(tiny_dir)}, "int8-dynamic", progress=False)
    (f,) = _cache_files(tmp_path)
    f.write_bytes(b"not a torch file")
    again, _ = lw.load({"path": str(tiny_dir)}, "int8-dynamic", progress=False)
    assert "could not be loaded" in caplog.text
    assert torch.equal(_logits(again, tok), _logits(first, tok))
    assert _cache_files(tmp_path) == [f] and f.stat().st_size > 1000  # written again


def test_changed_weights_get_a_new_cache(tiny_dir: Path, tmp_path: Path) -> None:
    lw.load({"path": str(tiny_dir)}, "int8-dynamic", progress=False)
    tok = tiny_tokenizer()
    tiny_model(len(tok), seed=4).save_pretrained(str(tiny_dir))  # other weights in the same folder
    before = _cache_files(tmp_path)
    model, _ = lw.load({"path": str(tiny_dir)}, "int8-dynamic", progress=False)
    after = _cache_files(tmp_path)
    assert len(after) == 1 and after != before  # a new file, and the stale one removed
    fresh = lw.quantize_int8_dynamic(tiny_model(len(tok), seed=4), tok, alpha=lw.SMOOTH_ALPHA)
    assert torch.equal(_logits(model, tok), _logits(fresh, tok))


def test_float_loads_and_adapted_models_do_not_use_it(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lw.load({"path": str(tiny_dir)}, "float32", progress=False)
    with monkeypatch.context() as m:
        m.setenv("DUPLEX_INT8_CACHE", "0")
        lw.load({"path": str(tiny_dir)}, "int8-dynamic", progress=False)
    lw.load({"path": str(tiny_dir)}, "int8-dynamic", progress=False, before_quantize=lambda m: None)
    assert _cache_files(tmp_path) == []
