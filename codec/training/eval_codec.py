"""Evaluate the speech codec: hibari's WER vs the codec round trip's WER on the same held-out sentences
(Moonshine base-en), bitrate, FSQ code usage per group and per level, decode RTF on one thread.

    python -m codec.training.eval_codec --weights codec/weights/speech_codec.safetensors -n 200 --out DIR
    python -m codec.training.eval_codec --ckpt ~/.cache/duplex/runs/codec/run1/checkpoint.pt -n 200 --ceiling

--ceiling also scores the decoder's upper bound: the teacher's own features, compressed the way the
decoder predicts them (merged noise, PCA), through the codec's vocoder. Writes DIR/eval.json and DIR/eval.png.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asr.training.wer import wer as corpus_wer  # corpus WER: total word errors / reference words
from codec.speech_codec import CodecConfig, SpeechCodec, load_codec
from codec.training.hibari_teacher import merged_noise

PAD_S = 0.3  # Moonshine repeats sentences on tightly trimmed clips: keep silence around every clip


# The worker: length-prefixed float32 clips on stdin, one transcript per line on stdout.
_WORKER = r"""
import ctypes, struct, sys
import numpy as np
import moonshine_cpp as mc
model = mc.MoonshineModel()
lib = mc.moonshine_lib
inp, out = sys.stdin.buffer, sys.stdout
while True:
    head = inp.read(8)
    if len(head) < 8:
        break
    (n,) = struct.unpack("<q", head)
    x = np.frombuffer(inp.read(4 * n), np.float32).copy()
    res = ctypes.c_char_p(0)
    err = lib.moonshine_transcribe(model.model_handle, x.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                   x.size, ctypes.byref(res))
    text = res.value.decode() if (err == 0 and res.value) else ""
    if err == 0:
        lib.moonshine_free_text(res)
    out.write(text.replace("\n", " ") + "\n")
    out.flush()
"""


class MoonshineScorer:
    """Transcribe float32 audio with the bundled Moonshine base-en model (moonshine-cpp 0.1.4).

    moonshine-cpp keeps ~60 MB per transcription of speech (measured: 0.6 -> 2.0 GB over 15 clips), so
    it runs in a child process that is replaced every `recycle` clips.

    `backend`: "cpp" (moonshine-cpp's own library: every WER in docs/ was scored so), "onnx" (the same model
    files through the service's onnxruntime path, `asr.moonshine.MoonshineModel`, in this process), or
    "auto": cpp, and onnx where moonshine-cpp's native library cannot run on this machine (its bundled
    onnxruntime dies with an illegal instruction on CPUs without AVX-512, e.g. an AVX2-only AMD EPYC).
    `self.backend` says which one scored, once the first clip is done; evaluations record it."""

    BACKENDS = ("auto", "cpp", "onnx")

    def __init__(self, recycle: int = 16, backend: str = "auto", onnx_model: Any = None) -> None:
        if backend not in self.BACKENDS:
            raise ValueError(f"scorer backend must be one of {', '.join(self.BACKENDS)}, not {backend!r}")
        self.recycle = recycle
        self.backend = backend
        self._proc: subprocess.Popen | None = None
        self._n = 0
        self._onnx = onnx_model  # tests inject a stand-in; else loaded when first needed
        self.fallback_reason: str | None = None

    def _start(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=False
        )
        self._n = 0

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                proc.stdin.close()
                proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()

    def __del__(self) -> None:
        self.close()

    def transcribe(self, audio: np.ndarray, sample_rate: int = 24000) -> str:
        import soxr

        x = np.asarray(audio, np.float32)
        if sample_rate != 16000:
            x = soxr.resample(x, sample_rate, 16000).astype(np.float32)
        pad = np.zeros(int(PAD_S * 16000), np.float32)
        x = np.ascontiguousarray(np.concatenate([pad, np.clip(x, -1, 1), pad]))
        if self.backend == "onnx":
            return self._onnx_transcribe(x)
        if self._proc is None or self._n >= self.recycle:
            self.close()
            self._start()
        assert self._proc is not None and self._proc.stdin is not None and self._proc.stdout is not None
        self._n += 1
        line = b""
        try:
            self._proc.stdin.write(struct.pack("<q", x.size) + x.tobytes())
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        except BrokenPipeError:
            pass
        if line:
            if self.backend == "auto":
                self.backend = "cpp"
            return line.decode().rstrip("\n")
        proc, self._proc = self._proc, None
        try:
            rc = proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        how = "an illegal instruction (SIGILL)" if rc in (-4, 132) else f"exit status {rc}"
        if self.backend == "auto" and self._n == 1:
            # the worker died on its first clip: the native library cannot run here, not this clip's fault
            self.fallback_reason = f"moonshine-cpp's worker died with {how} on its first clip"
            warnings.warn(
                f"{self.fallback_reason}; scoring with the same Moonshine model files through onnxruntime "
                "(asr.moonshine) instead",
                RuntimeWarning,
                stacklevel=2,
            )
            self.backend = "onnx"
            return self._onnx_transcribe(x)
        raise RuntimeError(f"the Moonshine worker died ({how})")

    def _onnx_transcribe(self, x: np.ndarray) -> str:
        if self._onnx is None:
            from asr.moonshine import MoonshineModel

            self._onnx = MoonshineModel(instances=1, threads=1)
        return str(self._onnx.transcribe(x))


def load_codec_any(path: Path) -> SpeechCodec:
    """A codec from an exported safetensors file or a training checkpoint (its EMA weights)."""
    if path.suffix == ".safetensors":
        return load_codec(str(path))
    sd = torch.load(path, map_location="cpu", weights_only=False)
    m = SpeechCodec(CodecConfig.from_dict(sd["config"]))
    m.load_state_dict(sd["ema"])
    return m.eval()


@torch.no_grad()
def ceiling_audio(model: SpeechCodec, o) -> np.ndarray:
    """Teacher features -> (merged noise, PCA projection, as the decoder predicts them) -> codec vocoder."""

    def proj(x: np.ndarray, name: str) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(x.T))
        mu, basis = getattr(model, f"{name}_mean"), getattr(model, f"{name}_basis")
        return mu + ((t - mu) @ basis.T) @ basis

    f0 = torch.from_numpy(o.f0)[None]
    f0 = torch.where(f0 > 40, f0, torch.zeros_like(f0))
    y = model.vocoder(f0, proj(o.lh, "lh")[None], proj(merged_noise(o.ln, o.lr), "nz")[None])
    return y[0, model.vocoder.output_delay :].numpy()


@torch.no_grad()
def decode_rtf(model: SpeechCodec, codes: torch.Tensor, chunk: int = 8) -> dict:
    """Seconds of compute per second of audio, streaming in chunks of `chunk` code frames, one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        state = model.init_state(1)
        t0 = time.perf_counter()
        for i in range(0, codes.shape[1], chunk):
            _, state = model.decode_step(state, codes[:, i : i + chunk])
        t_stream = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.decode(codes)
        t_off = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)
    secs = codes.shape[1] * model.cfg.samples_per_code / 24000
    return {
        "audio_s": secs,
        "rtf_stream": t_stream / secs,
        "rtf_offline": t_off / secs,
        "chunk_codes": chunk,
        "chunk_ms": chunk * model.cfg.samples_per_code / 24.0,
    }


def code_usage(model: SpeechCodec, codes: torch.Tensor) -> dict:
    """Share of the codebook used per group, per-level usage of each dimension, empirical entropy."""
    cfg = model.cfg
    size = math.prod(cfg.levels)
    per_group, entropy, per_level = [], [], []
    digits = model.fsq.digits(codes)  # [N, G, D]
    for g in range(cfg.groups):
        counts = torch.bincount(codes[:, g], minlength=size).double()
        per_group.append(float((counts > 0).sum() / size))
        p = counts[counts > 0] / counts.sum()
        entropy.append(float(-(p * p.log2()).sum()))
        lv = []
        for d, L in enumerate(cfg.levels):
            h = torch.bincount(digits[:, g, d], minlength=L).double()
            lv.append(
                {"levels": L, "used": int((h > 0).sum()), "share": [round(float(x), 4) for x in h / h.sum()]}
            )
        per_level.append(lv)
    return {
        "codebook_size": size,
        "used_share_per_group": per_group,
        "entropy_bits_per_group": entropy,
        "entropy_bitrate_bps": sum(entropy) * cfg.frame_rate,
        "per_level": per_level,
        "frames": int(codes.shape[0]),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", type=Path)
    ap.add_argument("--ckpt", type=Path)
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("--out", type=Path, default=Path("codec_eval"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ceiling", action="store_true")
    ap.add_argument("--save-wavs", type=int, default=3)
    args = ap.parse_args(argv)
    if not args.weights and not args.ckpt:
        ap.error("give --weights or --ckpt")
    torch.set_num_threads(args.threads)

    from codec.training.hibari_teacher import HibariTeacher, heldout_sentences

    model = load_codec_any(args.weights or args.ckpt)
    teacher, scorer = HibariTeacher(threads=1), MoonshineScorer()
    sents = heldout_sentences()[: args.n]
    args.out.mkdir(parents=True, exist_ok=True)
    hyp_h, hyp_c, hyp_u, all_codes, rows = [], [], [], [], []
    t0 = time.time()
    for i, s in enumerate(sents):
        outs = teacher.text(s, audio_seed=i)
        audio = np.concatenate([o.audio for o in outs])
        with torch.no_grad():
            codes = model.encode(torch.from_numpy(audio)[None])
            y = model.decode(codes)[0, model.cfg.output_delay :].numpy()
        all_codes.append(codes[0])
        hyp_h.append(scorer.transcribe(audio))
        hyp_c.append(scorer.transcribe(y))
        row = {"ref": s, "hibari": hyp_h[-1], "codec": hyp_c[-1]}
        if args.ceiling:
            hyp_u.append(scorer.transcribe(np.concatenate([ceiling_audio(model, o) for o in outs])))
            row["ceiling"] = hyp_u[-1]
        rows.append(row)
        if i < args.save_wavs:
            import soundfile as sf

            sf.write(args.out / f"{i:03d}_hibari.wav", audio, 24000)
            sf.write(args.out / f"{i:03d}_codec.wav", y, 24000)
        if (i + 1) % 25 == 0:
            print(
                f"{i + 1}/{len(sents)}  WER hibari {100 * corpus_wer(sents[: i + 1], hyp_h):.2f} %  "
                f"codec {100 * corpus_wer(sents[: i + 1], hyp_c):.2f} %  ({time.time() - t0:.0f} s)",
                flush=True,
            )
    codes = torch.cat(all_codes)
    res = {
        "n_sentences": len(sents),
        "n_words": sum(len(s.split()) for s in sents),
        "wer_hibari": corpus_wer(sents, hyp_h),
        "wer_codec": corpus_wer(sents, hyp_c),
        "bitrate_bps": model.cfg.bitrate,
        "frame_rate_hz": model.cfg.frame_rate,
        "levels": list(model.cfg.levels),
        "groups": model.cfg.groups,
        "usage": code_usage(model, codes),
        "rtf": decode_rtf(model, codes[None, :800]),
        "params": sum(p.numel() for p in model.parameters()),
        "decoder_params": sum(
            p.numel() for n, p in model.named_parameters() if n.startswith(("dec_", "head"))
        ),
        "weights": str(args.weights or args.ckpt),
        "scorer": {"backend": scorer.backend, "fallback_reason": scorer.fallback_reason},
    }
    if args.ceiling:
        res["wer_ceiling"] = corpus_wer(sents, hyp_u)
    (args.out / "eval.json").write_text(json.dumps(res, indent=1))
    with open(args.out / "transcripts.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    plot(res, args.out / "eval.png")
    print(
        json.dumps(
            {k: v for k, v in res.items() if k != "usage"}
            | {
                "used_share_per_group": res["usage"]["used_share_per_group"],
                "entropy_bitrate_bps": res["usage"]["entropy_bitrate_bps"],
            },
            indent=1,
        )
    )


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    names = ["hibari", "codec"] + (["ceiling"] if "wer_ceiling" in res else [])
    vals = [100 * res[f"wer_{n}"] for n in names]
    ax[0].bar(names, vals)
    for i, v in enumerate(vals):
        ax[0].text(i, v, f"{v:.2f}", ha="center", va="bottom")
    ax[0].set_ylabel("WER %")
    ax[0].set_title(f"Moonshine WER, n={res['n_sentences']} held-out sentences")
    for g, lv in enumerate(res["usage"]["per_level"]):
        for d, e in enumerate(lv):
            ax[1].plot(range(e["levels"]), e["share"], "o-", label=f"g{g} d{d}", alpha=0.7)
    ax[1].set_xlabel("level")
    ax[1].set_ylabel("share of frames")
    ax[1].set_title(
        f"FSQ level usage ({res['bitrate_bps']:.0f} bps; codes used "
        f"{', '.join(f'{100 * u:.0f}%' for u in res['usage']['used_share_per_group'])})"
    )
    ax[1].legend(fontsize=6, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    main()
