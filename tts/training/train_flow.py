"""Train the flow-matching acoustic model on hibari teacher data through the speech codec (resumable).

    python -m tts.training.train_flow --run ~/.cache/duplex/runs/flow/run1 --minutes 40 --threads 1 \
        --codec ~/.cache/duplex/runs/codec/run1/checkpoint.pt
    python -m tts.training.train_flow --run DIR --minutes 30 --device cuda          # continue on a GPU
    python -m tts.training.train_flow --run DIR --eval -n 50 --steps 2 4 8          # WER per Euler step count
    python -m tts.training.train_flow --run DIR --export tts/weights                 # EMA -> fp16 + json

Teacher data: text -> hibari's phonemes and per-phoneme durations (the edited graph, 25 ms units) and
audio -> the codec's log-mel -> its encoder -> the bounded latent FSQ rounds (`fsq.bound(z) / half_width`,
in [-1, 1]); that continuous latent is the flow's target. The codec is snapshotted into the run directory
on the first start (DIR/codec.safetensors), so a resumed run sees the same latents even if the codec run
goes on. Every example is a pure function of its index, the pool is a ring buffer indexed by it, and the
checkpoint (model, optimiser, EMA, step, RNG, data position) resumes exactly. A checkpoint is written
atomically every --ckpt-minutes and on SIGINT/SIGTERM; curves go to DIR/curves.png, logs to DIR/metrics.jsonl.

Training mixes CosyVoice 2's attention masks: a share of batches with full context, the rest with chunk
masks of random chunk size and left window, so one model serves any chunking (and offline rendering).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from codec.speech_codec import SpeechCodec, latent_sha256
from codec.training.eval_codec import load_codec_any
from codec.training.train_codec import copy_matching, guarded, save_checkpoint
from tts.flow_model import FlowConfig, FlowModel, chunk_mask

CKPT = "checkpoint.pt"
CODEC_SNAPSHOT = "codec.safetensors"
CHUNK_CHOICES = (2, 3, 4, 6, 8)
LEFT_CHOICES = (1, 2, 3, 4)


# -- the codec ------------------------------------------------------------------------------------------
def snapshot_codec(codec: SpeechCodec, path: Path) -> str:
    """Write the codec as load_codec reads it (fp32 safetensors, config in the metadata); its sha256."""
    from safetensors.torch import save_file

    tensors = {k: v.contiguous() for k, v in codec.state_dict().items()}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"config": json.dumps(codec.cfg.to_dict())})
    tmp.replace(path)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def latent_target(codec: SpeechCodec, audio: np.ndarray) -> torch.Tensor:
    """24 kHz audio -> the bounded pre-rounding latent in [-1, 1] [N, D] (N = samples // 900)."""
    with torch.no_grad():
        mel = codec.mel(torch.from_numpy(np.asarray(audio, np.float32))[None])
        t = mel.shape[1] // codec.cfg.down * codec.cfg.down
        z = codec.encode_latent(mel[:, :t])
        levels = torch.tensor(codec.fsq.levels, dtype=torch.float32).repeat(codec.fsq.groups)
        half = torch.div(levels, 2, rounding_mode="floor")
        return (codec.fsq.bound(z) / half)[0]


# -- teacher examples ---------------------------------------------------------------------------------
def fragment(text: str, rng: np.random.Generator) -> str:
    """One phrase of `text` as the TTS stage's segmenter cuts an answer (3, 6, 12 words; before an opener):
    the live voice speaks such pieces as separate utterances, so the model must learn them too."""
    from duplex.base.phrases import PhraseSegmenter

    seg = PhraseSegmenter()
    phrases, _ = seg.step(seg.init_state(), text, True)
    return str(phrases[int(rng.integers(len(phrases)))]) if phrases else text


@dataclass
class TeacherSource:
    """index -> example: hibari ids [P], durations [P] (25 ms units), latent target [N, D], text."""

    sentences: list[str]
    codec: SpeechCodec
    seed: int = 0
    speed_jitter: float = 0.5  # share of examples spoken at a random speed in [0.85, 1.2]
    threads: int = 1
    fragments: float = 0.0  # share of examples that are one phrase of the sentence, cut as the stage cuts

    def __post_init__(self) -> None:
        from codec.training.hibari_teacher import HibariTeacher

        self.teacher = HibariTeacher(threads=self.threads)
        self.perm = np.random.default_rng(self.seed).permutation(len(self.sentences))

    def __call__(self, index: int) -> dict:
        rng = np.random.default_rng([self.seed, index])
        text = self.sentences[self.perm[index % len(self.perm)]]
        if self.fragments and rng.random() < self.fragments:
            text = fragment(text, rng)
        speed = float(rng.uniform(0.85, 1.2)) if rng.random() < self.speed_jitter else 1.0
        chunks = self.teacher.phonemize(text) or ["ðə."]
        o = self.teacher.run(chunks[0], speed=speed, audio_seed=int(rng.integers(1 << 31)))
        return {
            "ids": torch.from_numpy(o.ids.astype(np.int64)),
            "units": torch.from_numpy(o.durations.astype(np.int64)),
            "y": latent_target(self.codec, o.audio).half(),
        }


class ExamplePool:
    """Ring buffer of examples: slot = index % size, so the pool is a function of the data position."""

    def __init__(self, source: Callable[[int], dict], size: int) -> None:
        self.source, self.size = source, size
        self.items: list[dict | None] = [None] * size

    def put(self, index: int) -> None:
        self.items[index % self.size] = self.source(index)

    def fill(self, end: int, log: Callable[[str], None] = print) -> None:
        """Fill with the examples [end - size, end) (the state of the pool at data position `end`)."""
        t0 = time.time()
        for n, i in enumerate(range(max(0, end - self.size), end)):
            self.put(i)
            if n and n % 500 == 0:
                log(f"pool {n}/{self.size} ({time.time() - t0:.0f} s)")

    def batch(self, rng: np.random.Generator, batch: int) -> dict[str, torch.Tensor]:
        filled = [it for it in self.items if it is not None]
        # similar lengths together (a window of 4x candidates sorted by length): less padding per step
        cand = sorted(
            (filled[i] for i in rng.integers(len(filled), size=4 * batch)), key=lambda it: len(it["y"])
        )
        start = int(rng.integers(0, len(cand) - batch + 1))
        picked = cand[start : start + batch]
        p = max(len(it["ids"]) for it in picked)
        n = max(len(it["y"]) for it in picked)
        d = picked[0]["y"].shape[1]
        out = {
            "ids": torch.zeros(batch, p, dtype=torch.long),
            "units": torch.zeros(batch, p, dtype=torch.long),
            "valid": torch.zeros(batch, p, dtype=torch.bool),
            "y": torch.zeros(batch, n, d),
            "frames": torch.zeros(batch, dtype=torch.long),
        }
        for b, it in enumerate(picked):
            k, m = len(it["ids"]), len(it["y"])
            out["ids"][b, :k], out["units"][b, :k], out["valid"][b, :k] = it["ids"], it["units"], True
            out["y"][b, :m] = it["y"].float()
            out["frames"][b] = m
        return out


# -- loss ---------------------------------------------------------------------------------------------
def flow_loss(
    model: FlowModel, batch: dict[str, torch.Tensor], gen: torch.Generator, chunk: int | None, left: int
) -> tuple[torch.Tensor, dict[str, float]]:
    """Duration MSE (log units) + prior MSE + OT-CFM velocity MSE under the given attention mask."""
    c = model.cfg
    valid = batch["valid"]
    h = model.encoder(batch["ids"], valid)
    logd = model.log_durations(h)
    target_d = torch.log(batch["units"].clamp(min=1).float())
    l_dur = (((logd - target_d) ** 2) * valid).sum() / valid.sum()
    cond = model.regulate(h, batch["units"], batch["frames"])
    b, n, _ = cond.mu.shape
    fmask = (torch.arange(n, device=valid.device)[None] < batch["frames"][:, None]).float()
    y = (batch["y"][:, :n] - model.latent_mean) / model.latent_std
    denom = fmask.sum() * c.latent_dim
    l_prior = (((cond.mu - y) ** 2) * fmask[..., None]).sum() / denom
    t = torch.rand(b, generator=gen).to(y.device)  # a CPU generator: the same draws on any device
    t = 1 - torch.cos(0.5 * math.pi * t)
    x0 = torch.randn(y.shape, generator=gen).to(y.device)
    tt = t[:, None, None]
    xt = (1 - (1 - c.sigma_min) * tt) * x0 + tt * y
    u = y - (1 - c.sigma_min) * x0
    attn = chunk_mask(n, chunk, left, y.device)[None] & (fmask[:, None, :] > 0)
    attn = (attn | torch.eye(n, dtype=torch.bool, device=y.device)[None])[:, None]
    v = model.estimate(xt, t, cond.cond, cond.mu, attn)
    l_flow = (((v - u) ** 2) * fmask[..., None]).sum() / denom
    total = l_flow + l_dur + l_prior
    parts = {"flow": l_flow, "dur": l_dur, "prior": l_prior, "total": total}
    return total, {k: float(v.detach()) for k, v in parts.items()}


class Trainer:
    """Model + EMA + optimiser + data pool + step counter; `step()` runs one optimisation step."""

    def __init__(
        self,
        cfg: FlowConfig,
        source: Callable[[int], dict],
        *,
        pool_size: int = 2000,
        batch: int = 16,
        lr: float = 5e-4,
        lr_halflife: float = 20000.0,
        warmup: int = 300,
        refresh: int = 1,
        p_full: float = 0.25,
        seed: int = 0,
        ema_decay: float = 0.999,
        norm_examples: int = 200,
        device: str = "cpu",
        log: Callable[[str], None] = print,
    ) -> None:
        torch.manual_seed(seed)
        self.cfg, self.source, self.log, self.device = cfg, source, log, device
        self.batch_size, self.lr, self.lr_halflife, self.warmup = batch, lr, lr_halflife, warmup
        self.refresh, self.p_full, self.ema_decay, self.norm_examples = (
            refresh,
            p_full,
            ema_decay,
            norm_examples,
        )
        self.model = FlowModel(cfg)
        self.ema = copy.deepcopy(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=1e-4)
        self.rng = np.random.default_rng(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.pool = ExamplePool(source, pool_size)
        self.step_n = 0
        self.pos = 0
        self.norm_ready = False
        self.rewarm_from = 0  # the lr warms up again from this step (a run started from shipped weights)

    def setup_norm(self) -> None:
        y = torch.cat([self.source(i)["y"].float() for i in range(self.norm_examples)])
        for m in (self.model, self.ema):
            m.latent_mean.copy_(y.mean(0))
            m.latent_std.copy_(y.std(0).clamp(min=1e-3))
        self.norm_ready = True

    def start(self) -> None:
        """Fill the pool for the current data position (fresh run or resume)."""
        if not self.norm_ready:
            self.setup_norm()
        if self.pos == 0:
            self.pos = self.pool.size
        self.pool.fill(self.pos, self.log)
        self.model.to(self.device)
        self.ema.to(self.device)

    def lr_at(self, step: int) -> float:
        warm = min(1.0, (step - self.rewarm_from + 1) / self.warmup)
        return self.lr * warm * 0.5 ** (step / self.lr_halflife)

    def init_from_export(self, path: Path) -> None:
        """Start from shipped weights (DIR/flow_model.*: the EMA in fp16, no optimiser): model and EMA from
        them, the step and data position from their metadata, a fresh optimiser warmed up again."""
        from safetensors.torch import load_file

        meta = json.loads((path / "flow_model.json").read_text())
        if meta["config"] != self.cfg.to_dict():
            raise SystemExit(
                f"{path}: its model dimensions differ from this run's; start a fresh run instead"
            )
        sd = {k: v.float() for k, v in load_file(str(path / "flow_model.safetensors")).items()}
        self.model.load_state_dict(sd)
        self.ema.load_state_dict(sd)
        self._continue_export(meta)

    def _continue_export(self, meta: dict) -> None:
        """An export's step and data position, the lr warming up again from there, RNGs seeded by the step."""
        self.step_n, self.pos, self.norm_ready = int(meta["step"]), int(meta["examples_seen"]), True
        self.rewarm_from = self.step_n
        self.rng = np.random.default_rng([self.step_n, 1])
        self.gen = torch.Generator().manual_seed(self.step_n)

    def grow_from_export(self, path: Path) -> list[str]:
        """Start a deeper model (more estimator blocks and/or encoder layers, every width the same) from
        shipped weights so that it computes exactly what they compute: their tensors fill the first blocks
        and layers; the new estimator blocks are identity by construction (adaLN-zero: their modulation
        starts at zero) and the new encoder layers are made identity by zeroing their output projections.
        Step and data position come from the export's metadata, as in `init_from_export`; a fresh
        optimiser warms up again. Returns the names of the new tensors."""
        meta = json.loads((path / "flow_model.json").read_text())
        old = FlowConfig.from_dict(meta["config"])
        mine = self.cfg.to_dict()
        differs = {k for k, v in old.to_dict().items() if mine[k] != v}
        shrinks = old.layers > self.cfg.layers or old.enc_layers > self.cfg.enc_layers
        if not differs <= {"layers", "enc_layers"} or shrinks:
            raise SystemExit(
                f"{path}: --grow only adds estimator blocks and encoder layers; its dimensions differ in "
                f"{sorted(differs)} ({old.to_dict()} vs {mine})"
            )
        _, new = copy_matching(path / "flow_model.safetensors", self.model, self.ema)
        with torch.no_grad():
            for m in (self.model, self.ema):
                for layer in list(m.encoder.layers)[old.enc_layers :]:
                    for lin in (layer.out, layer.ff2):
                        lin.weight.zero_()
                        lin.bias.zero_()
        self._continue_export(meta)
        return new

    def warm_start(self, path: Path) -> tuple[list[str], list[str]]:
        """A new run for another codec (e.g. a wider latent) starts from exported weights: every tensor
        whose name and shape match is copied into the model and its EMA (the phoneme encoder, the
        duration head, the estimator's body); the rest (the latent's projections, its mean and std)
        start new, at step 0 with the run's own data stream. Returns (copied, new) names."""
        try:
            return copy_matching(path / "flow_model.safetensors", self.model, self.ema)
        except ValueError as e:
            raise SystemExit(str(e)) from None

    def next_mask(self) -> tuple[int | None, int]:
        if self.rng.random() < self.p_full:
            return None, 0
        return int(self.rng.choice(CHUNK_CHOICES)), int(self.rng.choice(LEFT_CHOICES))

    def step(self) -> dict[str, float]:
        for _ in range(self.refresh):
            self.pool.put(self.pos)
            self.pos += 1
        chunk, left = self.next_mask()
        b = {k: v.to(self.device) for k, v in self.pool.batch(self.rng, self.batch_size).items()}
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(self.step_n)
        self.model.train()
        loss, parts = flow_loss(self.model, b, self.gen, chunk, left)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        d = min(self.ema_decay, (1 + self.step_n) / (10 + self.step_n))
        with torch.no_grad():
            for pe, pm in zip(self.ema.parameters(), self.model.parameters(), strict=True):
                pe.lerp_(pm, 1 - d)
            for be, bm in zip(self.ema.buffers(), self.model.buffers(), strict=True):
                be.copy_(bm)
        self.step_n += 1
        return parts | {
            "grad_norm": float(gn),
            "lr": self.lr_at(self.step_n - 1),
            "full": float(chunk is None),
        }

    def state_dict(self) -> dict:
        return {
            "config": self.cfg.to_dict(),
            "model": self.model.state_dict(),
            "ema": self.ema.state_dict(),
            "opt": self.opt.state_dict(),
            "step": self.step_n,
            "pos": self.pos,
            "rng": {"numpy": self.rng.bit_generator.state, "torch": self.gen.get_state()},
            "norm_ready": self.norm_ready,
            "rewarm_from": self.rewarm_from,
        }

    def load_state_dict(self, sd: dict) -> None:
        self.model.load_state_dict(sd["model"])
        self.ema.load_state_dict(sd["ema"])
        self.opt.load_state_dict(sd["opt"])
        self.step_n, self.pos, self.norm_ready = sd["step"], sd["pos"], sd["norm_ready"]
        self.rewarm_from = sd.get("rewarm_from", 0)
        self.rng.bit_generator.state = sd["rng"]["numpy"]
        self.gen.set_state(sd["rng"]["torch"])


# -- evaluation gate ----------------------------------------------------------------------------------
@torch.no_grad()
def synthesize(
    model: FlowModel, codec: SpeechCodec, text: str, steps: int = 4, snap: bool = True
) -> np.ndarray:
    """The runtime path (stage, streaming chunks) on one text -> 24 kHz audio."""
    from duplex.base.messages import TtsInput
    from tts.flow_tts import FlowTtsStage, HibariFrontEnd

    stage = FlowTtsStage(model, codec, _front(HibariFrontEnd), steps=steps, snap=snap, first_phrase_words=12)
    out, _ = stage.step(stage.init_state(), TtsInput(text, final=True))
    return np.concatenate([c.audio for c in out]) if out else np.zeros(0, np.float32)


_FRONT: dict = {}


def _front(cls):  # one G2P per process
    if "f" not in _FRONT:
        _FRONT["f"] = cls()
    return _FRONT["f"]


@torch.no_grad()
def gate(
    model: FlowModel,
    codec: SpeechCodec,
    teacher,
    scorer,
    sentences: list[str],
    steps: tuple[int, ...] = (4,),
    snap: bool = True,
) -> dict:
    """Held-out sentences: hibari's WER, the codec on hibari's audio (the ceiling), the flow model's."""
    from codec.training.eval_codec import corpus_wer

    model.eval()
    hyp_h, hyp_c = [], []
    hyp_f: dict[int, list[str]] = {s: [] for s in steps}
    for i, s in enumerate(sentences):
        audio = np.concatenate([o.audio for o in teacher.text(s, audio_seed=1000 + i)])
        hyp_h.append(scorer.transcribe(audio))
        codes = codec.encode(torch.from_numpy(audio)[None])
        hyp_c.append(scorer.transcribe(codec.decode(codes)[0, codec.cfg.output_delay :].numpy()))
        for st in steps:
            hyp_f[st].append(scorer.transcribe(synthesize(model, codec, s, st, snap)))
    res = {
        "wer_hibari": corpus_wer(sentences, hyp_h),
        "wer_codec": corpus_wer(sentences, hyp_c),
        "n": len(sentences),
    }
    for st in steps:
        res[f"wer_flow_{st}"] = corpus_wer(sentences, hyp_f[st])
    res["examples"] = list(zip(sentences[:2], hyp_f[steps[0]][:2], strict=True))
    return res


def plot_curves(run: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    tr = [r for r in rows if r.get("kind") == "train"]
    ev = [r for r in rows if r.get("kind") == "gate"]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for key in ("total", "flow", "dur", "prior"):
        ax[0].plot([r["step"] for r in tr], [r[key] for r in tr], label=key)
    ax[0].set_yscale("log")
    ax[0].set_xlabel("step")
    ax[0].set_title("training loss")
    ax[0].legend()
    if ev:
        for key, style in (("wer_hibari", "s--"), ("wer_codec", "^--")):
            ax[1].plot([r["step"] for r in ev], [100 * r[key] for r in ev], style, label=key[4:])
        for key in sorted({k for r in ev for k in r if k.startswith("wer_flow")}):
            ax[1].plot(
                [r["step"] for r in ev if key in r],
                [100 * r[key] for r in ev if key in r],
                "o-",
                label=key[4:],
            )
    ax[1].set_xlabel("step")
    ax[1].set_ylabel("WER %")
    ax[1].set_title("gate (Moonshine)")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(run / "curves.png", dpi=90)
    plt.close(fig)


# -- export -------------------------------------------------------------------------------------------
def export(run: Path, out_dir: Path, codec_file: Path | None = None) -> Path:
    """EMA weights -> out_dir/flow_model.safetensors (fp16) + flow_model.json (dims, codec, command).
    The codec the model was trained on is the run's snapshot unless `codec_file` (the shipped one) is given."""
    import shutil

    from safetensors.torch import save_file

    sd = torch.load(run / CKPT, map_location="cpu", weights_only=False)
    tensors = {
        k: v.half().contiguous() if v.is_floating_point() else v.contiguous() for k, v in sd["ema"].items()
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "flow_model.safetensors"
    save_file(tensors, str(path), metadata={"step": str(sd["step"])})
    if codec_file is None:
        codec_file = out_dir / "speech_codec.safetensors"
        shutil.copyfile(run / CODEC_SNAPSHOT, codec_file)
    root = Path(__file__).resolve().parents[2]
    shown = codec_file.resolve()
    for base in (out_dir.resolve(), root):
        if shown.is_relative_to(base):
            shown = shown.relative_to(base)
            break
    meta = {
        "config": sd["config"],
        "step": sd["step"],
        "examples_seen": sd["pos"],
        "dtype": "float16",
        "teacher": "hibari-tts==0.2.1 (heart): phonemes, durations; audio -> speech codec latent",
        "codec_file": str(shown),  # relative to this folder, else to the repository
        "codec_sha256": hashlib.sha256(codec_file.read_bytes()).hexdigest(),
        "codec_latent_sha256": latent_sha256(str(codec_file)),
        "train_command": sd.get("command", ""),
        "bytes": path.stat().st_size,
    }
    (out_dir / "flow_model.json").write_text(json.dumps(meta, indent=1))
    return path


# -- main ---------------------------------------------------------------------------------------------
def default_codec() -> Path:
    shipped = Path(__file__).resolve().parents[2] / "codec" / "weights" / "speech_codec.safetensors"
    if shipped.is_file():
        return shipped
    return Path.home() / ".cache" / "duplex" / "runs" / "codec" / "run1" / "checkpoint.pt"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--codec", type=Path, default=None, help="codec checkpoint.pt or safetensors (first start only)"
    )
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--pool", type=int, default=2000)
    ap.add_argument("--refresh", type=int, default=1, help="new teacher examples per step")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument(
        "--init",
        type=Path,
        default=None,
        help="a new run starts from these exported weights (e.g. tts/weights, the shipped ones)",
    )
    ap.add_argument(
        "--warm-start",
        type=Path,
        default=None,
        help="a new run (e.g. on a new codec) copies the tensors of these exported weights whose shapes match",
    )
    ap.add_argument(
        "--grow",
        type=Path,
        default=None,
        help="a new, deeper run (--layers / --enc-layers) starts from these exported weights, computing "
        "what they compute: the new blocks start as identity",
    )
    ap.add_argument("--layers", type=int, default=None, help="estimator blocks of a new run (default 4)")
    ap.add_argument(
        "--enc-layers", type=int, default=None, help="phoneme encoder layers of a new run (default 3)"
    )
    ap.add_argument("--lr-halflife", type=float, default=20000.0, help="steps for the lr to halve")
    ap.add_argument(
        "--fragments", type=float, default=0.0, help="share of examples that are one phrase of a sentence"
    )
    ap.add_argument("--p-full", type=float, default=0.25, help="share of full-context batches")
    ap.add_argument("--ckpt-minutes", type=float, default=8.0)
    ap.add_argument("--gate-minutes", type=float, default=15.0)
    ap.add_argument("--gate-n", type=int, default=12)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--norm-examples", type=int, default=200, help="examples for the latent mean/std")
    ap.add_argument(
        "--export", type=Path, default=None, help="export the EMA weights to this folder and exit"
    )
    ap.add_argument(
        "--codec-file", type=Path, default=None, help="with --export: the codec file the runtime loads"
    )
    ap.add_argument(
        "--eval", action="store_true", help="evaluate the checkpoint on -n held-out sentences and exit"
    )
    ap.add_argument("-n", type=int, default=50)
    ap.add_argument("--steps", type=int, nargs="+", default=[4])
    ap.add_argument("--no-snap", action="store_true", help="with --eval: decode the raw predicted latent")
    args = ap.parse_args(argv)

    run: Path = args.run.expanduser()
    if args.export:
        print(export(run, args.export, args.codec_file))
        return
    torch.set_num_threads(args.threads)
    run.mkdir(parents=True, exist_ok=True)
    logf = open(run / "train.log", "a")

    def log(msg: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    from codec.training.eval_codec import MoonshineScorer
    from codec.training.hibari_teacher import heldout_sentences, training_sentences

    snapshot = run / CODEC_SNAPSHOT
    if not snapshot.is_file():
        src = (args.codec or default_codec()).expanduser()
        digest = snapshot_codec(load_codec_any(src), snapshot)
        log(f"codec {src} snapshotted to {snapshot} (sha256 {digest[:12]})")
    codec = load_codec_any(snapshot)
    ck = run / CKPT

    if args.eval:
        sd = torch.load(ck, map_location="cpu", weights_only=False)
        model = FlowModel(FlowConfig.from_dict(sd["config"]))
        model.load_state_dict(sd["ema"])
        from codec.training.hibari_teacher import HibariTeacher

        res = gate(
            model,
            codec,
            HibariTeacher(threads=1),
            MoonshineScorer(),
            heldout_sentences()[: args.n],
            tuple(args.steps),
            snap=not args.no_snap,
        )
        res["snap"] = not args.no_snap
        res["step"] = sd["step"]
        (run / f"eval_{sd['step']}.json").write_text(json.dumps(res, indent=1))
        print(json.dumps(res, indent=1))
        return

    depth = {k: v for k, v in (("layers", args.layers), ("enc_layers", args.enc_layers)) if v is not None}
    cfg = FlowConfig(latent_dim=codec.cfg.latent_dim, subframes=codec.cfg.down, **depth)
    resume = torch.load(ck, map_location="cpu", weights_only=False) if ck.is_file() else None
    if resume is not None:  # a run keeps the dimensions it started with
        saved = FlowConfig.from_dict(resume["config"])
        if depth and any(getattr(saved, k) != v for k, v in depth.items()):
            ap.error(f"{ck} holds a model with {saved.layers} blocks / {saved.enc_layers} encoder layers")
        cfg = saved
    source = TeacherSource(training_sentences(), codec, seed=args.seed, threads=1, fragments=args.fragments)
    trainer = Trainer(
        cfg,
        source,
        pool_size=args.pool,
        batch=args.batch,
        lr=args.lr,
        lr_halflife=args.lr_halflife,
        refresh=args.refresh,
        p_full=args.p_full,
        norm_examples=args.norm_examples,
        seed=args.seed,
        device=args.device,
        log=log,
    )
    if sum(x is not None for x in (args.init, args.warm_start, args.grow)) > 1:
        ap.error("--init, --warm-start and --grow are exclusive")
    if resume is not None:
        trainer.load_state_dict(resume)
        del resume
        log(f"resumed from {ck} at step {trainer.step_n}, data position {trainer.pos}")
    elif args.init:
        trainer.init_from_export(args.init)
        log(f"started from the exported weights in {args.init} at step {trainer.step_n} (fresh optimiser)")
    elif args.grow:
        new = trainer.grow_from_export(args.grow)
        log(
            f"grown from the exported weights in {args.grow} at step {trainer.step_n} to {cfg.layers} estimator "
            f"blocks, {cfg.enc_layers} encoder layers (identity at first; fresh optimiser); new: {len(new)} tensors"
        )
    elif args.warm_start:
        copied, new = trainer.warm_start(args.warm_start)
        log(f"warm start from {args.warm_start}: {len(copied)} tensors copied, new: {', '.join(new)}")
    command = " ".join([sys.executable.split("/")[-1], "-m", "tts.training.train_flow", *sys.argv[1:]])
    t0 = time.time()
    trainer.start()
    n_params = sum(p.numel() for p in trainer.model.parameters())
    log(
        f"pool ready ({args.pool} examples) in {time.time() - t0:.0f} s; step {trainer.step_n}; {n_params} params"
    )

    scorer = MoonshineScorer()
    gate_sents = heldout_sentences()[-args.gate_n :]
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
        try:
            g = gate(trainer.ema.cpu(), codec, source.teacher, scorer, gate_sents)
        finally:
            trainer.ema.to(args.device)
        metrics.write(json.dumps({"kind": "gate", "step": trainer.step_n, "time": time.time()} | g) + "\n")
        metrics.flush()
        log(
            f"gate step {trainer.step_n}: WER hibari {100 * g['wer_hibari']:.1f} % codec {100 * g['wer_codec']:.1f} % "
            f"flow(4 steps) {100 * g['wer_flow_4']:.1f} % (n={g['n']}) e.g. {g['examples'][0]}"
        )

    start, last_ck, last_gate = time.time(), time.time(), time.time()
    acc: dict[str, float] = {}
    n_acc = 0
    while not stop["flag"] and time.time() - start < args.minutes * 60:
        parts = trainer.step()
        if not math.isfinite(parts["total"]):
            log(f"non-finite loss at step {trainer.step_n}: stopping (kill criterion)")
            break
        for k, v in parts.items():
            acc[k] = acc.get(k, 0.0) + v
        n_acc += 1
        if trainer.step_n % args.log_every == 0:
            row = {"kind": "train", "step": trainer.step_n, "pos": trainer.pos, "time": time.time()} | {
                k: v / n_acc for k, v in acc.items()
            }
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
            log(
                f"step {trainer.step_n} loss {row['total']:.4f} (flow {row['flow']:.4f} dur {row['dur']:.4f} "
                f"prior {row['prior']:.4f}) lr {row['lr']:.2e} {(time.time() - start) / 60:.1f} min"
            )
            acc, n_acc = {}, 0
        if time.time() - last_gate > args.gate_minutes * 60:
            guarded("gate", run_gate, log)
            last_gate = time.time()
        if time.time() - last_ck > args.ckpt_minutes * 60:
            checkpoint()
            last_ck = time.time()
    checkpoint()
    if not stop["flag"]:
        guarded("gate", run_gate, log)
        plot_curves(run)
    log(f"stopped at step {trainer.step_n} ({'signal' if stop['flag'] else 'time limit'})")


if __name__ == "__main__":
    main()
