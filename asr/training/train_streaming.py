"""Train the shipped cache-aware streaming FastConformer (CTC) from scratch on synthesised speech.

    python -m asr.training.train_streaming --run runs/asr --minutes 90        # train (resumes from runs/asr/last.pt)
    python -m asr.training.train_streaming --run runs/asr --export            # write asr/weights/fc_small.nemo + .json
    python -m asr.training.train_streaming --run runs/more --init asr/weights/fc_small.nemo --minutes 90
                                    # go on from the shipped model in a fresh clone (fresh optimiser)

Resumable: the run directory keeps the tokenizer, the last checkpoint (model, optimiser, step) and a log;
example k of the training stream is a pure function of (seed, k) (asr/training/data.py), so a resumed run
sees exactly the examples it would have seen. Each batch trains one of the model's lookaheads, picked at
random by the encoder (multi-lookahead training). Runs on CPU (2 threads here) or CUDA when present.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch

from asr.training.data import Speaker, corpus, make_example, normalize_text
from asr.training.targets import PHONE_CLASSES, alignment_targets, phone_targets
from asr.training.wer import word_errors

WEIGHTS_DIR = Path(__file__).resolve().parents[1] / "weights"
SHIPPED = WEIGHTS_DIR / "fc_small.nemo"


POOL = 4  # batches drawn together and sorted by length, so a batch pads little
# Curriculum (CTC from scratch sits on its all-blank plateau for a long time otherwise, measured here: 700
# steps of all voices at once left it there): steps EASY_STEPS[0]..[1] hear only hibari and plain en-US
# espeak voices, so the acoustics are learnt before the voice variety; until LONG_STEPS sentences have at
# most CURRICULUM_WORDS words and a third of the augmentation; then any length (held-out sentences have
# up to 24 words: measured, validation WER stalled at ~95 % from step 1600 to 1800 on short sentences
# only) at half the augmentation; from CURRICULUM_STEPS on, full augmentation and SpecAugment.
LONG_STEPS = 1950
CURRICULUM_STEPS = 3000
CURRICULUM_WORDS = 7
EASY_STEPS = (0, 300)
# Alignment loss: espeak reports where each word is (asr/training/data.py `word_times`), so each word's
# pieces get a frame (spread over the word, each at the frame where its letters end) and a frame-level
# cross-entropy towards "these pieces there, blank elsewhere" is added to CTC. It gives every frame a
# target from the first step, which CTC alone does not (measured here: 1750 CTC-only steps stayed on the
# all-blank plateau). Its weight is ALIGN_WEIGHT until ALIGN_STEPS[0], then falls linearly to
# ALIGN_FLOOR at ALIGN_STEPS[1], leaving CTC to choose its own timing.
ALIGN_WEIGHT, ALIGN_FLOOR = 1.0, 0.1
ALIGN_STEPS = (1500, 3000)


def align_weight(step: int) -> float:
    if step <= ALIGN_STEPS[0]:
        return ALIGN_WEIGHT
    done = min(1.0, (step - ALIGN_STEPS[0]) / (ALIGN_STEPS[1] - ALIGN_STEPS[0]))
    return ALIGN_WEIGHT + done * (ALIGN_FLOOR - ALIGN_WEIGHT)


def curriculum(step: int) -> tuple[int, float, bool]:
    """(max words, augmentation strength, easy voices only) for training step `step`."""
    if step >= CURRICULUM_STEPS:
        return 0, 1.0, False
    if step >= LONG_STEPS:
        return 0, 0.5, False
    return CURRICULUM_WORDS, 0.33, EASY_STEPS[0] <= step < EASY_STEPS[1]


class BatchStream(torch.utils.data.Dataset):
    """Item p is the pool of training batches p*POOL .. p*POOL+POOL-1 of the seeded example stream,
    its examples sorted by duration (less padding), as a list of (audio, lengths, texts, word times, phonemes)."""

    def __init__(self, seed: int, batch_size: int, first_pool: int) -> None:
        self.seed, self.batch_size, self.first = seed, batch_size, first_pool
        self.speaker: Speaker | None = None

    def __len__(self) -> int:
        return 10**9

    def __getitem__(self, p: int) -> list[tuple[torch.Tensor, torch.Tensor, list[str]]]:
        if self.speaker is None:
            torch.set_num_threads(1)
            self.speaker = Speaker()
        train, _ = corpus()
        n = self.batch_size * POOL
        index = (self.first + p) * n
        max_words, strength, easy = curriculum((self.first + p) * POOL)
        examples = sorted(
            (
                make_example(
                    self.speaker,
                    train,
                    self.seed,
                    index + i,
                    max_words=max_words,
                    strength=strength,
                    easy=easy,
                )
                for i in range(n)
            ),
            key=lambda e: e.audio.size,
        )
        batches = []
        for b in range(POOL):
            part = examples[b * self.batch_size : (b + 1) * self.batch_size]
            lengths = [e.audio.size for e in part]
            audio = torch.zeros(len(part), max(lengths))
            for i, e in enumerate(part):
                audio[i, : e.audio.size] = torch.from_numpy(e.audio)
            batches.append(
                (
                    audio,
                    torch.tensor(lengths),
                    [e.text for e in part],
                    [e.word_times for e in part],
                    [e.phones for e in part],
                )
            )
        order = np.random.default_rng([self.seed, self.first + p]).permutation(POOL)
        return [batches[i] for i in order]


#: last.pt is rewritten at least this often (the panel checkpoints come every `--every` steps, which
#: on a loaded machine can be far more than 10 minutes apart)
SAVE_EVERY_S = 480.0


def _ignore_stop_signals(_worker: int) -> None:
    """The data worker leaves SIGTERM/SIGINT to the trainer, which saves before stopping (a signal sent
    to the whole process group would otherwise kill the worker and the trainer with it, unsaved)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def validation_set(n: int, seed: int = 7) -> list:
    """`n` held-out sentences spoken by held-out voices, clean (no augmentation)."""
    from asr.training.data import heldout_sentences

    heldout = heldout_sentences()
    speaker = Speaker()
    return [make_example(speaker, heldout, seed, i, heldout=True, clean=True) for i in range(n)]


def ctc_greedy(model, log_probs: torch.Tensor, lengths: torch.Tensor) -> list[str]:
    blank = log_probs.shape[-1] - 1
    best = log_probs.argmax(-1)
    out = []
    for row, n in zip(best.tolist(), lengths.tolist(), strict=False):
        ids, prev = [], blank
        for t in row[:n]:
            if t != prev and t != blank:
                ids.append(t)
            prev = t
        out.append(normalize_text(model.tokenizer.ids_to_text(ids)))
    return out


@torch.no_grad()
def evaluate(model, examples: list, att_context_size: list[int]) -> float:
    """Corpus WER of greedy CTC on `examples` at one lookahead (full-utterance forward, eval mode)."""
    model.eval()
    model.encoder.set_default_att_context_size(att_context_size)
    errors = words = 0
    for i in range(0, len(examples), 16):
        chunk = examples[i : i + 16]
        lengths = [e.audio.size for e in chunk]
        audio = torch.zeros(len(chunk), max(lengths))
        for j, e in enumerate(chunk):
            audio[j, : e.audio.size] = torch.from_numpy(e.audio)
        lp, el, _ = model.forward(input_signal=audio, input_signal_length=torch.tensor(lengths))
        for hyp, e in zip(ctc_greedy(model, lp, el), chunk, strict=False):
            errors += word_errors(e.text, hyp)
            words += len(e.text.split())
    model.train()
    return errors / max(words, 1)


def lr_at(step: int, peak: float, warmup: int, restart: int = 0) -> float:
    """Linear warm-up to `peak`, then inverse square root; a run started from a shipped model at step
    `restart` has a fresh optimiser, so its rate warms up again over RESTART_WARMUP steps."""
    rate = peak * min(max(step, 1) / warmup, math.sqrt(warmup / max(step, 1)))
    if restart:
        rate *= min(1.0, max(step - restart, 1) / RESTART_WARMUP)
    return rate


RESTART_WARMUP = 100


def init_run(nemo: Path, run: Path) -> dict:
    """Seed an empty run directory from a shipped `.nemo` and the `.json` beside it: the tokenizer files,
    a checkpoint with its weights and step (no optimiser state: the shipped file has none), and run.json.
    The training stream then goes on from that step, so the examples are the ones the original run would
    have seen next."""
    import tarfile

    info_path = nemo.with_suffix(".json")
    if not nemo.is_file() or not info_path.is_file():
        raise SystemExit(f"--init needs {nemo} and {info_path} (written together by --export)")
    info = json.loads(info_path.read_text())
    tok_dir = run / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    state = None
    with tarfile.open(nemo) as tar:
        for member in tar.getmembers():
            name = Path(member.name).name
            data = tar.extractfile(member) if member.isfile() else None
            if data is None:
                continue
            # NeMo stores artefacts as <hash>_<name>
            for wanted in ("tokenizer.model", "tokenizer.vocab", "vocab.txt"):
                if name.endswith("_" + wanted) or name == wanted:
                    (tok_dir / wanted).write_bytes(data.read())
            if name == "model_weights.ckpt":
                state = torch.load(io.BytesIO(data.read()), map_location="cpu", weights_only=True)
    if state is None or not (tok_dir / "tokenizer.model").exists():
        raise SystemExit(f"{nemo} has no model_weights.ckpt or tokenizer.model")
    step = int(info["step"])
    meta = {k: info[k] for k in ("d_model", "layers", "vocab", "seed", "batch_size")}
    last = info.get("last_validation")
    # an export of a recipe-2 run carries its recipe's start: its ramps and rate schedule go on from there
    # (the fresh optimiser warms up again over RESTART_WARMUP steps); an older export starts the recipe anew
    recipe_start = int(info.get("recipe_start", step))
    meta.update(
        audio_s=float(info.get("audio_s", 0.0)),
        history=[last] if last else [],
        restart_step=step,
        recipe=2,
        recipe_start=recipe_start,
        init_from=str(nemo),
        # fresh examples: past every index the exported run made (0 for an export that does not say)
        example_offset=int(info.get("examples_next", 0)),
    )
    (run / "run.json").write_text(json.dumps(meta, indent=1))
    torch.save({"model": state, "step": step}, run / "last.pt")
    print(f"initialised {run} from {nemo} at step {step} (fresh optimiser)", flush=True)
    return meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="runs/asr", help="run directory (tokenizer, checkpoints, log)")
    ap.add_argument("--minutes", type=float, default=60.0, help="stop after this much wall time (resumable)")
    ap.add_argument("--steps", type=int, default=0, help="stop at this step (0 = no limit)")
    ap.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="32 for a new run; given for a run that has one, it changes it",
    )
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=400)
    ap.add_argument("--d-model", type=int, default=176)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument(
        "--vocab",
        type=int,
        default=1024,
        help="BPE size: at 8x subsampling (12.5 frames/s) 256 pieces give ~2.7 per word, too many for CTC at fast speech",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--val", type=int, default=96, help="held-out examples scored at each checkpoint")
    ap.add_argument("--every", type=int, default=200, help="checkpoint and validate every N steps")
    ap.add_argument(
        "--export",
        nargs="?",
        const=str(SHIPPED),
        default=None,
        help="write the run's model as a .nemo (default asr/weights/fc_small.nemo) and exit",
    )
    ap.add_argument(
        "--init",
        type=Path,
        default=None,
        help="start a new run from a shipped .nemo and its .json (e.g. asr/weights/fc_small.nemo)",
    )
    ap.add_argument(
        "--recipe", type=int, default=2, choices=(1, 2), help="for a new run: 2 (pool, ramps) or 1"
    )
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--workers", type=int, default=1, help="recipe 2: data workers (each its own pool shard)")
    ap.add_argument("--pool", type=int, default=1024, help="recipe 2: clean examples per pool (all workers)")
    ap.add_argument("--pool-epochs", type=int, default=4, help="recipe 2: epochs over each pool")
    ap.add_argument(
        "--bf16", choices=("auto", "on", "off"), default="auto", help="bf16 autocast on the encoder"
    )
    ap.add_argument("--dropout", type=float, default=0.02, help="recipe 2: dropout (the data barely repeats)")
    ap.add_argument("--peak-lr", type=float, default=1e-3, help="recipe 2: AdamW's peak rate after re-warm")
    ap.add_argument("--hold", type=int, default=2000, help="recipe 2: steps at the peak rate after re-warm")
    ap.add_argument("--total", type=int, default=12000, help="recipe 2: steps to the end of the cosine decay")
    ap.add_argument("--rewarm", type=int, default=200, help="recipe 2: re-warm steps")
    ap.add_argument(
        "--panel-n", type=int, default=60, help="recipe 2: utterances per panel set at each check"
    )
    ap.add_argument("--keep", type=int, default=5, help="recipe 2: checkpoints kept for averaging")
    ap.add_argument("--average", type=int, default=0, help="with --export: average the last N checkpoints")
    ap.add_argument("--fp16", action="store_true", help="with --export: store the weights in fp16")
    ap.add_argument(
        "--distill",
        type=float,
        default=0.0,
        help="recipe 2: weight of the Moonshine-feature distillation loss (asr/training/distill.py; 0 = off)",
    )
    ap.add_argument("--kill-after", type=int, default=6000, help="recipe 2: steps before the kill criterion")
    ap.add_argument(
        "--profile-steps", type=int, default=0, help="time N steps (data wait vs compute), then stop"
    )
    ap.add_argument("--dry-run", action="store_true", help="a tiny model, 3 steps, export: checks the path")
    args = ap.parse_args(argv)
    if args.dry_run:
        return dry_run(args)

    torch.set_num_threads(args.threads)
    from asr.training.streaming_model import ATT_CONTEXT_SIZES, build_model, model_config, train_tokenizer

    run = Path(args.run)
    run.mkdir(parents=True, exist_ok=True)
    tok_dir = run / "tokenizer"
    if args.init is not None:
        if (run / "last.pt").exists():
            print(f"{run} already has a checkpoint: resuming it, --init ignored", flush=True)
        else:
            init_run(args.init, run)
    if not (tok_dir / "tokenizer.model").exists():
        train, _ = corpus()
        train_tokenizer([normalize_text(s) for s in train], tok_dir, args.vocab)
    meta_path = run / "run.json"
    meta = (
        json.loads(meta_path.read_text())
        if meta_path.exists()
        else {
            "d_model": args.d_model,
            "layers": args.layers,
            "vocab": args.vocab,
            "seed": args.seed,
            "batch_size": args.batch_size or 32,
            "history": [],
            "recipe": args.recipe,
            "recipe_start": 0,
        }
    )
    if args.batch_size:
        meta["batch_size"] = args.batch_size
    torch.manual_seed(meta["seed"])
    cfg = model_config(tok_dir.resolve(), d_model=meta["d_model"], n_layers=meta["layers"])
    model = build_model(cfg)
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=1e-3)
    phone_head = torch.nn.Linear(meta["d_model"], PHONE_CLASSES).to(device)
    phone_opt = torch.optim.AdamW(phone_head.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=1e-3)
    step = 0
    ckpt_path = run / "last.pt"
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, map_location=device, weights_only=False)
        model.load_state_dict(ckpt["model"])
        if "opt" in ckpt:  # absent right after --init
            opt.load_state_dict(ckpt["opt"])
        if "phone_head" in ckpt:  # runs from before the phone loss start it fresh
            phone_head.load_state_dict(ckpt["phone_head"])
            phone_opt.load_state_dict(ckpt["phone_opt"])
        step = ckpt["step"]
        print(f"resumed at step {step}", flush=True)

    def save() -> None:
        torch.save(
            {
                "model": model.state_dict(),
                "opt": opt.state_dict(),
                "step": step,
                "phone_head": phone_head.state_dict(),
                "phone_opt": phone_opt.state_dict(),
            },
            str(ckpt_path) + ".tmp",
        )
        os.replace(str(ckpt_path) + ".tmp", ckpt_path)
        meta_path.write_text(json.dumps(meta, indent=1))

    if args.export:
        if args.average:
            averaged = average_checkpoints(run, args.average)
            if averaged is not None:
                model.load_state_dict(averaged[0])
                meta["averaged_steps"] = averaged[1]
        if args.fp16:
            model.half()
        model.eval()
        out = Path(args.export)
        out.parent.mkdir(parents=True, exist_ok=True)
        model.save_to(str(out))
        info = {k: v for k, v in meta.items() if k != "history"}
        info.update(
            step=step,
            audio_hours=round(meta.get("audio_s", 0) / 3600, 2),
            params=sum(p.numel() for p in model.parameters()),
            last_validation=meta["history"][-1] if meta["history"] else None,
            recipe="python -m asr.training.train_streaming (asr/training/data.py for data)",
        )
        out.with_suffix(".json").write_text(json.dumps(info, indent=1) + "\n")
        print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB) at step {step}")
        return 0

    if meta.get("recipe", 1) == 2:
        ckpt_extra = (
            torch.load(ckpt_path, map_location="cpu", weights_only=False) if ckpt_path.exists() else {}
        )
        return train_pool(args, model, phone_head, opt, phone_opt, meta, run, device, step, ckpt_extra)
    val = validation_set(args.val)
    batch_size = meta["batch_size"]
    loader = torch.utils.data.DataLoader(
        BatchStream(meta["seed"], batch_size, step // POOL),
        batch_size=None,
        shuffle=False,
        num_workers=1,
        prefetch_factor=2,
        persistent_workers=False,
        worker_init_fn=_ignore_stop_signals,
    )
    model.train()
    spec_augment = model.spec_augmentation
    deadline = time.monotonic() + args.minutes * 60
    stop = {"asked": False}

    def ask_stop(signum, _frame):  # SIGTERM / Ctrl-C: finish the step, save, exit (resume later)
        stop["asked"] = True
        print(f"signal {signum}: saving and stopping after this step", flush=True)

    signal.signal(signal.SIGTERM, ask_stop)
    signal.signal(signal.SIGINT, ask_stop)
    t_last, losses, align_losses, phone_losses = time.monotonic(), [], [], []
    batches = (batch for pool in loader for batch in pool)
    for _ in range(step % POOL):  # resuming inside a pool: skip the batches already trained on
        next(batches)
    for audio, lengths, texts, times, phones in batches:
        if stop["asked"] or time.monotonic() > deadline or (args.steps and step >= args.steps):
            break
        for group in opt.param_groups + phone_opt.param_groups:
            group["lr"] = lr_at(step + 1, args.lr, args.warmup, meta.get("restart_step", 0))
        model.spec_augmentation = spec_augment if step >= CURRICULUM_STEPS else None
        tokens = [model.tokenizer.text_to_ids(t) for t in texts]
        targets = torch.zeros(len(tokens), max(len(t) for t in tokens), dtype=torch.long)
        for i, t in enumerate(tokens):
            targets[i, : len(t)] = torch.tensor(t)
        feats, feat_lengths = model.preprocessor(input_signal=audio.to(device), length=lengths.to(device))
        if model.spec_augmentation is not None:
            feats = model.spec_augmentation(input_spec=feats, length=feat_lengths)
        encoded, el = model.encoder(audio_signal=feats, length=feat_lengths)
        lp = model.decoder(encoder_output=encoded)
        ctc = model.loss(
            log_probs=lp,
            targets=targets.to(device),
            input_lengths=el,
            target_lengths=torch.tensor([len(t) for t in tokens], device=device),
        )
        loss = ctc
        weight = align_weight(step + 1)
        if weight > 0:
            frames = alignment_targets(
                [model.tokenizer.ids_to_tokens(t) for t in tokens],
                times,
                el.tolist(),
                lp.shape[-1] - 1,
                tokens,
            ).to(device)
            aligned = int((frames[:, 0] != -100).sum())
            if aligned:  # summed over an example's frames, averaged over examples: CTC's scale
                align = (
                    torch.nn.functional.nll_loss(
                        lp[:, : frames.shape[1]].transpose(1, 2), frames, ignore_index=-100, reduction="sum"
                    )
                    / aligned
                )
                loss = loss + weight * align
                align_losses.append(float(align.detach()))
            labels = phone_targets(phones, el.tolist()).to(device)
            labelled = int((labels[:, 0] != -100).sum())
            if labelled:
                logits = phone_head(encoded[:, :, : labels.shape[1]].transpose(1, 2))
                phone = (
                    torch.nn.functional.cross_entropy(
                        logits.transpose(1, 2), labels, ignore_index=-100, reduction="sum"
                    )
                    / labelled
                )
                loss = loss + weight * phone
                phone_losses.append(float(phone.detach()))
        opt.zero_grad(set_to_none=True)
        phone_opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()) + list(phone_head.parameters()), 1.0)
        opt.step()
        phone_opt.step()
        step += 1
        meta["audio_s"] = meta.get("audio_s", 0.0) + float(lengths.sum()) / 16000
        losses.append(float(ctc.detach()))
        if step % 20 == 0:
            now = time.monotonic()
            align_text = f" align {np.mean(align_losses):.2f}" if align_losses else ""
            align_text += f" phone {np.mean(phone_losses):.2f}" if phone_losses else ""
            print(
                f"step {step} ctc {np.mean(losses):.3f}{align_text} lr {opt.param_groups[0]['lr']:.2e} "
                f"{(now - t_last) / 20:.2f} s/step audio {meta['audio_s'] / 3600:.2f} h",
                flush=True,
            )
            t_last, losses, align_losses, phone_losses = now, [], [], []
        if step % args.every == 0:
            wers = {str(ctx[1]): round(evaluate(model, val, ctx), 4) for ctx in (ATT_CONTEXT_SIZES[1],)}
            meta["history"].append({"step": step, "audio_h": round(meta["audio_s"] / 3600, 2), "wer": wers})
            print(f"step {step} held-out WER {wers}", flush=True)
            save()
    save()
    print(f"stopped at step {step}; resume with the same command", flush=True)
    return 0


# ---- recipe 2: pooled data, smooth ramps, re-warm/hold/decay, panel validation, averaging --------------


def bf16_wanted(choice: str, device: torch.device) -> bool:
    """`auto`: bf16 autocast on CUDA where supported; not on the CPU, where it measured slower for this
    model (docs/asr.md: 3.85 vs 3.43 CPU-s per step on this AVX-512/AMX CPU at d_model 176)."""
    if choice != "auto":
        return choice == "on"
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def checkpoint_paths(run: Path) -> list[Path]:
    return sorted(run.glob("ckpt-*.pt"), key=lambda p: int(p.stem.split("-")[1]))


def average_checkpoints(run: Path, n: int) -> tuple[dict, list[int]] | None:
    """Element-wise mean of the model weights in the run's last `n` checkpoints (and their steps)."""
    paths = checkpoint_paths(run)[-n:]
    if not paths:
        return None
    total: dict[str, torch.Tensor] = {}
    for path in paths:
        state = torch.load(path, map_location="cpu", weights_only=True)
        for k, v in state.items():
            if v.is_floating_point():
                total[k] = total.get(k, torch.zeros_like(v, dtype=torch.float64)) + v.double()
            else:
                total[k] = v
    avg = {k: (v / len(paths)).float() if v.is_floating_point() else v for k, v in total.items()}
    return avg, [int(p.stem.split("-")[1]) for p in paths]


@torch.no_grad()
def evaluate_panel(model, sets: dict[str, list], att_context_size: list[int]) -> dict[str, float]:
    return {name: round(evaluate(model, utts, att_context_size), 4) for name, utts in sets.items()}


def kill_verdict(history: list[dict], start: int, after: int) -> str | None:
    """The kill criterion (docs/asr.md): `after` steps into recipe 2, training-voice WER must have fallen
    >= 15 points and plain held-out WER >= 10 points from the recipe's first panel; else a reason."""
    panels = [h for h in history if "panel" in h and h["step"] >= start]
    if not panels or panels[-1]["step"] - start < after:
        return None
    if panels[0]["step"] - start >= after:
        return None  # a run that went on from an export past the judgement (init_run): judged before
    first, last = panels[0]["panel"], panels[-1]["panel"]
    drop_train = first["train-voices"] - last["train-voices"]
    drop_plain = first["heldout-synthetic"] - last["heldout-synthetic"]
    if drop_train >= 0.15 and drop_plain >= 0.10:
        return None
    return (
        f"kill criterion met at step {panels[-1]['step']}: training-voice WER fell {100 * drop_train:.1f} points "
        f"(needs 15), plain held-out {100 * drop_plain:.1f} (needs 10): stop and debug (target/time mapping "
        "under augmentation, learning rate, batch) before spending more"
    )


def train_pool(
    args, model, phone_head, opt, phone_opt, meta, run: Path, device, step: int, ckpt: dict
) -> int:
    """Recipe 2's loop (asr/training/pool.py for the data); resumable to the batch and the RNG."""
    import contextlib
    import random

    from asr.training.pool import PoolStream, Schedule, lr_schedule, scale_spec_augment
    from asr.training.streaming_model import ATT_CONTEXT_SIZES

    start = int(meta.get("recipe_start", 0))
    restart = int(meta.get("restart_step", start))
    schedule = Schedule(words_from=7 if start == 0 and step < LONG_STEPS else 0)
    data_batches = int(ckpt.get("data_batches", 0))
    if "phone_head" not in ckpt:  # a shipped .nemo has no phone head: it starts fresh here
        meta["phone_head_start"] = step
    if "rng" in ckpt:
        torch.set_rng_state(ckpt["rng"]["torch"])
        np.random.set_state(ckpt["rng"]["numpy"])
        random.setstate(ckpt["rng"]["python"])
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = args.dropout
    use_bf16 = bf16_wanted(args.bf16, device)
    autocast = (
        (lambda: torch.autocast(device.type, dtype=torch.bfloat16))
        if use_bf16
        else (lambda: contextlib.nullcontext())
    )
    spec_module = model.spec_augmentation
    spec_base = {
        k: float(model.cfg.spec_augment[k]) for k in ("freq_masks", "time_masks", "freq_width", "time_width")
    }
    workers = max(args.workers, 0)
    stream = PoolStream(
        meta["seed"],
        meta["batch_size"],
        str(run / "tokenizer" / "tokenizer.model"),
        pool_size=args.pool,
        epochs=args.pool_epochs,
        start_batch=data_batches,
        start_t=step - start,
        schedule=schedule,
        workers=max(workers, 1),
        engines=_DRY_ENGINES,
        example_offset=int(meta.get("example_offset", 0)),
        teacher=args.distill > 0,
    )
    distill_head = distill_opt = None
    if args.distill > 0:
        from asr.training.distill import DistillHead

        distill_head = DistillHead(meta["d_model"]).to(device)
        distill_opt = torch.optim.AdamW(
            distill_head.parameters(), lr=args.peak_lr, betas=(0.9, 0.98), weight_decay=1e-3
        )
        if "distill_head" in ckpt:
            distill_head.load_state_dict(ckpt["distill_head"])
            distill_opt.load_state_dict(ckpt["distill_opt"])
        else:
            meta["distill_start"] = step
        meta.setdefault("distill_by_restart", {})[str(step)] = args.distill
    data_batches = stream.start_batch
    loader = torch.utils.data.DataLoader(
        stream,
        batch_size=None,
        num_workers=workers,
        prefetch_factor=4 if workers else None,
        worker_init_fn=_ignore_stop_signals if workers else None,
    )
    panel_sets: dict[str, list] = {}
    if args.panel_n:
        from asr.training.panel import SETS, panel_set

        panel_sets = {name: panel_set(name, args.panel_n) for name in SETS}
    la480 = ATT_CONTEXT_SIZES[1]
    ckpt_path, meta_path = run / "last.pt", run / "run.json"

    def save() -> None:
        # where a run that goes on from this one's export starts its stream (init_run)
        meta["examples_next"] = stream.example_offset + stream.examples_made(data_batches)
        state = {
            "model": model.state_dict(),
            "opt": opt.state_dict(),
            "step": step,
            "phone_head": phone_head.state_dict(),
            "phone_opt": phone_opt.state_dict(),
            **(
                {"distill_head": distill_head.state_dict(), "distill_opt": distill_opt.state_dict()}
                if distill_head is not None and distill_opt is not None
                else {}
            ),
            "data_batches": data_batches,
            "rng": {
                "torch": torch.get_rng_state(),
                "numpy": np.random.get_state(),
                "python": random.getstate(),
            },
        }
        torch.save(state, str(ckpt_path) + ".tmp")
        os.replace(str(ckpt_path) + ".tmp", ckpt_path)
        meta_path.write_text(json.dumps(meta, indent=1))
        saved["t"] = time.monotonic()

    saved = {"t": time.monotonic()}

    def check() -> str | None:
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, run / f"ckpt-{step}.pt")
        for old in checkpoint_paths(run)[: -args.keep]:
            old.unlink()
        if panel_sets:
            wers = evaluate_panel(model, panel_sets, la480)
            meta["history"].append(
                {"step": step, "audio_h": round(meta.get("audio_s", 0) / 3600, 2), "panel": wers}
            )
            print(f"step {step} panel WER {wers}", flush=True)
        save()
        return kill_verdict(meta["history"], start, args.kill_after)

    if panel_sets and not any("panel" in h and h["step"] >= start for h in meta["history"]):
        check()  # the recipe's first panel: what the kill criterion compares with
    model.train()
    deadline = time.monotonic() + args.minutes * 60
    stop = {"asked": False}

    def ask_stop(signum, _frame):
        stop["asked"] = True
        print(f"signal {signum}: saving and stopping after this step", flush=True)

    signal.signal(signal.SIGTERM, ask_stop)
    signal.signal(signal.SIGINT, ask_stop)
    from asr.training.speakers import available_engines

    engines = _DRY_ENGINES or available_engines()
    # which voices each slice could speak (a GPU slice lacks some)
    meta.setdefault("engines_by_restart", {})[str(step)] = list(engines)
    print(
        f"recipe 2 from step {step} (t={step - start}), data batch {data_batches}, bf16 {use_bf16}, "
        f"workers {workers}, pool {args.pool} x {args.pool_epochs} epochs, device {device}, "
        f"voices {','.join(engines)}",
        flush=True,
    )
    log: dict[str, list[float]] = {
        "ctc": [], "align": [], "phone": [], "distill": [], "data": [], "compute": [], "gen": []
    }  # fmt: skip
    extra_opts = [distill_opt] if distill_opt is not None else []
    head_params = list(phone_head.parameters()) + (list(distill_head.parameters()) if distill_head else [])
    timed: list[tuple[float, float]] = []
    t_wait = time.perf_counter()
    verdict = None
    for batch in loader:
        got = time.perf_counter()
        if stop["asked"] or time.monotonic() > deadline or (args.steps and step >= args.steps):
            break
        t = step + 1 - start
        lr = lr_schedule(t, args.peak_lr, args.rewarm, args.hold, args.total)
        if restart > start:  # resumed mid-recipe with a fresh optimiser
            lr *= min(1.0, max(step + 1 - restart, 1) / RESTART_WARMUP)
        for o in [opt, phone_opt, *extra_opts]:
            for group in o.param_groups:
                group["lr"] = lr
        spec_on = scale_spec_augment(spec_module, schedule.spec_scale(t), spec_base)
        if spec_on and hasattr(spec_module.spec_augment, "_rng"):  # NeMo's own random.Random: seed per step
            spec_module.spec_augment._rng.seed(meta["seed"] * 1_000_003 + step)
        audio, lengths = batch["audio"].to(device), batch["lengths"].to(device)
        feats, feat_lengths = model.preprocessor(input_signal=audio, length=lengths)
        if spec_on:
            feats = spec_module(input_spec=feats, length=feat_lengths)
        with autocast():
            encoded, el = model.encoder(audio_signal=feats, length=feat_lengths)
        encoded = encoded.float()
        lp = model.decoder(encoder_output=encoded)
        ctc = model.loss(
            log_probs=lp,
            targets=batch["targets"].to(device),
            input_lengths=el,
            target_lengths=batch["target_lengths"].to(device),
        )
        loss = ctc
        n_frames = lp.shape[1]
        frames = _fit_frames(batch["align"], n_frames).to(device)
        aligned = int((frames[:, 0] != -100).sum())
        if aligned:
            align = (
                torch.nn.functional.nll_loss(lp.transpose(1, 2), frames, ignore_index=-100, reduction="sum")
                / aligned
            )
            loss = loss + schedule.align_weight(t) * align
            log["align"].append(float(align.detach()))
        labels = _fit_frames(batch["phones"], n_frames).to(device)
        labelled = int((labels[:, 0] != -100).sum())
        if labelled:
            # a fresh head first learns on the encoder's output without moving the encoder (its early,
            # large loss would otherwise dominate the clipped gradient)
            young = step - int(meta.get("phone_head_start", -(10**9))) < PHONE_HEAD_WARMUP
            logits = phone_head((encoded.detach() if young else encoded).transpose(1, 2))
            phone = (
                torch.nn.functional.cross_entropy(
                    logits.transpose(1, 2), labels, ignore_index=-100, reduction="sum"
                )
                / labelled
            )
            loss = loss + schedule.phone_weight(t) * phone
            log["phone"].append(float(phone.detach()))
        if distill_head is not None and "teacher" in batch:
            from asr.training.distill import distill_loss, fit_frames

            # like the phone head: a fresh head first learns on a detached encoder output
            young = step - int(meta.get("distill_start", -(10**9))) < DISTILL_HEAD_WARMUP
            pred = distill_head(encoded.detach() if young else encoded, el)
            target = fit_frames(batch["teacher"], pred.shape[1]).to(device).float()
            tmask = fit_frames(batch["teacher_mask"], pred.shape[1]).to(device)
            dist = distill_loss(pred, target, tmask)
            loss = loss + args.distill * dist
            log["distill"].append(float(dist.detach()))
        opt.zero_grad(set_to_none=True)
        for o in [phone_opt, *extra_opts]:
            o.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()) + head_params, 1.0)
        opt.step()
        for o in [phone_opt, *extra_opts]:
            o.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        done = time.perf_counter()
        step += 1
        data_batches = int(batch["batch_index"]) + 1
        meta["audio_s"] = meta.get("audio_s", 0.0) + float(batch["lengths"].sum()) / 16000
        log["ctc"].append(float(ctc.detach()))
        log["data"].append(got - t_wait)
        log["compute"].append(done - got)
        log["gen"].append(float(batch["pool_gen_s"]))
        timed.append((got - t_wait, done - got))
        t_wait = time.perf_counter()
        if step % 20 == 0 or (args.profile_steps and len(timed) >= args.profile_steps):
            parts = [f"step {step} ctc {np.mean(log['ctc']):.3f}"]
            parts += [f"{k} {np.mean(log[k]):.2f}" for k in ("align", "phone") if log[k]]
            parts += [f"distill {np.mean(log['distill']):.3f}"] if log["distill"] else []
            parts.append(
                f"lr {lr:.2e} data {np.mean(log['data']):.2f} s compute {np.mean(log['compute']):.2f} s/step "
                f"pool-gen {sum(log['gen']):.1f} s audio {meta['audio_s'] / 3600:.2f} h"
            )
            print(" ".join(parts), flush=True)
            log = {k: [] for k in log}
        if args.profile_steps and len(timed) >= args.profile_steps:
            wait = [a for a, _ in timed[1:]] or [timed[0][0]]
            comp = [b for _, b in timed]
            print(
                f"profile: {len(timed)} steps, first batch {timed[0][0]:.1f} s (pool), then data wait "
                f"{np.mean(wait):.3f} s + compute {np.mean(comp):.3f} s per step -> "
                f"{3600 / (np.mean(wait) + np.mean(comp)):.0f} steps/h",
                flush=True,
            )
            break
        if step % args.every == 0:
            verdict = check()
            if verdict:
                print(verdict, flush=True)
                meta["killed"] = verdict
                break
        if time.monotonic() - saved["t"] >= SAVE_EVERY_S:  # a loaded machine: steps come slowly
            save()
    save()
    print(f"stopped at step {step}; resume with the same command", flush=True)
    return 3 if verdict else 0


PHONE_HEAD_WARMUP = 200  # steps a fresh phone head trains on a detached encoder output
DISTILL_HEAD_WARMUP = 100  # the same for a fresh distillation head


def _fit_frames(labels: torch.Tensor, n: int) -> torch.Tensor:
    """Frame labels cropped or padded (-100) to the encoder's `n` frames."""
    if labels.shape[1] >= n:
        return labels[:, :n]
    return torch.nn.functional.pad(labels, (0, n - labels.shape[1]), value=-100)


def dry_run(args) -> int:
    """A tiny model in a temporary run: 3 steps of recipe 2 on `args.device`, a checkpoint, an fp16 export."""
    import tempfile

    from asr.training.speakers import available_engines, dictionary_sentences
    from asr.training.streaming_model import train_tokenizer

    engines = tuple(e for e in available_engines() if e in ("espeak", "hibari", "flite"))
    if not engines:
        raise SystemExit("dry run: no synthesiser installed (espeakng-loader, hibari-tts or flite)")
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        train_tokenizer([normalize_text(s) for s in dictionary_sentences()[:3000]], run / "tokenizer", 128)
        argv = [
            "--run", str(run), "--steps", "3", "--batch-size", "2", "--d-model", "32", "--layers", "1",
            "--vocab", "128", "--threads", "1", "--pool", "4", "--pool-epochs", "2", "--workers", "0",
            "--panel-n", "0", "--every", "2", "--device", args.device,
        ]  # fmt: skip
        if args.distill > 0:
            argv += ["--distill", str(args.distill)]
        main_args = argv
        import asr.training.train_streaming as me

        me._DRY_ENGINES = engines
        rc = me.main(main_args)
        out = Path(tmp) / "dry.nemo"
        rc = rc or me.main(["--run", str(run), "--export", str(out), "--average", "2", "--fp16"])
        ok = rc == 0 and out.is_file() and (run / "last.pt").is_file()
        ck = torch.load(run / "last.pt", map_location="cpu", weights_only=False)
        ok = ok and ck["step"] == 3 and ck["data_batches"] == 3 and "rng" in ck
        ok = ok and (args.distill <= 0 or "distill_head" in ck)
        print(
            f"dry run {'ok' if ok else 'FAILED'}: 3 steps on {args.device}, engines {engines}, export {out.stat().st_size if out.is_file() else 0} bytes"
        )
        return 0 if ok else 1


_DRY_ENGINES: tuple[str, ...] | None = None


if __name__ == "__main__":
    sys.exit(main())
