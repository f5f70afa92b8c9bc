"""`duplex bench --asr`: the streaming ASR's per-chunk compute, real-time factor and concurrent streams.

For each lookahead of the model and each session count (default 1, 4, 16), that many sessions stream
synthesised speech (held-out voices) one chunk at a time, started at staggered chunks so first chunks,
full chunks and final chunks mix as in a live server, and every chunk period all sessions are stepped as
one batch (`step_batch`, what the device executor does). Reported per (lookahead, sessions): the batch
step time P50/P90 with the sample size, compute per stream-chunk, the real-time factor
(compute / audio), and whether the sessions are served in real time (P90 step <= chunk duration, or
<= `--budget-ms` when given, e.g. 30 on a GPU). Results: asr-bench.json and asr-bench.png.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from duplex.base.audio import SAMPLE_RATE as SR


def _speech(seconds: float, seed: int) -> np.ndarray:
    from duplex.eval.asr import synthetic_set

    parts, total = [], 0
    for u in synthetic_set(40, augmented=False, seed=seed):
        parts.append(u.audio)
        total += u.audio.size
        if total >= seconds * SR:
            break
    return np.concatenate(parts)


def bench(stage: Any, sessions: int, audio: np.ndarray, stagger: int = 3) -> dict[str, Any]:
    from duplex.base.messages import AsrChunk

    torch = stage.m.torch
    chunk = int(round(stage.m.chunk_ms / 1000 * SR))
    n_chunks = audio.size // chunk
    states = [stage.init_state() for _ in range(sessions)]
    offsets = [(i * stagger) % max(n_chunks // 2, 1) for i in range(sessions)]
    steps, per_stream, rounds = [], [], n_chunks + max(offsets) + 1
    audio_s = 0.0
    for r in range(rounds):
        items, idx = [], []
        for s in range(sessions):
            k = r - offsets[s]
            if k < 0 or k > n_chunks:
                continue
            final = k == n_chunks
            samples = audio[k * chunk : (k + 1) * chunk] if not final else np.zeros(0, np.float32)
            audio_s += samples.size / SR
            items.append((states[s], AsrChunk(samples, transcribe=True, final=final)))
            idx.append(s)
        if not items:
            continue
        t = time.perf_counter()
        outs = stage.step_batch(items)
        if stage.m.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        for s, (_, st) in zip(idx, outs, strict=False):
            states[s] = st
        steps.append(dt)
        per_stream.append(dt / len(items))
    chunk_s = stage.m.chunk_ms / 1000
    return {
        "sessions": sessions,
        "n_steps": len(steps),
        "step_ms_p50": round(1000 * float(np.percentile(steps, 50)), 2),
        "step_ms_p90": round(1000 * float(np.percentile(steps, 90)), 2),
        "per_stream_chunk_ms_p50": round(1000 * float(np.percentile(per_stream, 50)), 2),
        "rtf": round(sum(steps) / max(audio_s, 1e-9), 4),
        "chunk_ms": stage.m.chunk_ms,
        "real_time": bool(np.percentile(steps, 90) <= chunk_s),
    }


def run(args: Any) -> int:
    import torch

    from asr.nemo_streaming import SHIPPED, NemoStreamingAsrStage, NemoStreamingModel, load_nemo_model
    from duplex.base.messages import AsrChunk

    threads = int(getattr(args, "threads", 0) or 0)
    if threads:
        torch.set_num_threads(threads)
    device = "cuda" if torch.cuda.is_available() and not getattr(args, "cpu", False) else "cpu"
    source = Path(args.model) if getattr(args, "model", None) else SHIPPED
    model = load_nemo_model(source)
    enc = model.encoder
    contexts = [list(c) for c in getattr(enc, "att_context_size_all", [enc.att_context_size])]
    counts = [int(x) for x in str(args.sessions or "1,4,16").split(",")]
    audio = _speech(float(args.seconds), seed=5)
    budget = float(args.budget_ms) if args.budget_ms else None
    rows = []
    for ctx in contexts:
        stage = NemoStreamingAsrStage(NemoStreamingModel(model, att_context_size=ctx, device=device))
        stage.step(stage.init_state(), AsrChunk(audio[:SR], final=True))  # warm-up
        for n in counts:
            row = bench(stage, n, audio)
            row.update(lookahead_ms=stage.m.lookahead_ms, att_context_size=ctx)
            if budget is not None:
                row["within_budget"] = row["step_ms_p90"] <= budget
            rows.append(row)
            print(
                f"lookahead {stage.m.lookahead_ms:5.0f} ms chunk {stage.m.chunk_ms:5.0f} ms  sessions {n:3d}: "
                f"step P50/P90 {row['step_ms_p50']:.1f}/{row['step_ms_p90']:.1f} ms (n={row['n_steps']}), "
                f"{row['per_stream_chunk_ms_p50']:.2f} ms per stream-chunk, RTF {row['rtf']:.3f}, "
                f"real time: {'yes' if row['real_time'] else 'NO'}"
                + (f", within {budget:g} ms: {'yes' if row['within_budget'] else 'NO'}" if budget else ""),
                flush=True,
            )
    result = {
        "model": str(source),
        "device": device,
        "threads": torch.get_num_threads(),
        "params": sum(p.numel() for p in model.parameters()),
        "audio_seconds_per_session": audio.size / SR,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "asr-bench.json").write_text(json.dumps(result, indent=1) + "\n")
    _plot(rows, out / "asr-bench.png")
    print(f"wrote {out / 'asr-bench.json'} and {out / 'asr-bench.png'}")
    return 0


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for la in sorted({r["lookahead_ms"] for r in rows}):
        rs = [r for r in rows if r["lookahead_ms"] == la]
        line = ax.plot(
            [r["sessions"] for r in rs],
            [r["step_ms_p90"] for r in rs],
            marker="o",
            label=f"lookahead {la:g} ms",
        )[0]
        ax.axhline(rs[0]["chunk_ms"], color=line.get_color(), linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent sessions (one batched step per chunk)")
    ax.set_ylabel("batch step P90 (ms); dotted: chunk duration")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
