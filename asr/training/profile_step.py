"""Profile one training step of the streaming ASR: data generation against forward/backward.

    python -m asr.training.profile_step [--batch-size 32] [--reps 3] [--threads 1] [--out profile.json]

Measures, on the shipped model (asr/weights/fc_small.nemo) and one thread:
- recipe 1's data: one batch of `BatchStream` (every example synthesised and augmented afresh);
- recipe 2's data: clean synthesis per example by engine (the pool's cost, paid once per `--pool-epochs`)
  and `build_batch` (augmentation + targets, paid every step);
- compute: preprocessor + encoder + CTC/alignment/phone losses + backward + AdamW, fp32 and bf16 autocast.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

CPU_TIMES: dict[str, float] = {}


def _time(fn, reps: int, name: str = "") -> float:
    """Median wall seconds of `fn`; its median CPU seconds (this process, one thread: what an idle core
    would take, less sensitive to other processes on a shared machine) go to CPU_TIMES[name]."""
    times, cpu = [], []
    for _ in range(reps):
        t, c = time.perf_counter(), time.process_time()
        fn()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    if name:
        CPU_TIMES[name] = round(float(np.median(cpu)), 4)
    return float(np.median(times))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--per-engine", type=int, default=6, help="clean examples timed per engine")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    import sentencepiece as spm

    from asr.training.pool import PoolStream, build_batch, make_clean
    from asr.training.speakers import (
        ENGINE_SHARES,
        SpeakerTable,
        Synth,
        available_engines,
        conversational_sentences,
        dictionary_sentences,
        training_speakers,
    )
    from asr.training.train_streaming import POOL, SHIPPED, BatchStream, init_run

    result: dict = {"batch_size": args.batch_size, "threads": args.threads}
    # recipe 1's data, one batch (a pool of POOL batches / POOL)
    stream = BatchStream(1, args.batch_size, 2476 // POOL)
    stream[0]  # warm-up: loads espeak and hibari
    result["recipe1_data_s_per_batch"] = _time(lambda: stream[1], 1, "recipe1_data_per_pool") / POOL
    # recipe 2: clean synthesis per engine, then augmentation + targets per batch
    synth = Synth()
    dictionary, conversational = dictionary_sentences(), conversational_sentences()
    per_engine = {}
    pool = []
    for engine in available_engines():
        table = SpeakerTable(training_speakers((engine,)), {engine: 1.0})
        make_clean(synth, table, dictionary, conversational, 99, 0)  # warm-up
        t = time.process_time()  # CPU seconds (espeak runs in its own process: wall time for it below)
        w = time.perf_counter()
        made = [make_clean(synth, table, dictionary, conversational, 5, i) for i in range(args.per_engine)]
        per_engine[engine] = (time.perf_counter() - w) / args.per_engine
        CPU_TIMES[f"clean_{engine}"] = round((time.process_time() - t) / args.per_engine, 4)
        pool += made
    shares = {e: ENGINE_SHARES[e] for e in per_engine}
    mean_clean = sum(per_engine[e] * s for e, s in shares.items()) / sum(shares.values())
    result["recipe2_clean_s_per_example"] = {e: round(v, 4) for e, v in per_engine.items()}
    result["recipe2_clean_s_per_example_mix"] = round(mean_clean, 4)
    tmp = Path("/tmp/asr-profile-run")
    if not (tmp / "last.pt").exists():
        init_run(SHIPPED, tmp)
    sp = spm.SentencePieceProcessor(model_file=str(tmp / "tokenizer" / "tokenizer.model"))
    rng = np.random.default_rng(0)
    examples = [
        pool[i % len(pool)] for i in rng.permutation(max(len(pool), args.batch_size))[: args.batch_size]
    ]
    result["recipe2_augment_targets_s_per_batch"] = _time(
        lambda: build_batch(examples, rng, 1.0, sp), args.reps
    )
    _ = PoolStream  # the stream these pieces make (asr/training/pool.py)

    # compute on the shipped model
    from asr.training.streaming_model import build_model, model_config
    from asr.training.targets import PHONE_CLASSES

    info = json.loads(SHIPPED.with_suffix(".json").read_text())
    model = build_model(
        model_config((tmp / "tokenizer").resolve(), d_model=info["d_model"], n_layers=info["layers"])
    )
    model.load_state_dict(torch.load(tmp / "last.pt", weights_only=False)["model"])
    model.train()
    head = torch.nn.Linear(info["d_model"], PHONE_CLASSES)
    opt = torch.optim.AdamW(list(model.parameters()) + list(head.parameters()), lr=1e-5)
    batch = build_batch(examples, rng, 1.0, sp)

    def step(bf16: bool) -> None:
        feats, fl = model.preprocessor(input_signal=batch["audio"], length=batch["lengths"])
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with ctx:
            enc, el = model.encoder(audio_signal=feats, length=fl)
        enc = enc.float()
        lp = model.decoder(encoder_output=enc)
        loss = model.loss(
            log_probs=lp, targets=batch["targets"], input_lengths=el, target_lengths=batch["target_lengths"]
        )
        n = lp.shape[1]
        labels = batch["phones"][:, :n]
        if labels.shape[1] == n and (labels[:, 0] != -100).any():
            loss = loss + 0.3 * torch.nn.functional.cross_entropy(
                head(enc.transpose(1, 2)).transpose(1, 2), labels, ignore_index=-100
            )
        opt.zero_grad()
        loss.backward()
        opt.step()

    step(False)
    result["compute_fp32_s_per_step"] = _time(lambda: step(False), args.reps, "compute_fp32")
    step(True)
    result["compute_bf16_s_per_step"] = _time(lambda: step(True), args.reps, "compute_bf16")
    result["batch_audio_s"] = round(float(batch["lengths"].sum()) / 16000, 1)
    result["cpu_s"] = CPU_TIMES
    result["load_average"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
