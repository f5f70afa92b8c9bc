"""What one device holds (issue 22): the LLMs' batched decode and the flow voice's batched chunks as the
number of sessions grows, and the device's part of the onset when N callers finish their turns at once.

    python -m duplex.bench.gpu_capacity --device cuda --sessions 1,8,32,64 --out gpu-check-out/capacity
    python -m duplex.bench.gpu_capacity --device cpu --sessions 1,2 --tiny --out /tmp/cap   # the dry run

Parts (each one's failure is recorded in the JSON and the others still run):
- **agreement**: each LLM on `--device` in `--dtype` against the CPU in float32 (greedy tokens, first-step
  logits), and batched against one by one on the device, for prompts of different lengths; the flow voice's
  audio on the device against the CPU, and batched against alone.
- **llm**: per N, a batched prefill of N prompts (`--prompt-tokens`, ragged), then `--decode-tokens`
  batched decode steps: ms per step P50/P90, tokens/s over all sessions, KV bytes per session.
- **tts**: per N, the flow voice's first call for N answers at once (G2P and the encoder per session, then
  the first chunk batched) and the calls after it (2 chunks each, 450 ms of audio): ms P50/P90, and the
  real-time factor of a call (its wall time over the audio each session gets from it).
- **onset**: per N, N sessions holding a conversation in their caches end a turn at the same moment:
  both LLMs prefill the user's words, the drafter decodes its first words, the voice makes its first chunk,
  one after another on the one device, as the relay does. That sum, P50/P90 over `--repeats`, is the
  device's part of the onset (ASR's final, the end-of-turn silence and the network come on top).

`--weights auto` uses the profile's LLM weights where they are installed, else randomly initialised models
of the same architectures (`duplex/bench/data/llm_architectures.json`): the same shapes and compute per
token, so the timings hold; their tokens mean nothing, so agreement is then a check of the arithmetic only.
The flow voice always runs its shipped weights; where hibari's G2P is missing, its phonemes come from
`duplex/bench/data/gpu_phonemes.json` (recorded with `--record-phonemes`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from duplex.base.errors import ModelError

DATA = Path(__file__).resolve().parent / "data"
ARCHITECTURES = DATA / "llm_architectures.json"
PHONEMES = DATA / "gpu_phonemes.json"
SLOW_ARCH = "qwen2.5-coder-0.5b-instruct"
DRAFTER_ARCH = "smollm2-135m-instruct-20-layers"
#: the answers the voice speaks in the bench (first phrase = the relay's three drafted words)
ANSWERS = (
    "Sure, the capital of France is Paris, a lovely city on the river Seine.",
    "A spider has eight legs, and most spiders also have eight eyes.",
    "The sky looks blue because air scatters blue light more than red light.",
    "Tonight at seven works well, I have booked a table for two people.",
)
HISTORY_TOKENS = 160  # system prompt + a couple of turns already in every session's cache
TURN_TOKENS = 24  # the user's last words, prefilled at the end of the turn
DRAFT_TOKENS = 5  # ~3 words drafted before the voice starts
DRAFT_WORDS = 3  # the cpu profile's draft_words: the voice's first input


# -- helpers ------------------------------------------------------------------------------------------
def pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if xs else float("nan")


class Clock:
    """Wall time of device work: synchronises CUDA before reading the clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
        self.sync()
        t0 = time.perf_counter()
        out = fn(*args)
        self.sync()
        return time.perf_counter() - t0, out


def guarded(record: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    """Run one part; its result or its error goes into record[name], and the bench goes on."""
    t0 = time.perf_counter()
    try:
        record[name] = fn()
    except Exception as exc:  # a bench part must not lose the others' numbers
        record[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
    print(f"[{name}] {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


# -- the LLMs -----------------------------------------------------------------------------------------
def architecture(name: str, tiny: bool = False) -> dict[str, Any]:
    d = dict(json.loads(ARCHITECTURES.read_text())[name])
    if tiny:  # the dry run: the same code on a model small enough for a test
        d.update(num_hidden_layers=2, hidden_size=64, intermediate_size=128, vocab_size=512)
        d.update(
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, layer_types=["full_attention"] * 2
        )
        d.update(pad_token_id=0, bos_token_id=1, eos_token_id=2, unk_token_id=0)
    return d


def random_lm(name: str, tiny: bool = False, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised float32 CPU model of the named architecture (seeded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = architecture(name, tiny)
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()


def real_lm(profile: str | None, component: str, dtype: str, device: str) -> torch.nn.Module | None:
    """The profile's model as the engine loads it, or None where its weights are not installed."""
    from dialogue import llm_weights
    from duplex.base.config import load_profile

    comp = load_profile(profile).component(component)
    if not llm_weights.status(comp.weights).ok:
        return None
    if component == "drafter":
        from dialogue.drafter_adapter import adapter_path, load_drafter

        opts = comp.options or {}
        model, _ = load_drafter(
            comp.weights, dtype, adapter_path(opts.get("adapter")), progress=False, device=device
        )
        return model
    model, _ = llm_weights.load(comp.weights, dtype, progress=False, device=device, what=component)
    return model


def place(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    import copy

    return copy.deepcopy(model).to(dtype=dtype).to(device).eval()


def prompts(vocab: int, n: int, length: int, seed: int, ragged: bool = True) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lo = min(vocab - 1, 100)
    return [rng.integers(lo, vocab, size=length + (i % 7 if ragged else 0)).tolist() for i in range(n)]


def llm_agreement(cpu_model: torch.nn.Module, dev_model: torch.nn.Module, vocab: int) -> dict[str, Any]:
    from dialogue.kv_cache import CachedLM
    from duplex.bench.gpu_check import greedy_decode, token_agreement

    ids = prompts(vocab, 4, 20, seed=1)
    ref_lm, dev_lm = CachedLM(cpu_model, sink_tokens=0), CachedLM(dev_model, sink_tokens=0)
    with torch.inference_mode():
        ref = greedy_decode(ref_lm, ids, 8, batched=False)
        one = greedy_decode(dev_lm, ids, 8, batched=False)
        bat = greedy_decode(dev_lm, ids, 8, batched=True)
    return {
        "lean_decoder": dev_lm.fast is not None,
        "tokens_device_vs_cpu_float32": token_agreement(one["tokens"], ref["tokens"]),
        "tokens_device_batched_vs_one_by_one": token_agreement(bat["tokens"], one["tokens"]),
        "max_first_logit_diff_device_vs_cpu_float32": float(
            (one["first_logits"] - ref["first_logits"]).abs().max()
        ),
        "max_first_logit_diff_batched_vs_one_by_one": float(
            (bat["first_logits"] - one["first_logits"]).abs().max()
        ),
        "logit_scale": float(ref["first_logits"].abs().max()),
    }


def llm_scaling(
    lms: dict[str, Any],
    vocab: int,
    sessions: Sequence[int],
    prompt_tokens: int,
    decode_tokens: int,
    clock: Clock,
) -> dict[str, list[dict[str, Any]]]:
    """Per N and per variant (label -> CachedLM over one model): a batched prefill, then decode steps. The
    variants take turns step by step, so that each sees the same device state (clocks, allocator, other work)."""
    rows: dict[str, list[dict[str, Any]]] = {label: [] for label in lms}
    with torch.inference_mode():
        # warm-up (kernels, allocator, the GPU's clocks): a prefill and a few decode steps, one and several
        for lm in lms.values():
            for k in (1, 4):
                warm = [lm.new() for _ in range(k)]
                lm.feed_batch(warm, prompts(vocab, k, 32, seed=2))
                for _ in range(8):
                    lm.feed_batch(warm, [[int(torch.argmax(c.logits))] for c in warm])
            warm = []
        for n in sessions:
            caches = {label: [lm.new() for _ in range(n)] for label, lm in lms.items()}
            pre = {}
            for label, lm in lms.items():
                pre[label], _ = clock.time(
                    lm.feed_batch, caches[label], prompts(vocab, n, prompt_tokens, seed=n)
                )
            steps: dict[str, list[float]] = {label: [] for label in lms}
            for _ in range(decode_tokens):
                for label, lm in lms.items():
                    picks = [[int(torch.argmax(c.logits))] for c in caches[label]]
                    dt, _ = clock.time(lm.feed_batch, caches[label], picks)
                    steps[label].append(dt)
            for label, lm in lms.items():
                p50 = pct(steps[label], 50)
                rows[label].append(
                    {
                        "sessions": n,
                        "prefill_ms": round(1000 * pre[label], 2),
                        "step_ms_p50": round(1000 * p50, 2),
                        "step_ms_p90": round(1000 * pct(steps[label], 90), 2),
                        "n_steps": len(steps[label]),
                        "tokens_per_s": round(n / p50, 1),
                        "kv_mb_per_session": round(lm.nbytes(caches[label][0]) / 1e6, 2),
                        **device_memory(clock),
                    }
                )
                print(f"  llm {label} n={n}: step {rows[label][-1]['step_ms_p50']} ms", file=sys.stderr)
            caches = {}
            release(clock)
    return rows


def device_memory(clock: Clock) -> dict[str, float]:
    """Peak device memory since the last `release`, and the GPU's SM clock now (where NVML answers): a
    launch-bound step runs several times slower at the idle clock, and the H200 runs here read 50-60 ms
    for a one-session step in some contexts and 13 ms in others (docs/operations.md, "On a GPU")."""
    if not clock.cuda:
        return {}
    out = {"cuda_max_allocated_mb": round(torch.cuda.max_memory_allocated() / 1e6, 1)}
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        out["sm_clock_mhz"] = float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM))
    except Exception:  # no NVML here: the clock is simply not reported
        pass
    return out


def release(clock: Clock) -> None:
    if clock.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


LLM_VARIANTS = ("pool", "per_session", "padded")


def cached_lm(model: torch.nn.Module, variant: str, slots: int) -> Any:
    """A CachedLM over `model` running batched steps the `variant` way (see --llm-variants)."""
    from dialogue.kv_cache import CachedLM

    lm = CachedLM(model, sink_tokens=4, window_tokens=1536, kv_pool_slots=slots if variant == "pool" else 0)
    if variant == "padded":
        lm.decode_attention = "padded"
    return lm


# -- the flow voice -----------------------------------------------------------------------------------
class TableFrontEnd:
    """Replays hibari's G2P from a recorded table (text -> sentences of ids), for machines without hibari."""

    def __init__(self, table: dict[str, list[list[int]]], space_id: int) -> None:
        self.table, self.space_id = table, space_id

    @classmethod
    def load(cls, path: Path) -> TableFrontEnd:
        d = json.loads(path.read_text())
        return cls(d["table"], int(d["space_id"]))

    def sentences(self, text: str) -> list[list[int]]:
        if text not in self.table:
            raise ModelError(
                f"no recorded phonemes for {text!r} in the table: re-record it where hibari is installed "
                "(python -m duplex.bench.gpu_capacity --record-phonemes)"
            )
        return [list(s) for s in self.table[text]]


class RecordingFrontEnd:
    """Wraps a front end and keeps every answer it gave."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.space_id, self.table = inner, inner.space_id, {}

    def sentences(self, text: str) -> list[list[int]]:
        out = self.inner.sentences(text)
        self.table[text] = out
        return out


def front_end(kind: str = "auto") -> Any:
    if kind == "table":
        return TableFrontEnd.load(PHONEMES)
    try:
        from tts.flow_tts import HibariFrontEnd

        return HibariFrontEnd()
    except ModelError:
        return TableFrontEnd.load(PHONEMES)


def flow_stage(device: torch.device, front: Any, where: str = "cpu") -> Any:
    """The shipped flow voice as the cpu-flow profile configures it, on `device`, its front half run as
    `--tts-front` names it: cpu (batched over sessions), device, or cpu-serial (phrase by phrase)."""
    from codec.speech_codec import load_codec
    from duplex.base.config import load_profile
    from tts.flow_tts import FlowTtsStage, _flow_files, load_flow_model

    cfg = load_profile("cpu-flow").component("tts")
    path, codec_path, _ = _flow_files(cfg)
    model, meta = load_flow_model(path)
    o = cfg.options
    stage = FlowTtsStage(
        model,
        load_codec(str(codec_path)),
        front,
        steps=int(o.get("steps", 2)),
        chunk=int(o.get("chunk_frames", model.cfg.chunk)),
        chunks_per_call=int(o.get("chunks_per_call", 2)),
        first_phrase_words=int(o.get("first_phrase_words", 3)),
        max_phrase_words=int(o.get("max_phrase_words", 12)),
        device=device,
        front_on_cpu=where != "device",
        front_batch=where != "cpu-serial",
    )
    stage.meta = meta
    return stage


def split_answer(text: str) -> tuple[str, str]:
    """The drafted first words (what the voice gets first, as the relay sends them) and the rest."""
    words = text.split()
    return " ".join(words[:DRAFT_WORDS]) + " ", " ".join(words[DRAFT_WORDS:])


def speak(stage: Any, texts: Sequence[str], clock: Clock) -> tuple[list[float], list[float], list[list[Any]]]:
    """N answers at once, call by call as the core makes them: the drafted words first, then the rest of the
    answer, then empty calls while the stage owes audio. Returns (first call s, later calls s, chunks)."""
    from duplex.base.messages import TtsInput

    states = [stage.init_state() for _ in texts]
    chunks: list[list[Any]] = [[] for _ in texts]
    parts = [split_answer(t) for t in texts]
    first, out = clock.time(
        stage.step_batch, [(s, TtsInput(p[0])) for s, p in zip(states, parts, strict=True)]
    )
    rest = [p[1] for p in parts]
    later = []
    while True:
        for i, (c, s) in enumerate(out):
            chunks[i] += c
            states[i] = s
        owed = [i for i, s in enumerate(states) if rest[i] is not None or stage.pending(s)]
        if not owed:
            break
        items = [(states[i], TtsInput(rest[i] or "", final=True)) for i in owed]
        for i in owed:
            rest[i] = None
        dt, res = clock.time(stage.step_batch, items)
        later.append(dt)
        out = [([], s) for s in states]
        for i, r in zip(owed, res, strict=True):
            out[i] = r
    return [first], later, chunks


def tts_agreement(cpu_stage: Any, dev_stage: Any, clock: Clock) -> dict[str, Any]:
    _, _, ref = speak(cpu_stage, ANSWERS[:2], Clock(torch.device("cpu")))
    _, _, dev = speak(dev_stage, ANSWERS[:2], clock)
    _, _, alone = speak(dev_stage, ANSWERS[:1], clock)

    def audio(chunks: list[Any]) -> np.ndarray:
        return np.concatenate([c.audio for c in chunks])

    a_ref, a_dev, a_alone = audio(ref[0]), audio(dev[0]), audio(alone[0])
    n = min(len(a_ref), len(a_dev))
    return {
        "samples_cpu": len(a_ref),
        "samples_device": len(a_dev),
        "max_abs_diff_device_vs_cpu": float(np.abs(a_ref[:n] - a_dev[:n]).max()),
        "rms_cpu": float(np.sqrt(np.mean(a_ref**2))),
        "max_abs_diff_batched_vs_alone": float(np.abs(a_dev[: len(a_alone)] - a_alone[: len(a_dev)]).max()),
        "words_equal": [" ".join(c.text for c in x) for x in ref]
        == [" ".join(c.text for c in x) for x in dev],
    }


def tts_scaling(stage: Any, sessions: Sequence[int], clock: Clock) -> list[dict[str, Any]]:
    from tts.flow_tts import SAMPLE_RATE

    for k in (1, 4):  # warm-up
        speak(stage, ANSWERS[:k], clock)
    rows = []
    for n in sessions:
        texts = [ANSWERS[i % len(ANSWERS)] for i in range(n)]
        first, later, chunks = speak(stage, texts, clock)
        audio_s = sum(len(c.audio) for c in chunks[0]) / SAMPLE_RATE
        per_call = audio_s / max(1, 1 + len(later))  # audio one session gets from one call
        rows.append(
            {
                "sessions": n,
                "first_call_ms": round(1000 * first[0], 2),
                "later_call_ms_p50": round(1000 * pct(later, 50), 2),
                "later_call_ms_p90": round(1000 * pct(later, 90), 2),
                "n_later_calls": len(later),
                "rtf_p90": round(pct(later, 90) / per_call, 4) if later else None,
                **device_memory(clock),
            }
        )
        print(
            f"  tts n={n}: first {rows[-1]['first_call_ms']} ms, later p90 {rows[-1]['later_call_ms_p90']} ms",
            file=sys.stderr,
        )
        release(clock)
    return rows


# -- the onset ----------------------------------------------------------------------------------------
def onset(
    variants: dict[str, tuple[Any, Any]],
    vocab: tuple[int, int],
    stage: Any,
    sessions: Sequence[int],
    repeats: int,
    clock: Clock,
) -> dict[str, list[dict[str, Any]]]:
    """Per N: N sessions with HISTORY_TOKENS in both caches end a turn at once (see the module doc); per
    variant (label -> (slow, drafter) CachedLMs), the variants taking turns round by round."""
    rows: dict[str, list[dict[str, Any]]] = {label: [] for label in variants}
    with torch.inference_mode():
        for n in sessions:
            state = {}
            for label, (slow, drafter) in variants.items():
                sc = [slow.new() for _ in range(n)]
                dc = [drafter.new() for _ in range(n)]
                slow.feed_batch(sc, prompts(vocab[0], n, HISTORY_TOKENS, seed=3))
                drafter.feed_batch(dc, prompts(vocab[1], n, HISTORY_TOKENS, seed=4))
                state[label] = (sc, dc, [len(c.ids) for c in sc], [len(c.ids) for c in dc])
            totals: dict[str, list[float]] = {label: [] for label in variants}
            parts: dict[str, list[tuple[float, ...]]] = {label: [] for label in variants}
            for r in range(repeats + 1):  # the first round warms up this N's shapes and is not counted
                texts = [ANSWERS[(i + r) % len(ANSWERS)] for i in range(n)]
                turn_d = prompts(vocab[1], n, TURN_TOKENS, 10 + r, False)
                turn_s = prompts(vocab[0], n, TURN_TOKENS, 20 + r, False)
                for label, (slow, drafter) in variants.items():
                    sc, dc, base_s, base_d = state[label]
                    t_dp, _ = clock.time(drafter.feed_batch, dc, turn_d)
                    t_sp, _ = clock.time(slow.feed_batch, sc, turn_s)
                    t_draft = 0.0
                    for _ in range(DRAFT_TOKENS):
                        picks = [[int(torch.argmax(c.logits))] for c in dc]
                        dt, _ = clock.time(drafter.feed_batch, dc, picks)
                        t_draft += dt
                    first = speak_first(stage, texts, clock)
                    if r:
                        totals[label].append(t_dp + t_sp + t_draft + first)
                        parts[label].append((t_dp, t_sp, t_draft, first))
                    for c, k in zip(sc, base_s, strict=True):
                        slow.rollback(c, k)
                    for c, k in zip(dc, base_d, strict=True):
                        drafter.rollback(c, k)
            for label in variants:
                med = np.median(np.asarray(parts[label]), 0) * 1000
                rows[label].append(
                    {
                        "sessions": n,
                        "onset_ms_p50": round(1000 * pct(totals[label], 50), 1),
                        "onset_ms_p90": round(1000 * pct(totals[label], 90), 1),
                        "repeats": repeats,
                        "median_ms": {
                            "drafter_prefill": round(float(med[0]), 1),
                            "slow_prefill": round(float(med[1]), 1),
                            "draft_tokens": round(float(med[2]), 1),
                            "tts_first_chunk": round(float(med[3]), 1),
                        },
                        **device_memory(clock),
                    }
                )
                r_ = rows[label][-1]
                print(
                    f"  onset {label} n={n}: p50 {r_['onset_ms_p50']} p90 {r_['onset_ms_p90']} ms",
                    file=sys.stderr,
                )
            # free the caches before the next N: the loops' own names hold the last variant's too, and a
            # pool's slots come back only when every reference is gone (else the next N's sessions spill
            # out of the pool into plain caches and the whole batch runs the slow way)
            sc = dc = []
            state = {}
            release(clock)
    return rows


def speak_first(stage: Any, texts: Sequence[str], clock: Clock) -> float:
    """Seconds of the voice's first call for N answers at once (their drafted words)."""
    from duplex.base.messages import TtsInput

    items = [(stage.init_state(), TtsInput(split_answer(t)[0])) for t in texts]
    dt, _ = clock.time(stage.step_batch, items)
    return dt


# -- the plot -----------------------------------------------------------------------------------------
def plot(record: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, rows in record.get("llm", {}).items():
        if isinstance(rows, list) and rows:
            ax[0].plot(
                [r["sessions"] for r in rows],
                [r["step_ms_p50"] for r in rows],
                "o-",
                label=f"{name} decode step",
            )
            ax[0].plot(
                [r["sessions"] for r in rows], [r["prefill_ms"] for r in rows], "s--", label=f"{name} prefill"
            )
    for key, rows in record.items():
        if key.startswith("tts") and isinstance(rows, list) and rows and isinstance(rows[0], dict):
            tag = key[3:] or "[front=cpu]"
            ns = [r["sessions"] for r in rows]
            ax[1].plot(ns, [r["first_call_ms"] for r in rows], "o-", label=f"first call {tag}")
            ax[1].plot(ns, [r["later_call_ms_p90"] for r in rows], "s--", label=f"later call P90 {tag}")
    ax[1].axhline(450, color="gray", lw=0.8, ls=":", label="450 ms of audio per later call")
    for key, rows in record.items():
        if key.startswith("onset") and isinstance(rows, list) and rows:
            ns = [r["sessions"] for r in rows]
            tag = key[5:] or f"[{record['llm_variants'][0]}]"
            ax[2].plot(ns, [r["onset_ms_p50"] for r in rows], "o-", label=f"P50 {tag}")
            ax[2].plot(ns, [r["onset_ms_p90"] for r in rows], "s--", label=f"P90 {tag}")
    ax[2].axhline(300, color="red", lw=0.8, ls=":", label="300 ms target (whole onset)")
    titles = (
        "LLM batched steps",
        "flow voice batched calls",
        "device part of the onset, N turns end at once",
    )
    for a, t in zip(ax, titles, strict=True):
        a.set_xscale("log", base=2)
        a.set_xlabel("sessions")
        a.set_ylabel("ms")
        a.set_title(t, fontsize=10)
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(
        f"{record['device_name']} ({record['dtype']}, LLM weights: {record['llm_weights']})", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main ---------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    from duplex.base.devices import check_device, require_device

    check_device(args.device, args.dtype, "gpu_capacity")
    device = require_device(args.device, "gpu_capacity")
    dtype = getattr(torch, args.dtype)
    clock = Clock(device)
    record: dict[str, Any] = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "torch": torch.__version__,
        "sessions": list(args.sessions),
    }
    lms: dict[str, dict[str, Any]] = {}
    slots = max(args.sessions) + 8  # a slot for every session of the largest N, and the warm-ups'
    vocab: dict[str, int] = {}
    kinds = []
    for name, comp, arch in (("slow", "llm", SLOW_ARCH), ("drafter", "drafter", DRAFTER_ARCH)):
        model = None
        if args.weights in ("auto", "real") and not args.tiny:
            try:
                model = real_lm(args.profile, comp, args.dtype, args.device)
            except Exception as exc:
                if args.weights == "real":
                    raise
                print(f"{name}: profile weights unusable here ({exc}); random weights", file=sys.stderr)
        if args.weights == "real" and model is None:
            raise ModelError(f"{name}: the profile's weights are not installed (use --weights random)")
        if model is not None:
            kinds.append(f"{name}=profile")
            cpu_model = None
        else:
            kinds.append(f"{name}=random")
            cpu_model = random_lm(arch, args.tiny)
            model = place(cpu_model, device, dtype)
        vocab[name] = int(model.config.vocab_size)
        if cpu_model is not None and "agreement" in args.parts:
            guarded(
                record.setdefault("agreement", {}),
                name,
                lambda c=cpu_model, m=model, v=vocab[name]: llm_agreement(c, m, v),
            )
        del cpu_model
        lms[name] = {v: cached_lm(model, v, slots) for v in args.llm_variants}
    record["llm_weights"] = ", ".join(kinds)
    record["llm_variants"] = args.llm_variants

    def label(name: str, variant: str) -> str:  # the first variant is the plain name (the one to read)
        return name if variant == args.llm_variants[0] else f"{name}[{variant}]"

    if "llm" in args.parts:
        llm: dict[str, Any] = {}
        for name in lms:
            part: dict[str, Any] = {}
            guarded(
                part,
                name,
                lambda name=name: llm_scaling(
                    lms[name], vocab[name], args.sessions, args.prompt_tokens, args.decode_tokens, clock
                ),
            )
            got = part[name]
            if "error" in got:
                llm[name] = got
            else:
                llm.update({label(name, v): rows for v, rows in got.items()})
        record["llm"] = llm
    stage = None
    try:
        front = front_end(args.front_end)
        stage = flow_stage(device, front, args.tts_front[0])
        record["tts_weights"] = {
            "step": stage.meta.get("step") if stage.meta else None,
            "front_end": type(front).__name__,
        }
    except Exception as exc:
        record["tts"] = {"error": f"{type(exc).__name__}: {exc}"}
    if stage is not None:
        if "agreement" in args.parts:
            guarded(
                record.setdefault("agreement", {}),
                "tts",
                lambda: tts_agreement(flow_stage(torch.device("cpu"), front), stage, clock),
            )
        if "tts" in args.parts:
            record["tts_front"] = args.tts_front
            guarded(record, "tts", lambda: tts_scaling(stage, args.sessions, clock))
            for where in args.tts_front[1:]:  # the same voice with its front half elsewhere: an A/B
                other = flow_stage(device, front, where)
                guarded(record, f"tts[front={where}]", lambda o=other: tts_scaling(o, args.sessions, clock))
        if "onset" in args.parts:
            pairs = {v: (lms["slow"][v], lms["drafter"][v]) for v in args.llm_variants}
            part: dict[str, Any] = {}
            guarded(
                part,
                "onset",
                lambda: onset(
                    pairs, (vocab["slow"], vocab["drafter"]), stage, args.sessions, args.repeats, clock
                ),
            )
            got = part["onset"]
            if "error" in got:
                record["onset"] = got
            else:
                record.update({label("onset", v): rows for v, rows in got.items()})
    return record


def record_phonemes(path: Path) -> None:
    """Run the bench's answers through the voice on the CPU with hibari's G2P and keep what it was asked."""
    from tts.flow_tts import HibariFrontEnd

    rec = RecordingFrontEnd(HibariFrontEnd())
    stage = flow_stage(torch.device("cpu"), rec)
    speak(stage, ANSWERS, Clock(torch.device("cpu")))
    path.write_text(json.dumps({"space_id": rec.space_id, "table": rec.table}, ensure_ascii=False) + "\n")
    print(f"wrote {len(rec.table)} phrases to {path}")


def parse_sessions(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sessions takes numbers like 1,8,32,64, got {text!r}") from None
    if not out or any(n < 1 for n in out):
        raise argparse.ArgumentTypeError(f"--sessions takes positive numbers, got {text!r}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--profile", default="gpu", help="whose LLM weights --weights auto/real loads")
    ap.add_argument("--weights", default="auto", choices=["auto", "real", "random"])
    ap.add_argument("--sessions", type=parse_sessions, default=[1, 8, 32, 64])
    ap.add_argument(
        "--parts",
        nargs="+",
        default=["agreement", "llm", "tts", "onset"],
        choices=["agreement", "llm", "tts", "onset"],
    )
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--decode-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument(
        "--front-end",
        default="auto",
        choices=["auto", "table"],
        help="auto: hibari's G2P where installed, else the recorded table; table: always the table",
    )
    ap.add_argument(
        "--llm-variants",
        nargs="+",
        default=["pool"],
        choices=list(LLM_VARIANTS),
        help="how batched steps run: pool (one KvPool, one attention per layer), per_session (DynamicCaches, "
        "attention per session), padded (DynamicCaches padded per layer); several: an A/B (first: onset)",
    )
    ap.add_argument(
        "--tts-front",
        nargs="+",
        default=["cpu"],
        choices=["cpu", "device", "cpu-serial"],
        help="where the voice's front half runs: cpu (batched over sessions), device, cpu-serial (session by "
        "session, as before); several: an A/B in the tts part (first one: onset)",
    )
    ap.add_argument("--tiny", action="store_true", help="tiny random LLMs: the dry run of the same code")
    ap.add_argument("--out", type=Path, default=Path("gpu-check-out/capacity"))
    ap.add_argument(
        "--record-phonemes",
        type=Path,
        nargs="?",
        const=PHONEMES,
        default=None,
        help=f"write the G2P table the bench replays without hibari (default {PHONEMES}) and exit",
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.record_phonemes is not None:
        record_phonemes(args.record_phonemes)
        return 0
    if min(args.prompt_tokens, args.decode_tokens, args.repeats) < 1:
        ap.error("--prompt-tokens, --decode-tokens and --repeats must be >= 1")
    t0 = time.perf_counter()
    record = run(args)
    record["seconds"] = round(time.perf_counter() - t0, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "capacity.json").write_text(json.dumps(record, indent=2) + "\n")
    try:
        plot(record, args.out / "capacity.png")
    except Exception as exc:  # the numbers matter more than the picture
        print(f"plot failed: {exc}", file=sys.stderr)
    short = {k: v for k, v in record.items() if k not in ("agreement",)}
    print(json.dumps(short, indent=1)[:6000])
    print(json.dumps(record.get("agreement", {}), indent=1)[:3000])
    errors = [k for k, v in record.items() if isinstance(v, dict) and "error" in v]
    errors += [
        f"agreement.{k}"
        for k, v in record.get("agreement", {}).items()
        if isinstance(v, dict) and "error" in v
    ]
    errors += [f"llm.{k}" for k, v in record.get("llm", {}).items() if isinstance(v, dict) and "error" in v]
    if errors:
        print(f"parts that failed: {', '.join(errors)} (see {args.out / 'capacity.json'})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
