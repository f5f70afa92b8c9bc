"""Train the FSQ speech codec on hibari teacher data (resumable, CPU or GPU).

    python -m codec.training.train_codec --run ~/.cache/duplex/runs/codec/run1 --minutes 90 --threads 1
    python -m codec.training.train_codec --run DIR --minutes 30 --device cuda --init codec/weights/speech_codec.safetensors
    python -m codec.training.train_codec --run DIR --export codec/weights      # EMA weights -> fp16 safetensors + json
    python -m codec.training.train_codec --run DIR --levels 5,5,5,5 --groups 4 --warm-start codec/weights/speech_codec.safetensors

A new run takes its shape from --levels / --groups (a resumed one from its checkpoint). --warm-start copies
every tensor of an exported codec whose name and shape match (a wider latent keeps the encoder's and the
decoder's bodies, the PCA bases and the heads; only the projections into and out of the latent start new).

The encoder reads the log-mel of hibari's audio; the decoder regresses hibari's own vocoder inputs
(voicing, log F0, and PCA coefficients of the harmonic and merged noise log-envelopes), so training is a
regression that converges on a CPU. Every teacher example is a pure function of its index (sentence,
speed and noise seed), and the pool of examples is a ring buffer indexed by it, so a checkpoint
(model, optimiser, EMA, step, RNG, data position) resumes exactly. A checkpoint is written atomically
every --ckpt-minutes and on SIGINT/SIGTERM; curves go to DIR/curves.png, logs to DIR/metrics.jsonl.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from codec.dsp_vocoder import HOP
from codec.speech_codec import LOG_F0_MEAN, LOG_F0_STD, CodecConfig, Features, SpeechCodec
from codec.training.hibari_teacher import merged_noise

VOICED_HZ = 40.0
CKPT = "checkpoint.pt"


# -- teacher examples ---------------------------------------------------------------------------------
@dataclass
class TeacherSource:
    """index -> raw teacher example: audio (24 kHz), f0 [F], lh / nz [F, 601]."""

    sentences: list[str]
    seed: int = 0
    speed_jitter: float = 0.5  # share of examples spoken at a random speed in [0.85, 1.2]
    threads: int = 1

    def __post_init__(self) -> None:
        from codec.training.hibari_teacher import HibariTeacher

        self.teacher = HibariTeacher(threads=self.threads)
        self.perm = np.random.default_rng(self.seed).permutation(len(self.sentences))

    def __call__(self, index: int) -> dict:
        rng = np.random.default_rng([self.seed, index])
        text = self.sentences[self.perm[index % len(self.perm)]]
        speed = float(rng.uniform(0.85, 1.2)) if rng.random() < self.speed_jitter else 1.0
        chunks = self.teacher.phonemize(text) or ["ðə."]
        o = self.teacher.run(chunks[0], speed=speed, audio_seed=int(rng.integers(1 << 31)))
        return {
            "index": index,
            "ids": o.ids,
            "units": o.durations,
            "audio": o.audio,
            "f0": o.f0,
            "lh": o.lh.T,
            "nz": merged_noise(o.ln, o.lr).T,
        }


def fit_pca(examples: list[dict], k: int, max_frames: int = 40000, seed: int = 0) -> dict[str, np.ndarray]:
    """Mean, top-k principal directions and coefficient std of both log-envelopes."""
    out = {}
    rng = np.random.default_rng(seed)
    for name in ("lh", "nz"):
        x = np.concatenate([e[name] for e in examples]).astype(np.float64)
        if len(x) > max_frames:
            x = x[rng.choice(len(x), max_frames, replace=False)]
        mu = x.mean(0)
        # eigen-decomposition of the 601 x 601 covariance in torch (respects torch's thread setting;
        # numpy's BLAS spins on every core)
        xc = torch.from_numpy(x - mu)
        evals, evecs = torch.linalg.eigh(xc.T @ xc)
        order = torch.argsort(evals, descending=True)
        evals, basis = evals[order].clamp(min=0).numpy(), evecs[:, order].T[:k].numpy()
        std = (xc @ torch.from_numpy(basis).T).std(0).numpy() + 1e-6
        s = np.sqrt(evals)
        out[f"{name}_mean"], out[f"{name}_basis"], out[f"{name}_std"] = mu, basis, std
        out[f"{name}_explained"] = np.asarray((s[:k] ** 2).sum() / (s**2).sum())
    return out


#: raw teacher example, its log-mel [F, n_mels] -> (the quantised latent the decoder is to read [F // down, D],
#: the weight of the example's F0 loss: 0 where the latent need not carry the teacher's pitch)
LatentFn = Callable[[dict, torch.Tensor], tuple[torch.Tensor, float]]


class ExamplePool:
    """Ring buffer of processed examples: slot = index % size, so the pool is a function of the data position.

    With `latents` (a frozen encoder only), each example also stores the latent the decoder reads (`zq`,
    made once over the whole utterance), and the loss skips the encoder."""

    def __init__(
        self, model: SpeechCodec, source: Callable[[int], dict], size: int, latents: LatentFn | None = None
    ) -> None:
        self.model, self.source, self.size, self.latents = model, source, size, latents
        self.items: list[dict | None] = [None] * size

    @torch.no_grad()
    def process(self, raw: dict) -> dict:
        m = self.model
        audio = torch.from_numpy(np.asarray(raw["audio"], np.float32))[None]
        mel = m.mel(audio)[0]
        n = min(mel.shape[0], len(raw["f0"]))

        def coefs(name: str) -> torch.Tensor:
            return m.envelope_coefs(name, torch.from_numpy(np.asarray(raw[name][:n], np.float32)))

        out = {
            "mel": mel[:n].half(),
            "f0": torch.from_numpy(np.asarray(raw["f0"][:n], np.float32)),
            "lh": coefs("lh").half(),
            "nz": coefs("nz").half(),
        }
        if self.latents is not None:
            d = m.cfg.down
            zq, f0_weight = self.latents(raw, mel[: n // d * d])
            if zq.shape[0] != n // d:
                raise ValueError(f"latents gave {zq.shape[0]} frames for {n} mel frames (want {n // d})")
            out["zq"], out["f0_weight"] = zq.float(), float(f0_weight)
        return out

    def put(self, index: int) -> None:
        self.items[index % self.size] = self.process(self.source(index))

    def fill(self, end: int, log: Callable[[str], None] = print) -> None:
        """Fill with the examples [end - size, end) (the state of the pool at data position `end`)."""
        t0 = time.time()
        for n, i in enumerate(range(max(0, end - self.size), end)):
            self.put(i)
            if n and n % 500 == 0:
                log(f"pool {n}/{self.size} ({time.time() - t0:.0f} s)")

    def batch(self, rng: np.random.Generator, batch: int, crop: int, down: int) -> dict[str, torch.Tensor]:
        filled = [it for it in self.items if it is not None]
        idx = rng.integers(len(filled), size=batch)
        n_mels = filled[0]["mel"].shape[1]
        k = filled[0]["lh"].shape[1]
        out = {
            "mel": torch.full((batch, crop, n_mels), math.log(1e-5)),
            "f0": torch.zeros(batch, crop),
            "lh": torch.zeros(batch, crop, k),
            "nz": torch.zeros(batch, crop, k),
            "mask": torch.zeros(batch, crop),
        }
        if "zq" in filled[0]:
            out["zq"] = torch.zeros(batch, crop // down, filled[0]["zq"].shape[1])
            out["f0_weight"] = torch.ones(batch, 1)
        for b, i in enumerate(idx):
            it = filled[i]
            n = it["f0"].shape[0]
            start = int(rng.integers(0, (n - crop) // down + 1)) * down if n > crop else 0
            m = min(crop, n - start)
            for key in ("mel", "f0", "lh", "nz"):
                out[key][b, :m] = it[key][start : start + m].float()
            out["mask"][b, :m] = 1
            if "zq" in out:
                z = it["zq"][start // down : (start + crop) // down]
                out["zq"][b, : len(z)] = z
                out["mask"][b, len(z) * down :] = 0  # frames past the last whole latent frame
                out["f0_weight"][b] = it["f0_weight"]
        return out


def is_encoder_param(name: str) -> bool:
    """Parameters that define the latent: the encoder up to its output projection (FSQ has none)."""
    return name.startswith("enc_")


def encoder_latents(model: SpeechCodec) -> LatentFn:
    """The (frozen) encoder's quantised latent of the whole utterance."""

    @torch.no_grad()
    def latents(raw: dict, mel: torch.Tensor) -> tuple[torch.Tensor, float]:
        return model.fsq.quantize(model.encode_latent(mel[None]))[0], 1.0

    return latents


# -- loss ---------------------------------------------------------------------------------------------
SPEC_EPS = 1e-3  # magnitude floor of the spectral loss's logs (about the median short-window magnitude)
SPEC_WARMUP = 4  # crop frames the vocoder needs (pulse history, overlap-add) before its output counts
SHORT_FFT, SHORT_HOP = 300, 75  # the spectral loss's second, short window (12.5 ms): onsets and bursts


def spectral_loss(model: SpeechCodec, feats: Features, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Loss on what the vocoder makes of the features, against what it makes of the teacher's.

    Both feature sets go through the codec's own vocoder from a fresh state (the same noise table, so
    matching envelopes give matching noise); the predicted audio's pulses follow the decoder's own voicing
    and F0 (detached: pitch keeps its regression loss), so the envelopes learn to sound right with the
    pitch they will be played with. Two log-magnitude L1 terms: the 80-band log-mel of the codec's
    front end (50 ms windows) and a 151-bin short-window spectrum (12.5 ms, four per frame). Frames the crop's start
    cannot render (SPEC_WARMUP) and the last two (their windows reach past the crop) do not count."""
    f0_p, lh_p, nz_p = model.expand(feats)
    voiced = batch["f0"] > VOICED_HZ
    f0_t = torch.where(voiced, batch["f0"], torch.zeros_like(batch["f0"]))
    lh_t, nz_t = model.envelope("lh", batch["lh"]), model.envelope("nz", batch["nz"])
    t = f0_p.shape[1]
    d = model.cfg.output_delay
    win = torch.hann_window(SHORT_FFT, device=f0_p.device)

    def render(f0: torch.Tensor, lh: torch.Tensor, nz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        audio = model.vocoder(f0, lh, nz)[:, d : d + t * HOP]
        short = torch.stft(audio, SHORT_FFT, SHORT_HOP, window=win, center=True, return_complex=True)
        per = HOP // SHORT_HOP
        return torch.log(model.mel(audio).exp() + SPEC_EPS), torch.log(short.abs()[..., : t * per] + SPEC_EPS)

    with torch.no_grad():
        target_mel, target_short = render(f0_t, lh_t, nz_t)
        mask = batch["mask"].clone()
        mask[:, :SPEC_WARMUP] = 0
        mask[:, -2:] = 0
    pred_mel, pred_short = render(f0_p.detach(), lh_p, nz_p)
    l_mel = ((pred_mel - target_mel).abs().mean(-1) * mask).sum() / mask.sum().clamp(min=1)
    short_mask = mask.repeat_interleave(HOP // SHORT_HOP, 1)[:, None, :]
    err = (pred_short - target_short).abs()
    l_short = (err * short_mask).sum() / (short_mask.sum() * err.shape[1]).clamp(min=1)
    return l_mel + l_short


def codec_loss(
    model: SpeechCodec, batch: dict[str, torch.Tensor], spectral: float = 0.0
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss of the decoder's features against the teacher's; the decoder reads the batch's `zq` when it has
    one (a frozen encoder's latent made once, or another model's prediction of it), else the encoder's.
    `spectral` > 0 adds that weight of `spectral_loss` (the vocoder's output against the teacher's)."""
    zq = batch["zq"] if "zq" in batch else model.fsq.quantize(model.encode_latent(batch["mel"]))
    feats: Features = model.decode_features(zq)
    mask = batch["mask"]
    voiced = (batch["f0"] > VOICED_HZ).float()
    denom = mask.sum().clamp(min=1)
    l_v = (F.binary_cross_entropy_with_logits(feats.voicing, voiced, reduction="none") * mask).sum() / denom
    vm = voiced * mask * batch["f0_weight"] if "f0_weight" in batch else voiced * mask
    log_f0 = (torch.log(batch["f0"].clamp(min=VOICED_HZ)) - LOG_F0_MEAN) / LOG_F0_STD
    l_f0 = (((feats.log_f0 - log_f0) ** 2) * vm).sum() / vm.sum().clamp(min=1)
    # L1 on coefficients weighted towards their share of the envelope's variance (sqrt: keep fine detail)
    losses = {"voicing": l_v, "f0": l_f0}
    for name in ("lh", "nz"):
        std = getattr(model, f"{name}_std")
        w = torch.sqrt(std / std.mean())
        err = (getattr(feats, name) - batch[name]).abs() * w
        losses[name] = (err.mean(-1) * mask).sum() / denom
    total = losses["voicing"] + losses["f0"] + 2.0 * losses["lh"] + 2.0 * losses["nz"]
    if spectral > 0:
        losses["spectral"] = spectral_loss(model, feats, batch)
        total = total + spectral * losses["spectral"]
    return total, {k: float(v.detach()) for k, v in losses.items()} | {"total": float(total.detach())}


# -- checkpoints --------------------------------------------------------------------------------------
def rng_state(rng: np.random.Generator) -> dict:
    return {"numpy": rng.bit_generator.state, "torch": torch.get_rng_state()}


def guarded(what: str, fn: Callable[[], None], log: Callable[[str], None]) -> None:
    """Run an evaluation inside a training loop: a failure is logged, and training goes on."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - an evaluation must never end a run
        log(f"{what} failed ({type(exc).__name__}: {exc}); training goes on")


def save_checkpoint(path: Path, **state) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


class Trainer:
    """Model + EMA + optimiser + data pool + step counter; `step()` runs one optimisation step."""

    def __init__(
        self,
        cfg: CodecConfig,
        source: Callable[[int], dict],
        *,
        pool_size: int = 2000,
        batch: int = 16,
        crop: int = 192,
        lr: float = 1e-3,
        lr_halflife: float = 8000.0,
        warmup: int = 300,
        refresh: int = 2,
        seed: int = 0,
        ema_decay: float = 0.999,
        pca_examples: int = 300,
        device: str = "cpu",
        freeze_encoder: bool = False,
        latents: LatentFn | None = None,
        spectral: float = 0.0,
        log: Callable[[str], None] = print,
    ) -> None:
        torch.manual_seed(seed)
        self.spectral = spectral
        self.cfg, self.source, self.log = cfg, source, log
        self.batch_size, self.crop, self.lr, self.lr_halflife, self.warmup = (
            batch,
            crop,
            lr,
            lr_halflife,
            warmup,
        )
        self.refresh, self.ema_decay, self.pca_examples, self.device = (
            refresh,
            ema_decay,
            pca_examples,
            device,
        )
        self.model = SpeechCodec(cfg)
        self.ema = copy.deepcopy(self.model)
        self.freeze_encoder = freeze_encoder
        # frozen: the latent (what the flow model predicts) stays bit for bit; only the decoder learns
        if freeze_encoder:
            for name, p in self.model.named_parameters():
                if is_encoder_param(name):
                    p.requires_grad_(False)
        self.opt = torch.optim.AdamW(self.trainable(), lr=lr, betas=(0.8, 0.99), weight_decay=1e-4)
        self.rng = np.random.default_rng(seed)
        if latents is not None and not freeze_encoder:
            raise ValueError("latents made outside the loss need a frozen encoder (freeze_encoder=True)")
        self.pool = ExamplePool(self.model, source, pool_size, latents)
        self.step_n = 0
        self.pos = 0  # next teacher example index
        self.pca_ready = False

    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def setup_pca(self) -> dict:
        ex = [self.source(i) for i in range(self.pca_examples)]
        pca = fit_pca(ex, self.cfg.n_pca)
        for m in (self.model, self.ema):
            for key in ("lh_mean", "lh_basis", "lh_std", "nz_mean", "nz_basis", "nz_std"):
                getattr(m, key).copy_(torch.from_numpy(pca[key]).float())
        self.pca_ready = True
        return {k: float(v) for k, v in pca.items() if k.endswith("explained")}

    def start(self) -> None:
        """Fill the pool for the current data position (fresh run or resume)."""
        if not self.pca_ready:
            info = self.setup_pca()
            self.log(f"PCA explained variance: {info}")
        if self.pos == 0:
            self.pos = self.pool.size
        self.pool.fill(self.pos, self.log)
        self.model.to(self.device)
        self.ema.to(self.device)

    def lr_at(self, step: int) -> float:
        return self.lr * min(1.0, (step + 1) / self.warmup) * 0.5 ** (step / self.lr_halflife)

    def step(self) -> dict[str, float]:
        for _ in range(self.refresh):
            self.pool.put(self.pos)
            self.pos += 1
        b = self.pool.batch(self.rng, self.batch_size, self.crop, self.cfg.down)
        b = {k: v.to(self.device) for k, v in b.items()}
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(self.step_n)
        self.model.train()
        loss, parts = codec_loss(self.model, b, self.spectral)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(self.trainable(), 1.0)
        self.opt.step()
        d = min(self.ema_decay, (1 + self.step_n) / (10 + self.step_n))
        with torch.no_grad():
            for pe, pm in zip(self.ema.parameters(), self.model.parameters(), strict=True):
                if pm.requires_grad:
                    pe.lerp_(pm, 1 - d)
        self.step_n += 1
        return parts | {"grad_norm": float(gn), "lr": self.lr_at(self.step_n - 1)}

    def state_dict(self) -> dict:
        return {
            "config": self.cfg.to_dict(),
            "model": self.model.state_dict(),
            "ema": self.ema.state_dict(),
            "opt": self.opt.state_dict(),
            "step": self.step_n,
            "pos": self.pos,
            "rng": rng_state(self.rng),
            "pca_ready": self.pca_ready,
            "freeze_encoder": self.freeze_encoder,
        }

    def load_state_dict(self, sd: dict) -> None:
        self.model.load_state_dict(sd["model"])
        self.ema.load_state_dict(sd["ema"])
        self.opt.load_state_dict(sd["opt"])
        self.step_n, self.pos, self.pca_ready = sd["step"], sd["pos"], sd["pca_ready"]
        self.rng.bit_generator.state = sd["rng"]["numpy"]
        torch.set_rng_state(sd["rng"]["torch"])


def copy_matching(path: Path, *modules: torch.nn.Module) -> tuple[list[str], list[str]]:
    """Copy every tensor of the safetensors file at `path` whose name and shape match into each module
    (a model and its EMA). Returns (copied, new) names; ValueError if nothing matches."""
    from safetensors.torch import load_file

    src = {k: v.float() for k, v in load_file(str(path)).items()}
    own = modules[0].state_dict()
    copied = sorted(k for k, v in src.items() if k in own and own[k].shape == v.shape)
    if not copied:
        raise ValueError(f"{path}: no tensor matches this model's names and shapes")
    for m in modules:
        m.load_state_dict({k: src[k] for k in copied}, strict=False)
    return copied, sorted(set(own) - set(copied))


def export_position(path: Path) -> int | None:
    """The data position (`examples_seen`) in the JSON beside an exported codec, if there is one."""
    meta_path = path.with_suffix(".json")
    if not meta_path.is_file():
        return None
    return int(json.loads(meta_path.read_text()).get("examples_seen", 0))


def warm_start(trainer: Trainer, path: Path) -> tuple[list[str], list[str]]:
    """Copy every tensor of the exported codec at `path` whose name and shape match into the model and
    its EMA; the data position continues the export's stream. Returns (copied, skipped) names."""
    copied, skipped = copy_matching(path, trainer.model, trainer.ema)
    pca = ("lh_mean", "lh_basis", "lh_std", "nz_mean", "nz_basis", "nz_std")
    trainer.pca_ready = all(k in copied for k in pca)
    pos = export_position(path)
    if pos is not None:
        trainer.pos = pos
    return copied, skipped


def resolve_config(
    saved: dict | None, init: Path | None, levels: tuple[int, ...] | None, groups: int | None
) -> CodecConfig:
    """The run's codec shape: a resumed run's (its checkpoint's config) or --init's (the file's metadata)
    is kept, and asking for another raises ValueError; a new run takes --levels / --groups."""
    if saved is not None or init is not None:
        if saved is not None:
            cfg = CodecConfig.from_dict(saved)
        else:
            from safetensors import safe_open

            with safe_open(str(init), "pt") as f:
                meta = f.metadata() or {}
            cfg = CodecConfig.from_dict(json.loads(meta["config"])) if "config" in meta else CodecConfig()
        asked = {"levels": levels, "groups": groups}
        if any(v is not None and v != getattr(cfg, k) for k, v in asked.items()):
            raise ValueError(
                f"its shape is levels {cfg.levels} x {cfg.groups} groups, which a resumed or --init run keeps"
            )
        return cfg
    if groups is not None and groups < 1:
        raise ValueError("--groups must be >= 1")
    cfg = CodecConfig()
    return replace(cfg, levels=levels or cfg.levels, groups=groups or cfg.groups)


def parse_levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"levels must be integers separated by commas, got {text!r}"
        ) from None
    if not levels or any(v < 2 for v in levels):
        raise argparse.ArgumentTypeError(f"every FSQ level must be >= 2, got {text!r}")
    return levels


# -- evaluation gate ----------------------------------------------------------------------------------
@torch.no_grad()
def gate(model: SpeechCodec, teacher, scorer, sentences: list[str]) -> dict:
    """hibari audio -> codec round trip -> Moonshine, on a few held-out sentences; plus code usage."""
    from codec.training.eval_codec import corpus_wer

    model.eval()
    ref_h, hyp_h, hyp_c, codes = [], [], [], []
    for i, s in enumerate(sentences):
        audio = np.concatenate([o.audio for o in teacher.text(s, audio_seed=1000 + i)])
        x = torch.from_numpy(audio)[None]
        c = model.encode(x)
        y = model.decode(c)[0, model.cfg.output_delay :].numpy()  # drop the decoder's delay
        codes.append(c[0])
        ref_h.append(s)
        hyp_h.append(scorer.transcribe(audio))
        hyp_c.append(scorer.transcribe(y))
    c = torch.cat(codes)
    used = [int(torch.unique(c[:, g]).numel()) for g in range(c.shape[1])]
    return {
        "wer_hibari": corpus_wer(ref_h, hyp_h),
        "wer_codec": corpus_wer(ref_h, hyp_c),
        "codes_used": used,
        "n": len(sentences),
        "examples": list(zip(ref_h[:2], hyp_c[:2], strict=True)),
    }


def plot_curves(run: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    tr = [r for r in rows if r.get("kind") == "train"]
    ev = [r for r in rows if r.get("kind") == "gate"]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for key in ("total", "lh", "nz", "f0", "voicing", "spectral"):
        have = [r for r in tr if key in r]
        if have:
            ax[0].plot([r["step"] for r in have], [r[key] for r in have], label=key)
    ax[0].set_yscale("log")
    ax[0].set_xlabel("step")
    ax[0].set_title("training loss")
    ax[0].legend()
    if ev:
        ax[1].plot(
            [r["step"] for r in ev], [100 * r["wer_codec"] for r in ev], "o-", label="codec round trip"
        )
        ax[1].plot([r["step"] for r in ev], [100 * r["wer_hibari"] for r in ev], "s--", label="hibari")
    ax[1].set_xlabel("step")
    ax[1].set_ylabel("WER %")
    ax[1].set_title("gate (Moonshine)")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(run / "curves.png", dpi=90)
    plt.close(fig)


# -- export -------------------------------------------------------------------------------------------
def export(run: Path, out_dir: Path, extra: dict | None = None) -> Path:
    """EMA weights of the run's checkpoint -> out_dir/speech_codec.safetensors (fp16) + speech_codec.json."""
    from safetensors.torch import save_file

    sd = torch.load(run / CKPT, map_location="cpu", weights_only=False)
    cfg = CodecConfig.from_dict(sd["config"])
    tensors = {
        k: v.half().contiguous() if v.is_floating_point() else v.contiguous() for k, v in sd["ema"].items()
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "speech_codec.safetensors"
    save_file(tensors, str(path), metadata={"config": json.dumps(cfg.to_dict()), "step": str(sd["step"])})
    meta = {
        "config": cfg.to_dict(),
        "step": sd["step"],
        "examples_seen": sd["pos"],
        "bitrate_bps": cfg.bitrate,
        "frame_rate_hz": cfg.frame_rate,
        "dtype": "float16",
        "teacher": "hibari-tts==0.2.1 (af_heart), features via codec/training/hibari_teacher.py",
        "train_command": sd.get("command", ""),
        "bytes": path.stat().st_size,
    } | (extra or {})
    (out_dir / "speech_codec.json").write_text(json.dumps(meta, indent=1))
    return path


# -- main ---------------------------------------------------------------------------------------------
def main(
    argv: list[str] | None = None,
    *,
    make_latents: Callable[[SpeechCodec, argparse.Namespace], LatentFn] | None = None,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
    module: str = "codec.training.train_codec",
    doc: str | None = None,
) -> None:
    """The recipe's command line. A recipe built on this one (tts.training.tune_decoder) passes
    `make_latents` (what the decoder reads, with the encoder frozen) and its own arguments."""
    ap = argparse.ArgumentParser(
        description=doc or __doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--crop", type=int, default=192, help="80 Hz frames per training crop (multiple of 3)")
    ap.add_argument("--pool", type=int, default=2000)
    ap.add_argument("--refresh", type=int, default=2, help="new teacher examples per step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--lr-halflife", type=float, default=8000.0)
    ap.add_argument("--ckpt-minutes", type=float, default=8.0)
    ap.add_argument("--gate-minutes", type=float, default=15.0)
    ap.add_argument("--gate-n", type=int, default=12)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init", type=Path, default=None, help="start from shipped weights (safetensors)")
    ap.add_argument(
        "--warm-start",
        type=Path,
        default=None,
        help="start a new shape from shipped weights: copy the tensors whose names and shapes match",
    )
    ap.add_argument(
        "--levels", type=parse_levels, default=None, help="FSQ levels per group, e.g. 5,5,5,5 (new run)"
    )
    ap.add_argument("--groups", type=int, default=None, help="FSQ groups (codes per frame; new run)")
    ap.add_argument(
        "--freeze-encoder",
        action="store_true",
        help="train the decoder only: the latent (and so a flow model trained on it) stays valid",
    )
    ap.add_argument(
        "--spectral",
        type=float,
        default=0.0,
        help="weight of a loss on the vocoder's output against the teacher features' (0: off)",
    )
    ap.add_argument(
        "--export", type=Path, default=None, help="export the run's EMA weights to this folder and exit"
    )
    if add_arguments is not None:
        add_arguments(ap)
    args = ap.parse_args(argv)

    run: Path = args.run.expanduser()
    if args.export:
        print(export(run, args.export))
        return
    torch.set_num_threads(args.threads)
    run.mkdir(parents=True, exist_ok=True)
    logf = open(run / "train.log", "a")

    def log(msg: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    from codec.training.hibari_teacher import heldout_sentences, training_sentences

    ck = run / CKPT
    saved = torch.load(ck, map_location="cpu", weights_only=False) if ck.is_file() else None
    if args.init and args.warm_start:
        ap.error("--init and --warm-start are exclusive")
    try:
        cfg = resolve_config(saved["config"] if saved else None, args.init, args.levels, args.groups)
    except ValueError as e:
        ap.error(f"{ck if saved else args.init}: {e}" if saved or args.init else str(e))
    log(f"codec shape: {cfg.groups} x levels {cfg.levels} = {cfg.latent_dim}-d latent, {cfg.bitrate:.1f} bps")
    freeze = make_latents is not None or args.freeze_encoder or bool(saved and saved.get("freeze_encoder"))
    source = TeacherSource(training_sentences(), seed=args.seed, threads=1)
    trainer = Trainer(
        cfg,
        source,
        pool_size=args.pool,
        batch=args.batch,
        crop=args.crop,
        lr=args.lr,
        lr_halflife=args.lr_halflife,
        refresh=args.refresh,
        seed=args.seed,
        device=args.device,
        freeze_encoder=freeze,
        spectral=args.spectral,
        log=log,
    )
    if saved is not None:
        trainer.load_state_dict(saved)
        log(f"resumed from {ck} at step {trainer.step_n}, data position {trainer.pos}")
    elif args.init:
        from safetensors.torch import load_file

        sd = {k: v.float() for k, v in load_file(str(args.init)).items()}
        trainer.model.load_state_dict(sd)
        trainer.ema.load_state_dict(sd)
        trainer.pca_ready = True
        pos = export_position(args.init)
        if pos is not None:  # continue the data stream where the shipped run stopped
            trainer.pos = pos
        log(f"initialised from {args.init} (data position {trainer.pos}, encoder frozen: {freeze})")
    elif args.warm_start:
        copied, skipped = warm_start(trainer, args.warm_start)
        log(
            f"warm start from {args.warm_start}: {len(copied)} tensors copied, new: {', '.join(skipped)} "
            f"(data position {trainer.pos}, PCA from the file: {trainer.pca_ready})"
        )
    del saved
    # frozen: the decoder reads latents made once per example (after the weights are in), no encoder in the step
    if freeze:
        trainer.pool.latents = (make_latents or (lambda m, _: encoder_latents(m)))(trainer.model, args)
    command = " ".join([sys.executable.split("/")[-1], "-m", module, *sys.argv[1:]])
    t0 = time.time()
    trainer.start()
    log(f"pool ready ({args.pool} examples) in {time.time() - t0:.0f} s; step {trainer.step_n}")

    from codec.training.eval_codec import MoonshineScorer

    scorer = MoonshineScorer()
    gate_sents = heldout_sentences()[-args.gate_n :]  # the last ones: eval_codec scores the first ones

    stop = {"flag": False}

    def on_signal(*_: object) -> None:
        stop["flag"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    metrics = open(run / "metrics.jsonl", "a")

    def checkpoint() -> None:
        save_checkpoint(ck, **trainer.state_dict(), command=command)
        plot_curves(run)
        log(f"checkpoint at step {trainer.step_n}")

    def run_gate() -> None:
        g = gate(trainer.ema, source.teacher, scorer, gate_sents)
        metrics.write(json.dumps({"kind": "gate", "step": trainer.step_n, "time": time.time()} | g) + "\n")
        metrics.flush()
        log(
            f"gate step {trainer.step_n}: WER hibari {100 * g['wer_hibari']:.1f} % codec "
            f"{100 * g['wer_codec']:.1f} % (n={g['n']}), codes used {g['codes_used']}"
        )

    start, last_ck, last_gate = time.time(), time.time(), time.time()
    acc: dict[str, float] = {}
    n_acc = 0
    while not stop["flag"] and time.time() - start < args.minutes * 60:
        parts = trainer.step()
        for k, v in parts.items():
            acc[k] = acc.get(k, 0.0) + v
        n_acc += 1
        if trainer.step_n % args.log_every == 0:
            row = {"kind": "train", "step": trainer.step_n, "pos": trainer.pos, "time": time.time()} | {
                k: v / n_acc for k, v in acc.items()
            }
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
            el = time.time() - start
            log(
                f"step {trainer.step_n} loss {row['total']:.4f} (lh {row['lh']:.3f} nz {row['nz']:.3f} "
                f"f0 {row['f0']:.3f} v {row['voicing']:.3f}"
                + (f" spec {row['spectral']:.3f}" if "spectral" in row else "")
                + f") lr {row['lr']:.2e} pos {trainer.pos} {el / 60:.1f} min"
            )
            acc, n_acc = {}, 0
        if time.time() - last_gate > args.gate_minutes * 60:
            guarded("gate", run_gate, log)
            last_gate = time.time()
        if time.time() - last_ck > args.ckpt_minutes * 60:
            checkpoint()
            last_ck = time.time()
    checkpoint()
    log(f"stopped at step {trainer.step_n} ({'signal' if stop['flag'] else 'time limit'})")


if __name__ == "__main__":
    main()
