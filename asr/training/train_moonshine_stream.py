"""Teach Moonshine's encoder to stream: the chunked encoder distilled from the full-context one (no transcripts).

asr/moonshine_stream.py runs Moonshine base-en's packaged encoder chunk by chunk (480 ms chunks, 6 s of left
context, a running GroupNorm). Frozen, its frames fed to Moonshine's own decoder read 38.7 % WER on the panel's
natural conversational set, against 6.7 % with full context (docs/asr.md). This recipe trains low-rank adapters
(LoRA) on every projection of the encoder's layers, and its layer norms, so that the *chunked* encoder's frames
match what the *full-context* encoder (the same packaged weights, frozen) computes from the same audio: L1 +
(1 - cosine) per frame (`--objective features`). Moonshine's decoder is left as it is and reads the result. Only
the adapters are trained and shipped (a few MB); the 20 M base weights stay in the moonshine-cpp package.

Feature distillation plateaus (20 % from step 200 on): it weighs every dimension of every frame alike, while
the decoder reads a few of them closely. `--objective decoder` trains on what the decoder makes of the frames
instead: the packaged decoder runs in torch (asr/moonshine_decoder.py, frozen) teacher-forced on the full-context
model's own greedy transcript, and the loss is KL(full-context || chunked) of its next-token distributions,
plus `--feat-weight` x the feature loss as a regulariser. Still no transcripts: the full-context model is the
teacher (sequence-level distillation).

    python -m asr.training.train_moonshine_stream --make-pool ~/.cache/duplex/mstream-pool --n 4000   # audio
    python -m asr.training.train_moonshine_stream --run ~/.cache/duplex/runs/mstream1 \\
        --pool ~/.cache/duplex/mstream-pool --minutes 60                       # train (resumes)
    python -m asr.training.train_moonshine_stream --run ~/.cache/duplex/runs/mstream1 --export asr/weights
    python -m asr.training.train_moonshine_stream --run RUN --init asr/weights --minutes 60   # a fresh clone

Resumable: the run keeps the adapters, the optimiser, the step, the RNG and the data position (an index into
the pool's fixed, seeded order), checkpointed every `--ckpt-minutes`; `metrics.jsonl` has the losses and the
panel checks (Moonshine's decoder on the streaming frames, WER, every `--every` steps).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from asr.moonshine_stream import ADAPTED, MoonshineStreamingEncoder, load_packaged

EXPORT_NAME = "moonshine_stream_lora.safetensors"


class LoRALinear(nn.Module):
    """y = W x + b + (alpha / r) B A x, with W, b frozen and B zero at the start (the packaged layer exactly)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, base.in_features) / math.sqrt(base.in_features))
        self.b = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * F.linear(F.linear(x, self.a), self.b)

    def merged(self) -> torch.Tensor:
        return self.base.weight + self.scale * self.b @ self.a


def add_adapters(enc: MoonshineStreamingEncoder, rank: int, alpha: float) -> list[nn.Parameter]:
    """Freeze the encoder, put LoRA on every layer projection; train those and the layers' norms."""
    for p in enc.parameters():
        p.requires_grad_(False)
    trained: list[nn.Parameter] = []
    for layer in enc.layers:
        for name in ADAPTED:
            lora = LoRALinear(getattr(layer, name), rank, alpha)
            setattr(layer, name, lora)
            trained += [lora.a, lora.b]
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.requires_grad_(True)
            trained.append(norm)
    enc.final_norm.requires_grad_(True)
    trained.append(enc.final_norm)
    return trained


def adapter_state(enc: MoonshineStreamingEncoder) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in enc.named_parameters() if v.requires_grad}


# -- data -------------------------------------------------------------------------------------------------


def make_pool(out: Path, n: int, seed: int, shard: int = 250) -> None:
    """n clean utterances from the streaming ASR recipe's training voices and text, in shards of 16-bit PCM."""
    from tqdm.auto import tqdm

    from asr.training.data import corpus
    from asr.training.pool import make_clean
    from asr.training.speakers import SpeakerTable, Synth, conversational_sentences, training_speakers

    out.mkdir(parents=True, exist_ok=True)
    synth, table = Synth(), SpeakerTable(training_speakers())
    dictionary, conv = corpus()[0], conversational_sentences()
    for s0 in tqdm(range(0, n, shard), desc="pool shards"):
        dst = out / f"shard-{seed}-{s0:06d}.npz"
        if dst.exists():
            continue
        audio, texts = [], []
        for i in range(s0, min(n, s0 + shard)):
            e = make_clean(synth, table, dictionary, conv, seed, i, max_words=24)
            audio.append(np.round(np.clip(e.audio, -1, 1) * 32767).astype(np.int16))
            texts.append(e.text)
        tmp = dst.with_suffix(".tmp.npz")
        np.savez(
            tmp, pcm=np.concatenate(audio), lengths=np.array([a.size for a in audio]), texts=np.array(texts)
        )
        os.replace(tmp, dst)


def pool_shards(pool: Path) -> list[Path]:
    """The pool's finished shards, in order (a shard being written is a `.tmp.npz` until it is renamed)."""
    return sorted(pool.glob("shard-*[0-9].npz"))


def load_pool(pool: Path) -> tuple[list[np.ndarray], list[str]]:
    """The pool's utterances and their texts (lower case, no punctuation)."""
    out, texts = [], []
    for f in pool_shards(pool):
        with np.load(f) as z:
            pcm, lengths = z["pcm"], z["lengths"]
            texts.extend(str(t) for t in z["texts"])
        pos = 0
        for n in lengths:
            out.append(pcm[pos : pos + n].astype(np.float32) / 32767)
            pos += n
    return out, texts


def augment(audio: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Lead and tail silence (the VAD's segments start before the speech), a gain, a little noise."""
    lead = np.zeros(int(rng.uniform(0.0, 0.5) * 16000), np.float32)
    tail = np.zeros(int(rng.uniform(0.1, 0.4) * 16000), np.float32)
    x = np.concatenate([lead, audio, tail])
    x = x * (rng.uniform(0.2, 0.9) / (np.abs(x).max() + 1e-9))
    if rng.random() < 0.5:
        x = x + rng.normal(0, 10 ** rng.uniform(-4, -2.5), x.size)
    return x.astype(np.float32)


# -- evaluation -----------------------------------------------------------------------------------------------


class _Hidden:
    """Stands in for Moonshine's onnx encoder: returns given frames."""

    def __init__(self, h: np.ndarray) -> None:
        self.h = h

    def run(self, _names, _feed):
        return [self.h]


def read_frames(moonshine, frames: np.ndarray, audio: np.ndarray) -> str:
    """Moonshine's decoder's greedy transcript of given encoder frames (`audio` sets the length it may read)."""
    from asr.moonshine import decode_tokens

    saved = moonshine._encoder
    moonshine._encoder = _Hidden(frames)
    try:
        return decode_tokens(moonshine.tokens, moonshine._greedy(audio))
    finally:
        moonshine._encoder = saved


def panel_wer(
    enc: MoonshineStreamingEncoder, moonshine, sets: tuple[str, ...], n: int = 60
) -> dict[str, float]:
    """Moonshine's decoder on the encoder's offline (chunk-masked) frames, corpus WER per panel set."""
    from asr.training.panel import panel_set
    from asr.training.wer import wer

    enc.eval()
    out = {}
    try:
        for name in sets:
            utts = panel_set(name, n)
            hyps = []
            for u in utts:
                with torch.no_grad():
                    h = enc(torch.from_numpy(u.audio)[None]).numpy()
                hyps.append(read_frames(moonshine, h, u.audio))
            out[name] = 100 * wer([u.text for u in utts], hyps)
    finally:
        enc.train()
    return out


# -- training -------------------------------------------------------------------------------------------------


def distill_loss(student: torch.Tensor, teacher: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    l1 = (student - teacher).abs().mean()
    cos = F.cosine_similarity(student, teacher, -1).mean()
    return l1 + (1 - cos), {"l1": float(l1.detach()), "cos": float(cos.detach())}


def decoder_loss(
    decoder,
    student: torch.Tensor,
    teacher: torch.Tensor,
    tokens: list[int],
    temperature: float = 1.0,
    scored: list[bool] | None = None,
    kl_where: str = "all",
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """What Moonshine's (frozen) decoder reads from the student's frames against what it reads from the teacher's,
    teacher-forced on a transcript (`tokens`, without BOS/EOS: the teacher's own greedy one, or the known text
    as the decoder spells it, asr/training/forced.py), averaged over its positions (the last predicts EOS):
    KL(teacher || student) of the next-token distributions, and the cross-entropy of the transcript's tokens
    from the student's frames (over the tokens `scored` marks, and EOS; all by default); with how often the
    student's argmax is the teacher's, and how often the teacher's argmax is the transcript's next token.

    `kl_where="right"` keeps the KL only at the positions where the teacher's argmax *is* the transcript's next
    token (the divisor stays every position, so a kept position weighs what it did): where the teacher mishears
    the known text, its distribution would pull the student towards the mistake while the cross-entropy pulls
    towards the text, so there only the cross-entropy teaches."""
    from asr.moonshine import BOS, EOS

    if kl_where not in ("all", "right"):
        raise ValueError(f"kl_where must be 'all' or 'right', not {kl_where!r}")
    ids = torch.tensor([[BOS, *tokens]])
    following = torch.tensor([*tokens, EOS])
    with torch.no_grad():
        target = F.log_softmax(decoder(ids, teacher)[0] / temperature, -1)
    logits = decoder(ids, student)[0]
    logp = F.log_softmax(logits / temperature, -1)
    per_position = (target.exp() * (target - logp)).sum(-1)
    right = target.argmax(-1) == following
    if kl_where == "right":
        per_position = per_position * right
    kl = per_position.mean() * temperature**2
    keep = torch.tensor([*(scored if scored is not None else [True] * len(tokens)), True])
    ce = F.cross_entropy(logits[keep], following[keep])
    agree = (logp.argmax(-1) == target.argmax(-1)).float().mean()
    return kl, ce, {
        "kl": float(kl.detach()), "ce": float(ce.detach()), "agree": float(agree),
        "teacher_right": float(right.float().mean()),
    }  # fmt: skip


def lr_at(cfg: dict, step: int, warmup: int) -> float:
    """The learning rate of `step`: warm-up from the optimiser's start, then constant, or, once a decay phase was
    asked for (`cfg["decay"]`: its start step, length and end ratio), a cosine down to `lr x end` held after."""
    lr = cfg["lr"] * min(1.0, (step - cfg.get("opt_start", 0) + 1) / warmup)
    decay = cfg.get("decay")
    if decay:
        t = min(1.0, max(0.0, (step - decay["start"]) / decay["steps"]))
        lr *= decay["end"] + (1.0 - decay["end"]) * 0.5 * (1.0 + math.cos(math.pi * t))
    return lr


class WeightAverage:
    """The uniform mean of the adapters over the decay phase (exported in place of the last weights when
    `--export --average`): averaging the last checkpoints smooths the last steps' noise."""

    def __init__(self, state: dict | None = None) -> None:
        self.sum: dict[str, torch.Tensor] = dict(state["sum"]) if state else {}
        self.n = int(state["n"]) if state else 0

    def add(self, weights: dict[str, torch.Tensor]) -> None:
        for k, v in weights.items():
            v = v.detach().double()
            self.sum[k] = self.sum[k] + v if k in self.sum else v.clone()
        self.n += 1

    def mean(self) -> dict[str, torch.Tensor]:
        if not self.n:
            raise ValueError("no weights averaged yet")
        return {k: (v / self.n).float() for k, v in self.sum.items()}

    def state(self) -> dict:
        return {"sum": self.sum, "n": self.n}


def train(args: argparse.Namespace) -> None:
    from asr.moonshine import MoonshineModel

    torch.set_num_threads(args.threads)
    run = Path(args.run).expanduser()
    run.mkdir(parents=True, exist_ok=True)
    cfg_path = run / "run.json"
    if cfg_path.exists():
        cfg = json.loads(cfg_path.read_text())
    else:
        cfg = {
            "chunk_frames": args.chunk, "left_frames": args.left, "rank": args.rank, "alpha": args.alpha,
            "lr": args.lr, "accum": args.accum, "seed": args.seed, "pool": str(Path(args.pool).expanduser()),
            "objective": args.objective, "feat_weight": args.feat_weight, "temperature": args.temperature,
            "text_weight": args.text_weight, "kl_where": args.kl_where,
        }  # fmt: skip
        cfg_path.write_text(json.dumps(cfg, indent=1))
    teacher = load_packaged(chunk_frames=None, causal_norm=False)
    student = load_packaged(chunk_frames=cfg["chunk_frames"], left_frames=cfg["left_frames"])
    params = add_adapters(student, cfg["rank"], cfg["alpha"])
    opt = torch.optim.AdamW(params, lr=cfg["lr"], weight_decay=0.0)
    step, position = 0, 0
    average = WeightAverage()
    rng = np.random.default_rng(cfg["seed"])
    ckpt_path = run / "last.pt"
    if ckpt_path.exists():
        ck = torch.load(ckpt_path, weights_only=False)
        student.load_state_dict(ck["model"], strict=False)
        opt.load_state_dict(ck["opt"])
        step, position = ck["step"], ck["position"]
        rng.bit_generator.state = ck["rng"]
        torch.set_rng_state(ck["torch_rng"])
        average = WeightAverage(ck.get("average"))
        print(f"resumed at step {step}, data position {position}", flush=True)
    elif args.init:  # a fresh clone: go on from the shipped adapters (with a fresh optimiser)
        from safetensors.torch import load_file

        src = Path(args.init) / EXPORT_NAME
        meta = json.loads(src.with_suffix(".json").read_text())
        if (meta["cfg"]["chunk_frames"], meta["cfg"]["rank"]) != (cfg["chunk_frames"], cfg["rank"]):
            raise SystemExit(
                f"--init {src}: trained for chunk/rank {meta['cfg']['chunk_frames']}/{meta['cfg']['rank']}"
            )
        missing = student.load_state_dict(
            {k: v.float() for k, v in load_file(str(src)).items()}, strict=False
        )
        if missing.unexpected_keys:
            raise SystemExit(f"--init {src}: unexpected tensors {missing.unexpected_keys[:3]}")
        step, position = int(meta["step"]), int(meta["examples"])
        cfg["opt_start"] = step  # the fresh optimiser warms up again
        cfg["earlier"] = {k: meta.get(k) for k in ("step", "examples", "cfg", "panel", "what", "earlier")}
        cfg_path.write_text(json.dumps(cfg, indent=1))
        print(f"initialised from {src} at step {step}", flush=True)
    if args.decay and not cfg.get("decay"):
        # from here the lr falls along a cosine to --lr-end x lr over --decay steps; the weights are averaged
        cfg["decay"] = {"start": step, "steps": int(args.decay), "end": float(args.lr_end)}
        cfg_path.write_text(json.dumps(cfg, indent=1))
        print(f"decay phase: {args.decay} steps from step {step} down to {args.lr_end:g} x lr", flush=True)
    moonshine = MoonshineModel(threads=args.threads)
    objective = cfg.get("objective", "features")  # runs from before the decoder objective distilled features
    decoder = None
    if objective == "decoder":
        from asr.moonshine_decoder import load_packaged_decoder

        decoder = load_packaged_decoder()
    text_weight = float(cfg.get("text_weight", 0.0))
    spelling = None
    if text_weight > 0:
        from asr.training.forced import Spelling, forced_ids

        spelling = Spelling(moonshine.tokens)
    metrics = open(run / "metrics.jsonl", "a")
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))

    def save() -> None:
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save(
            {
                "model": adapter_state(student), "opt": opt.state_dict(), "step": step, "position": position,
                "rng": rng.bit_generator.state, "torch_rng": torch.get_rng_state(), "cfg": cfg,
                "average": average.state(),
            },
            tmp,
        )  # fmt: skip
        os.replace(tmp, ckpt_path)

    if step == 0:
        row = {"kind": "panel", "step": 0, **panel_wer(student, moonshine, tuple(args.panel))}
        print(row, flush=True)
        metrics.write(json.dumps(row) + "\n")
        metrics.flush()
    t_end = time.time() + 60 * args.minutes
    last_ckpt, t_log = time.time(), time.time()
    acc: dict[str, list[float]] = {"loss": [], "l1": [], "cos": []}
    if decoder is not None:
        acc.update(kl=[], agree=[], ce=[], spelled=[], teacher_right=[])
    shards, pool, texts, order = -1, [], [], np.zeros(0, np.int64)
    while time.time() < t_end and not stop["now"] and (args.steps <= 0 or step < args.steps):
        n_shards = len(pool_shards(Path(cfg["pool"])))
        if n_shards != shards:  # a pool still being written grows between steps
            shards, (pool, texts) = n_shards, load_pool(Path(cfg["pool"]))
            if not pool:
                raise SystemExit(f"no pool audio in {cfg['pool']}: make it with --make-pool")
            order = np.random.default_rng([cfg["seed"], len(pool)]).permutation(len(pool))
        lr = lr_at(cfg, step, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad()
        for _ in range(cfg["accum"]):
            index = order[position % len(pool)]
            audio = augment(pool[index], rng)
            position += 1
            x = torch.from_numpy(audio)[None]
            with torch.no_grad():
                target = teacher(x)
            frames = student(x)
            loss, parts = distill_loss(frames, target)
            if decoder is not None:
                tokens = None
                if spelling is not None:  # the known text, as the decoder spells it from the teacher's frames
                    tokens = forced_ids(moonshine, spelling, target.numpy(), audio.size, texts[index])
                spelled = tokens is not None
                if tokens is None:
                    tokens = moonshine.decode_frames(target.numpy(), audio.size)
                # the text's words are scored, not the marks the decoder put between them
                scored = [spelling.is_word(t) for t in tokens] if spelled and spelling else None
                kl, ce, more = decoder_loss(
                    decoder, frames, target, tokens, cfg.get("temperature", 1.0), scored,
                    kl_where=cfg.get("kl_where", "all") if spelled else "all",
                )  # fmt: skip
                loss = kl + cfg.get("feat_weight", 0.0) * loss + (text_weight * ce if spelled else 0.0)
                parts.update(more, spelled=float(spelled))
            (loss / cfg["accum"]).backward()
            acc["loss"].append(float(loss.detach()))
            for k in acc:
                if k != "loss":
                    acc[k].append(parts[k])
        nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if cfg.get("decay") and step > cfg["decay"]["start"]:
            average.add(adapter_state(student))
        if step % args.log_every == 0:
            row = {"kind": "train", "step": step, "lr": lr, "s_per_step": (time.time() - t_log) / args.log_every,
                   "pool": len(pool), **{k: float(np.mean(v)) for k, v in acc.items()}}  # fmt: skip
            acc = {k: [] for k in acc}
            t_log = time.time()
            print(row, flush=True)
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
        if step % args.every == 0:
            row = {"kind": "panel", "step": step, **panel_wer(student, moonshine, tuple(args.panel))}
            print(row, flush=True)
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
            save()
            last_ckpt = time.time()
        if time.time() - last_ckpt > 60 * args.ckpt_minutes:
            save()
            last_ckpt = time.time()
    save()
    print(f"stopped at step {step}", flush=True)


def _provenance(earlier: dict | None) -> dict | None:
    """An earlier export's provenance, each step once: its panel rows are in the export's own `panel` and its
    run's `earlier` is the next link of the chain, so neither is repeated inside."""
    if not earlier:
        return None
    out = {k: v for k, v in earlier.items() if k not in ("panel", "earlier", "cfg")}
    out["cfg"] = {k: v for k, v in (earlier.get("cfg") or {}).items() if k != "earlier"}
    out["earlier"] = _provenance(earlier.get("earlier"))
    return out


def pool_summary(pool: Path) -> dict | None:
    """What a pool holds, for an export's provenance: utterances per seed (`--make-pool DIR --n N --seed S`)."""
    if not pool.is_dir():
        return None
    per_seed: dict[str, int] = {}
    for f in pool_shards(pool):
        seed = f.name.split("-")[1]
        with np.load(f) as z:
            per_seed[seed] = per_seed.get(seed, 0) + int(z["lengths"].size)
    return {
        "utterances": sum(per_seed.values()),
        "per_seed": per_seed,
        "made_by": "python -m asr.training.train_moonshine_stream --make-pool DIR --n N --seed S "
        "(the training voices and text of asr/training/speakers.py, clean; augmented online)",
    }


def export(args: argparse.Namespace) -> None:
    from safetensors.torch import save_file

    run = Path(args.run).expanduser()
    ck = torch.load(run / "last.pt", weights_only=False)
    out = Path(args.export)
    out.mkdir(parents=True, exist_ok=True)
    weights = ck["model"]
    averaged = 0
    if args.average:
        average = WeightAverage(ck.get("average"))
        if not average.n:
            raise SystemExit(f"--average: run {run} has no decay phase to average (train with --decay N)")
        weights, averaged = average.mean(), average.n
    tensors = {k: v.half().contiguous() for k, v in weights.items()}
    save_file(tensors, str(out / EXPORT_NAME))
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    cfg = json.loads((run / "run.json").read_text()) if (run / "run.json").exists() else ck["cfg"]
    earlier = cfg.get("earlier") or {}
    objective = ck["cfg"].get("objective", "features")
    text_weight = float(ck["cfg"].get("text_weight", 0.0))
    text = f" --text-weight {text_weight:g}" if text_weight else ""
    if ck["cfg"].get("kl_where", "all") != "all":
        text += f" --kl-where {ck['cfg']['kl_where']}"
    decay = ck["cfg"].get("decay")
    if decay:
        text += f" (then --decay {decay['steps']} --lr-end {decay['end']:g} from step {decay['start']})"
    meta = {
        "what": "LoRA adapters and layer norms for Moonshine base-en's encoder run chunk by chunk "
        "(asr/moonshine_stream.py), distilled from its full-context self "
        f"(objective: {objective}{'; + the known text' if text_weight else ''}); fp16",
        "base": "moonshine-cpp's encoder_model.ort (Moonshine base-en, MIT)",
        "step": ck["step"],
        "examples": ck["position"],
        "averaged_steps": averaged,
        "cfg": {k: v for k, v in ck["cfg"].items() if k != "earlier"},
        "data": pool_summary(Path(ck["cfg"]["pool"])),  # None where the pool is gone (cfg keeps its path)
        "panel": (earlier.get("panel") or []) + [r for r in rows if r["kind"] == "panel"],
        "earlier": _provenance(earlier),
        "command": "python -m asr.training.train_moonshine_stream --run RUN --pool POOL --minutes M "
        f"--objective {objective}{text} [--init asr/weights] "
        "(asr/training/train_moonshine_stream.py); export: --export asr/weights"
        + (" --average" if averaged else ""),
    }
    (out / EXPORT_NAME.replace(".safetensors", ".json")).write_text(json.dumps(meta, indent=1))
    print(f"wrote {out / EXPORT_NAME} ({sum(v.numel() for v in tensors.values()) / 1e6:.2f} M values)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="~/.cache/duplex/runs/mstream1")
    ap.add_argument("--pool", default="~/.cache/duplex/mstream-pool")
    ap.add_argument("--make-pool", default=None, help="write a pool of n utterances to this folder and exit")
    ap.add_argument("--n", type=int, default=4000)
    ap.add_argument("--export", default=None)
    ap.add_argument(
        "--init", default=None, help="a new run starts from these exported adapters (e.g. asr/weights)"
    )
    ap.add_argument("--minutes", type=float, default=60)
    ap.add_argument("--steps", type=int, default=0, help="stop at this step (0: only --minutes)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=20)
    ap.add_argument("--left", type=int, default=250)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument(
        "--decay",
        type=int,
        default=0,
        help="start a decay phase at the run's current step: the lr falls along a cosine to --lr-end x lr over "
        "this many steps, and the adapters are averaged over it (export them with --average)",
    )
    ap.add_argument("--lr-end", type=float, default=0.1)
    ap.add_argument("--average", action="store_true", help="with --export: the decay phase's mean adapters")
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--seed", type=int, default=78)
    ap.add_argument("--every", type=int, default=200)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--ckpt-minutes", type=float, default=8)
    ap.add_argument(
        "--objective",
        choices=("features", "decoder"),
        default="features",
        help="features: L1 + (1 - cos) to the full-context frames; decoder: KL of Moonshine's decoder's next-token "
        "distributions on the student's vs the full-context frames (+ --feat-weight x features)",
    )
    ap.add_argument("--feat-weight", type=float, default=0.1)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument(
        "--text-weight",
        type=float,
        default=0.0,
        help="with --objective decoder: also the cross-entropy of the pool's known text (as the decoder spells it) "
        "from the student's frames, x this weight; the KL is then teacher-forced on that text",
    )
    ap.add_argument(
        "--kl-where",
        choices=("all", "right"),
        default="all",
        help="with --text-weight: the KL at every position of the known text (all), or only where the teacher's "
        "argmax is the text's next token (right): where the teacher mishears, only the text's cross-entropy teaches",
    )
    ap.add_argument("--panel", nargs="+", default=["natural-conversational", "heldout-synthetic"])
    args = ap.parse_args(argv)
    if args.make_pool:
        make_pool(Path(args.make_pool).expanduser(), args.n, args.seed)
    elif args.export:
        export(args)
    else:
        train(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
