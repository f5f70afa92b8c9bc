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
FRAME_S = 0.08  # encoder frame (8x subsampling of 10 ms features)
# Phone loss: espeak also reports its phonemes, so every encoder frame gets a dense label (the phoneme
# sounding at the frame's centre, silence outside them) and a linear head on the encoder output learns
# them with cross-entropy, weighted like the alignment loss. Phonemes are what the acoustics show
# directly; measured here, the sparse piece targets alone left the model at the pieces' unigram
# distribution for 800 steps. The head is training-only: it is not part of the exported model.
# Classes: espeak's English mnemonics (all accents, stress marks dropped), 0 = pause, last = any other.
PHONES = (
    "t",
    "n",
    "d",
    "I",
    "s",
    "k",
    "a",
    "@",
    "l",
    "m",
    "aI",
    "E",
    "w",
    "p",
    "r",
    "0",
    "D",
    "V",
    "v",
    "z",
    "u:",
    "eI",
    "j",
    "a#",
    "I2",
    "b",
    "oU",
    "i:",
    "h",
    "f",
    "3",
    ";",
    "S",
    "U",
    "i",
    "N",
    "g",
    "@2",
    "dZ",
    "3:",
    "@L",
    "aU",
    "r-",
    "A@",
    "i@",
    "O@",
    "T",
    "tS",
    "e@",
    "O:",
    "o@",
    "t#",
    "i@3",
    "I#",
    "aI2",
    "aa",
    "w#",
    "O2",
    "U@",
    "aI@",
    "A:",
    "@5",
    "t[",
    "t2",
    "@-",
    "VR",
    "IR",
    "Z",
    "OI",
    "x",
    "e",
    "o",
    "A",
    "O",
    "u",
    "y",
    "Q",
    "?",
)
_PHONE_INDEX = {name: i + 1 for i, name in enumerate(PHONES)}
PHONE_CLASSES = len(PHONES) + 2


def align_weight(step: int) -> float:
    if step <= ALIGN_STEPS[0]:
        return ALIGN_WEIGHT
    done = min(1.0, (step - ALIGN_STEPS[0]) / (ALIGN_STEPS[1] - ALIGN_STEPS[0]))
    return ALIGN_WEIGHT + done * (ALIGN_FLOOR - ALIGN_WEIGHT)


def alignment_targets(
    pieces: list[list[str]], word_times: list, n_frames: list[int], blank: int, ids: list[list[int]]
) -> torch.Tensor:
    """Frame targets (batch, max frames) for the alignment loss: example b's pieces `ids[b]` (SentencePiece
    `pieces[b]`, a word starts at a '▁' piece) placed over its words' (start, end) seconds, each piece at the
    frame where its share of the word's letters ends, later pieces pushed one frame on where they collide;
    `blank` elsewhere; -100 (ignored) for a whole example without word times or whose pieces do not fit."""
    out = torch.full((len(ids), max(n_frames)), -100, dtype=torch.long)
    for b, (toks, times) in enumerate(zip(pieces, word_times, strict=True)):
        if times is None:
            continue
        words: list[list[tuple[int, int]]] = []
        for tid, piece in zip(ids[b], toks, strict=True):
            if piece.startswith("▁") or not words:
                words.append([])
            words[-1].append((tid, max(len(piece.lstrip("▁")), 1)))
        if len(words) != len(times):
            continue
        row = torch.full((n_frames[b],), blank, dtype=torch.long)
        prev, ok = -1, True
        for word, (start, end) in zip(words, times, strict=True):
            total, seen = sum(n for _, n in word), 0
            for tid, n in word:
                seen += n
                frame = max(int((start + (end - start) * seen / total) / FRAME_S), prev + 1)
                if frame >= n_frames[b]:
                    ok = False
                    break
                row[frame], prev = tid, frame
        if ok:
            out[b, : n_frames[b]] = row
    return out


def phone_class(name: str) -> int:
    """Class of an espeak phoneme mnemonic: 0 for pauses, its `PHONES` index + 1, or the last for others."""
    name = name.replace("'", "").replace(",", "").strip()
    if not name or name.startswith("_"):
        return 0
    return _PHONE_INDEX.get(name, PHONE_CLASSES - 1)


def phone_targets(phones: list, n_frames: list[int]) -> torch.Tensor:
    """Dense frame labels (batch, max frames): the class of the phoneme sounding at each encoder frame's
    centre (frame j covers ~(80j - 70, 80j + 10] ms of audio), 0 between phonemes, -100 past an example's
    frames and for examples without phonemes (hibari)."""
    out = torch.full((len(phones), max(n_frames)), -100, dtype=torch.long)
    for b, spans in enumerate(phones):
        if not spans:
            continue
        starts = np.array([a for _, a, _ in spans])
        ends = np.array([e for _, _, e in spans])
        classes = np.array([phone_class(p) for p, _, _ in spans])
        centres = np.arange(n_frames[b]) * FRAME_S - 0.03
        k = np.searchsorted(starts, centres, side="right") - 1
        inside = (k >= 0) & (centres < ends[np.clip(k, 0, None)])
        out[b, : n_frames[b]] = torch.from_numpy(np.where(inside, classes[np.clip(k, 0, None)], 0))
    return out


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
    meta.update(
        audio_s=float(info.get("audio_s", 0.0)),
        history=[last] if last else [],
        restart_step=step,
        init_from=str(nemo),
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
    ap.add_argument("--batch-size", type=int, default=32)
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
    args = ap.parse_args(argv)

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
            "batch_size": args.batch_size,
            "history": [],
        }
    )
    torch.manual_seed(meta["seed"])
    cfg = model_config(tok_dir.resolve(), d_model=meta["d_model"], n_layers=meta["layers"])
    model = build_model(cfg)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
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


if __name__ == "__main__":
    sys.exit(main())
