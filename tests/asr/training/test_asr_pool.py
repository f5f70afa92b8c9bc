"""Recipe 2: smooth schedules, the pooled data stream (deterministic, resumable to the batch, targets built
in the loader), checkpoint averaging, the kill criterion and the dry run of the GPU path."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from asr.training.pool import Schedule, encoder_frames, lr_schedule, smooth_ramp
from asr.training.train_streaming import average_checkpoints, kill_verdict


def test_ramps_have_no_jumps() -> None:
    s = Schedule()
    for f in (s.augment_strength, s.spec_scale, s.align_weight, s.phone_weight):
        values = [f(t) for t in range(0, 4000, 10)]
        assert max(abs(b - a) for a, b in zip(values, values[1:], strict=False)) < 0.02
    assert s.spec_scale(0) == 0 and s.spec_scale(3000) == 1 and s.align_weight(5000) == pytest.approx(0.1)
    assert s.phone_weight(10**6) == pytest.approx(0.2)  # the dense phone loss stays
    scratch = Schedule(words_from=7)
    assert scratch.max_words(0) == 7 and scratch.max_words(2000) == 0 and Schedule().max_words(0) == 0
    assert smooth_ramp(5, 10, 10) == 0.0 and smooth_ramp(10, 10, 10) == 1.0


def test_learning_rate_rewarms_holds_and_decays() -> None:
    lr = [lr_schedule(t, 1e-3, warmup=100, hold=200, total=1000) for t in range(1, 1200)]
    assert lr[0] == pytest.approx(1e-5) and lr[99] == pytest.approx(1e-3) and lr[250] == pytest.approx(1e-3)
    assert all(b <= a + 1e-12 for a, b in zip(lr[300:], lr[301:], strict=False))
    assert lr[-1] == pytest.approx(5e-5)


def test_kill_criterion() -> None:
    def panel(step, train, plain):
        return {"step": step, "panel": {"train-voices": train, "heldout-synthetic": plain}}

    history = [{"step": 2476, "wer": {}}, panel(2476, 0.80, 0.85), panel(5000, 0.70, 0.80)]
    assert kill_verdict(history, 2476, 6000) is None  # too early to judge
    assert "kill criterion met" in kill_verdict([*history, panel(8500, 0.70, 0.70)], 2476, 6000)
    assert kill_verdict([*history, panel(8500, 0.60, 0.70)], 2476, 6000) is None
    # a run --init from an export past the judgement starts its history there: nothing to compare with
    assert kill_verdict([panel(8707, 0.66, 0.59), panel(8800, 0.64, 0.63)], 2476, 6000) is None


def test_average_checkpoints(tmp_path) -> None:
    for step, value in ((100, 1.0), (200, 2.0), (300, 4.0)):
        torch.save({"w": torch.full((2,), value), "n": torch.tensor(step)}, tmp_path / f"ckpt-{step}.pt")
    state, steps = average_checkpoints(tmp_path, 2)
    assert steps == [200, 300] and torch.allclose(state["w"], torch.tensor([3.0, 3.0]))
    assert average_checkpoints(tmp_path / "none", 2) is None


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> str:
    pytest.importorskip("sentencepiece")
    from asr.training.data import normalize_text
    from asr.training.speakers import dictionary_sentences
    from asr.training.streaming_model import train_tokenizer

    out = tmp_path_factory.mktemp("tok")
    train_tokenizer([normalize_text(s) for s in dictionary_sentences()[:2000]], out, 96)
    return str(out / "tokenizer.model")


def _batches(stream, n):
    it = iter(stream)
    return [next(it) for _ in range(n)]


def test_pool_stream_is_deterministic_and_resumes_to_the_batch(tokenizer) -> None:
    pytest.importorskip("espeakng_loader")
    from asr.training.pool import PoolStream

    kw = dict(pool_size=4, epochs=2, engines=("espeak",))
    full = _batches(PoolStream(3, 2, tokenizer, **kw), 6)  # two pools of 4 examples, 2 epochs each
    assert [b["batch_index"] for b in full] == list(range(6))
    # the first pool is made whole before its first batch; the next one a slice after each batch
    assert full[0]["pool_gen_s"] > 0 and all(b["pool_gen_s"] >= 0 for b in full)
    # an epoch reuses the pool's texts in a new order, with new augmentation
    assert sorted(t for b in full[:2] for t in b["texts"]) == sorted(t for b in full[2:4] for t in b["texts"])
    assert not torch.equal(full[0]["audio"], full[2]["audio"])
    resumed = _batches(PoolStream(3, 2, tokenizer, start_batch=3, start_t=3, **kw), 3)
    for a, b in zip(full[3:], resumed, strict=True):
        # the same examples, augmented the same way; espeak's klatt voices draw their aspiration noise from
        # the synthesiser process's own generator, so samples may differ slightly, never the timing
        assert a["texts"] == b["texts"] and torch.equal(a["lengths"], b["lengths"])
        assert torch.equal(a["align"], b["align"]) and torch.equal(a["targets"], b["targets"])
        corr = np.corrcoef(a["audio"].flatten().numpy(), b["audio"].flatten().numpy())[0, 1]
        assert corr > 0.9
    for b in full:  # targets built in the loader, sized to the encoder's frames
        frames = encoder_frames(int(b["lengths"].max()))
        assert b["align"].shape == b["phones"].shape == (2, frames)
        assert (b["phones"][:, 0] != -100).all()  # espeak speech: every example has phone labels
        assert b["targets"].shape[0] == 2 and (b["target_lengths"] > 0).all()


def test_a_run_that_goes_on_from_an_export_hears_new_examples(tokenizer) -> None:
    """`examples_made` bounds the indices a stream has made; a stream started past it (init_run sets
    `example_offset` from the export's `examples_next`) makes none of the earlier run's examples."""
    pytest.importorskip("espeakng_loader")
    from asr.training.pool import PoolStream

    kw = dict(pool_size=4, epochs=2, engines=("espeak",))
    first = PoolStream(3, 2, tokenizer, **kw)
    seen = {t for b in _batches(first, 6) for t in b["texts"]}
    # 6 batches of 2 from pools of 4 examples heard twice: pools 0-1 used, pool 2 may be made ahead
    assert first.examples_made(6) == 12  # indices 0-11
    later = PoolStream(3, 2, tokenizer, example_offset=first.examples_made(6), **kw)
    assert not seen & {t for b in _batches(later, 4) for t in b["texts"]}


def test_encoder_frames_match_the_model() -> None:
    pytest.importorskip("nemo.collections.asr")
    import tempfile

    from asr.training.data import normalize_text
    from asr.training.speakers import dictionary_sentences
    from asr.training.streaming_model import build_model, model_config, train_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        train_tokenizer([normalize_text(s) for s in dictionary_sentences()[:500]], tmp, 64)
        model = build_model(model_config(tmp, d_model=32, n_layers=1)).eval()
        lengths = [1600, 16000, 16001, 23999, 47360]
        audio = torch.zeros(len(lengths), max(lengths))
        with torch.no_grad():
            _, el, _ = model.forward(input_signal=audio, input_signal_length=torch.tensor(lengths))
    assert el.tolist() == [encoder_frames(n) for n in lengths]


@pytest.mark.parametrize("distill", ["0", "1.0"])
def test_dry_run_of_the_gpu_path_on_cpu(distill: str) -> None:
    """Three steps, a checkpoint that resumes, an export; with distillation the checkpoint also holds its
    head (Moonshine's encoder made the targets in the loader)."""
    pytest.importorskip("nemo.collections.asr")
    pytest.importorskip("espeakng_loader")
    from asr.training.train_streaming import main

    assert main(["--dry-run", "--device", "cpu", "--distill", distill]) == 0


def test_gpu_carry_script_trims_only_what_asr_training_does_not_read() -> None:
    """`scripts/gpu_carry_asr.sh trim` drops paths that must exist (else the carry silently stays too big)
    and none that ASR training reads; without a mode it prints its usage and exits 2."""
    import re
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    script = root / "scripts" / "gpu_carry_asr.sh"
    text = script.read_text()
    trimmed = re.search(r"git rm -rq --ignore-unmatch ([^\n]+)\\\n\s+([^\n]+)", text)
    assert trimmed is not None
    paths = (trimmed[1] + " " + trimmed[2]).split()
    assert paths and all((root / p).exists() for p in paths), paths
    assert not any(p.startswith(("asr", "duplex", "data/asr")) for p in paths)
    usage = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    assert usage.returncode == 2 and "gpu_train_asr.sh" in usage.stdout


def test_eval_panel_refuses_unknown_sets() -> None:
    from duplex.eval.asr import panel_sets

    with pytest.raises(SystemExit, match="unknown panel sets"):
        panel_sets(2, "nope")


def test_eval_asr_has_a_panel_mode_and_a_summary() -> None:
    import argparse

    from duplex.eval.asr import add_arguments, summary

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args(["--panel", "--panel-sets", "natural-conversational", "--lookaheads", "480"])
    assert args.panel and args.panel_sets == "natural-conversational"
    results = {"sets": {"s": {"streaming": {"480": {"wer": 0.3}}, "moonshine": {"wer": 0.2}}}}
    assert summary(results) == {"s": {"stream_480": 0.3, "moonshine": 0.2, "ratio_480": 1.5}}


def test_gpu_carry_packs_flite_without_the_held_out_voice(tmp_path: Path) -> None:
    """`scripts/gpu_carry_asr.sh flite` packs Debian's flite for a machine without it: the archive speaks
    the training voices, and its `slt` (held out for testing) is not slt."""
    import shutil
    import subprocess
    import tarfile

    if shutil.which("flite") is None or shutil.which("gcc") is None:
        pytest.skip("needs flite and gcc")
    root = Path(__file__).resolve().parents[3]
    out = tmp_path / "flite.tar.xz"
    subprocess.run(
        ["bash", str(root / "scripts" / "gpu_carry_asr.sh"), "flite"],
        check=True,
        capture_output=True,
        env={**os.environ, "FLITE_OUT": str(out)},
    )
    with tarfile.open(out) as tar:
        tar.extractall(tmp_path)
    carried = tmp_path / "flite" / "bin" / "flite"

    def speak(flite: str, voice: str) -> bytes:
        wav = tmp_path / f"{voice}.wav"
        subprocess.run(
            [flite, "-voice", voice, "-t", "a held out voice", "-o", str(wav)], check=True, timeout=60
        )
        return wav.read_bytes()

    env_flite = str(shutil.which("flite"))
    assert speak(str(carried), "rms") == speak(env_flite, "rms")
    assert speak(str(carried), "slt") != speak(env_flite, "slt")
    assert out.stat().st_size < 12_000_000
