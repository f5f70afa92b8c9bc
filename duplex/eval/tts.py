"""`duplex eval tts`: the project's own voice against the packaged one, on held-out sentences.

Per sentence of the held-out text file (never trained on): hibari's audio, the same audio through the FSQ
speech codec (encode -> decode: the ceiling any codec-latent voice can reach), and the profile's flow voice
through the service's own TTS stage (phrases cut as in a conversation) at each requested number of Euler
steps, beside hibari's own stage with the same phrase cuts (`hibari_live`: what the issue's "within 2 points
of hibari measured the same way" compares against). Moonshine transcribes all of them in the same run; the WERs, their gaps to hibari, the codec's bitrate
and code usage, and the stage's compute (first chunk P50/P90, steady RTF, chunk 2 vs chunk 50, one thread)
go to tts.json and tts.png, with the issue's targets beside them.

    duplex eval tts [-n 200] [--steps 2 4 8] [--profile cpu-flow] [--out docs/results/eval-tts]
    duplex eval tts --flow CANDIDATE --parts flow --baseline docs/results/eval-tts/tts-pair3-flow.json

`--baseline` compares the run with an earlier one on the same sentences (`duplex.eval.paired`): a candidate ships
only if the interval of its difference lies below zero, not because its WER reads a few words lower.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

#: issue 19's bars
TARGETS = {
    "wer_flow": 0.05,  # own voice WER
    "gap_flow": 0.02,  # ... within 2 points of hibari's
    "gap_codec": 0.01,  # codec round trip within 1 point of hibari's
    "first_chunk_p50_ms": 60.0,
    "first_chunk_p90_ms": 100.0,
    "rtf": 0.25,
    "chunk_ratio": 0.2,  # chunk 50 within +-20 % of chunk 2
    "bitrate_bps": 1000.0,
    "codes_used": 0.9,
    "long_answer_growth_mb": 5.0,  # "memory per session flat over a 5-minute answer"
}


#: what `--parts` can choose: hibari's audio, its codec round trip, hibari's stage, the flow voice
PARTS = ("hibari", "codec", "hibari_live", "flow")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--profile", default="cpu-flow", help="a profile whose tts backend is flow")
    ap.add_argument("-n", type=int, default=200, help="held-out sentences")
    ap.add_argument("--steps", type=int, nargs="+", default=None, help="Euler steps (default: the profile's)")
    ap.add_argument("--timing-repeats", type=int, default=20, help="first-chunk timings per step count")
    ap.add_argument("--long-minutes", type=float, default=5.0, help="a long answer's memory check (0: skip)")
    ap.add_argument("--flow", default=None, help="flow weights folder instead of the profile's (a candidate)")
    ap.add_argument("--codec", default=None, help="codec file instead of the one the flow weights name")
    ap.add_argument(
        "--parts",
        nargs="+",
        choices=PARTS,
        default=list(PARTS),
        help="what to transcribe (a quick A/B of candidates: codec flow)",
    )
    ap.add_argument("--out", default="eval-out", help="folder for tts.json and tts.png")
    ap.add_argument(
        "--baseline",
        default=None,
        help="an earlier run's tts.json: each WER part both runs have is compared sentence by sentence "
        "(a paired bootstrap: the difference and its 95 %% interval)",
    )
    ap.add_argument("--no-progress", action="store_true")


def speak(stage: Any, text: str) -> np.ndarray:
    """The stage as the service drives it: the whole answer as one final delta, phrases cut by its segmenter."""
    from duplex.base.messages import TtsInput
    from tts.loading import step_all

    out, _ = step_all(stage, stage.init_state(), TtsInput(text, True))
    audio = [c.audio for c in out if c.audio.size]
    return np.concatenate(audio) if audio else np.zeros(0, np.float32)


def timings(stage: Any, steps: int, repeats: int) -> dict[str, float]:
    from tts.training.bench_flow import LONG, PHRASES, chunk_costs, first_chunk_seconds

    stage.steps = steps
    first = [first_chunk_seconds(stage, p) for _ in range(max(1, repeats // len(PHRASES))) for p in PHRASES]
    t0 = time.perf_counter()
    secs = len(speak(stage, LONG)) / stage.sample_rate
    rtf = (time.perf_counter() - t0) / max(secs, 1e-9)
    costs = chunk_costs(stage, repeats=3)
    return {
        "first_chunk_p50_ms": 1e3 * float(np.percentile(first, 50)),
        "first_chunk_p90_ms": 1e3 * float(np.percentile(first, 90)),
        "first_chunk_n": len(first),
        "rtf": rtf,
        **costs,
        "chunk_ratio": abs(costs["chunk50_ms"] / costs["chunk2_ms"] - 1.0),
    }


def long_answer_memory(stage: Any, minutes: float = 5.0) -> dict[str, Any]:
    """One response of `minutes` of speech, streamed word by word and collected chunk by chunk as the
    session core does: RSS (after giving freed heap back) each minute of audio, and the state's size."""
    import gc

    from duplex.base.messages import TtsInput
    from duplex.runtime.heap import malloc_trim, rss_mb
    from tts.loading import step_all
    from tts.training.bench_flow import LONG

    state, audio_s, marks, t0 = stage.init_state(), 0.0, [], time.perf_counter()
    words = (LONG + " ") * 200
    next_mark = 0.0
    for word in words.split():
        out, state = step_all(stage, state, TtsInput(word + " ", False))
        audio_s += sum(len(c.audio) for c in out) / stage.sample_rate
        if audio_s >= next_mark:
            gc.collect()
            marks.append({"audio_min": round(audio_s / 60, 2), "rss_mb": malloc_trim() or rss_mb()})
            next_mark += 60.0
        if audio_s >= minutes * 60:
            break
    step_all(stage, state, TtsInput("", True))
    rss = [m["rss_mb"] for m in marks]
    return {
        "audio_s": audio_s,
        "compute_s": time.perf_counter() - t0,
        "rss_by_minute": marks,
        "rss_growth_mb": rss[-1] - rss[1] if len(rss) > 2 else 0.0,  # from the first minute on (warm)
    }


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from tqdm.auto import tqdm

    from asr.training.data import heldout_sentences
    from codec.tool import report as code_report
    from codec.training.eval_codec import MoonshineScorer, corpus_wer
    from codec.training.hibari_teacher import HibariTeacher
    from duplex.base.config import ComponentConfig, load_profile
    from tts.loading import load_tts

    torch.set_num_threads(1)
    profile = load_profile(args.profile)
    cfg = profile.component("tts")
    if cfg.backend != "flow":
        raise SystemExit(
            f"eval tts: profile {profile.name!r} speaks with {cfg.backend!r}, not the flow voice"
        )
    overrides = {"path": args.flow, "codec": args.codec}
    weights = cfg.weights | {k: str(Path(v).resolve()) for k, v in overrides.items() if v}
    cfg = dataclasses.replace(cfg, weights=weights)
    stage = load_tts(cfg)
    parts = set(args.parts)
    # hibari as the service speaks it: the same phrase cuts, each phrase a separate utterance
    phrase_opts = {k: cfg.options[k] for k in ("first_phrase_words", "max_phrase_words") if k in cfg.options}
    hibari = load_tts(ComponentConfig("tts", "hibari", {"package": "hibari"}, phrase_opts))
    steps = list(args.steps or [stage.steps])
    sentences = heldout_sentences()[: args.n]
    teacher, scorer = HibariTeacher(threads=1), MoonshineScorer()
    hyp: dict[str, list[str]] = {k: [] for k in ("hibari", "codec", "hibari_live") if k in parts}
    hyp |= {f"flow_{s}": [] for s in steps if "flow" in parts}
    codes_all = []
    try:
        for i, text in enumerate(tqdm(sentences, desc="tts eval", disable=args.no_progress)):
            audio = np.concatenate([o.audio for o in teacher.text(text, audio_seed=1000 + i)])
            if "hibari" in hyp:
                hyp["hibari"].append(scorer.transcribe(audio))
            with torch.no_grad():
                codes = stage.codec.encode(torch.from_numpy(audio)[None])
                codes_all.append(codes[0].numpy())
                if "codec" in hyp:
                    hyp["codec"].append(
                        scorer.transcribe(
                            stage.codec.decode(codes)[0, stage.codec.cfg.output_delay :].numpy()
                        )
                    )
            if "hibari_live" in hyp:
                hyp["hibari_live"].append(scorer.transcribe(speak(hibari, text)))
            for s in steps if "flow" in parts else []:
                stage.steps = s
                hyp[f"flow_{s}"].append(scorer.transcribe(speak(stage, text)))
    finally:
        scorer.close()
    wer = {k: corpus_wer(sentences, v) for k, v in hyp.items()}
    codes = np.concatenate(codes_all)
    rep = code_report(stage.codec, codes, int(len(codes) * stage.codec.cfg.samples_per_code))
    memory = long_answer_memory(stage, args.long_minutes) if args.long_minutes > 0 else None
    timing = {
        str(s): timings(stage, s, args.timing_repeats)
        for s in tqdm(steps if args.timing_repeats > 0 else [], desc="timing", disable=args.no_progress)
    }
    base = {
        k: "hibari_live" if k.startswith("flow_") else "hibari" for k in wer if not k.startswith("hibari")
    }
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "profile": profile.name,
        "n": len(sentences),
        "flow_step": stage.meta.get("step"),
        "weights": {"flow": str(args.flow or "profile"), "codec": str(args.codec or "the flow's")},
        # which Moonshine scored (codec/training/eval_codec.py: moonshine-cpp, or onnxruntime where it cannot run)
        "scorer": {"backend": scorer.backend, "fallback_reason": scorer.fallback_reason},
        "wer": wer,
        # the codec against hibari's whole sentences (its input); the live voices against hibari live
        "gap_to_hibari": {k: wer[k] - wer[b] for k, b in base.items() if b in wer},
        "bitrate_bps": rep.nominal_bps,
        "entropy_bps": rep.entropy_bps,
        "codes_used_per_group": rep.used_share,
        "timing_one_thread": timing,
        "long_answer": memory,
        "targets": TARGETS,
        "examples": [{"text": t, **{k: v[i] for k, v in hyp.items()}} for i, t in enumerate(sentences[:5])],
        # every sentence's transcripts, so two runs can be compared sentence by sentence
        "transcripts": [{"text": t, **{k: v[i] for k, v in hyp.items()}} for i, t in enumerate(sentences)],
    }


def verdicts(res: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(what, measured, met) per target, for the report."""
    t, out, gaps = res["targets"], [], res["gap_to_hibari"]
    if "codec" in gaps:
        out.append(
            ("codec WER gap to hibari", f"{100 * gaps['codec']:+.1f} pt", gaps["codec"] <= t["gap_codec"])
        )
    for k, w in res["wer"].items():
        if k.startswith("flow_"):
            gap = gaps.get(k)
            ok = w <= t["wer_flow"] and (gap is None or gap <= t["gap_flow"])
            what = f"own voice WER ({k[5:]} steps; gap to hibari live)"
            out.append(
                (what, f"{100 * w:.1f} %" + (f" ({100 * gap:+.1f} pt)" if gap is not None else ""), ok)
            )
    for s, tm in res["timing_one_thread"].items():
        first_ok = (
            tm["first_chunk_p50_ms"] <= t["first_chunk_p50_ms"]
            and tm["first_chunk_p90_ms"] <= t["first_chunk_p90_ms"]
        )
        out.append(
            (
                f"first chunk P50/P90 ({s} steps)",
                f"{tm['first_chunk_p50_ms']:.0f}/{tm['first_chunk_p90_ms']:.0f} ms",
                first_ok,
            )
        )
        out.append((f"steady RTF ({s} steps)", f"{tm['rtf']:.3f}", tm["rtf"] <= t["rtf"]))
        out.append(
            (
                f"chunk 50 vs chunk 2 ({s} steps)",
                f"{tm['chunk50_ms']:.1f} vs {tm['chunk2_ms']:.1f} ms",
                tm["chunk_ratio"] <= t["chunk_ratio"],
            )
        )
    out.append(("bitrate", f"{res['bitrate_bps']:.1f} bps", res["bitrate_bps"] <= t["bitrate_bps"]))
    if res.get("long_answer"):
        la = res["long_answer"]
        grew = la["rss_growth_mb"]
        what = f"memory over a {la['audio_s'] / 60:.1f}-minute answer (minute 1 to end)"
        out.append((what, f"{grew:+.1f} MB", grew <= t["long_answer_growth_mb"]))
    used = min(res["codes_used_per_group"])
    out.append(("codes used (least-used group)", f"{100 * used:.1f} %", used >= t["codes_used"]))
    return out


def compare_to_baseline(res: dict[str, Any], baseline: dict[str, Any], name: str = "") -> dict[str, Any]:
    """Each WER part of `res` that `baseline` (an earlier tts.json) also has, compared sentence by sentence over
    the sentences both scored (they must be the same texts in the same order)."""
    from duplex.eval.paired import paired_wer_difference

    what = f"baseline {name}" if name else "the baseline"
    mine, theirs = res["transcripts"], baseline.get("transcripts")
    if not theirs:
        raise ValueError(f"{what} has no transcripts (written before tts.json kept them)")
    n = min(len(mine), len(theirs))
    texts = [row["text"] for row in mine[:n]]
    if texts != [row["text"] for row in theirs[:n]]:
        raise ValueError(f"{what} scored other sentences than this run")
    keys = [k for k in res["wer"] if k in theirs[0] and k in mine[0]]
    if not keys:
        raise ValueError(f"{what} has none of this run's parts ({', '.join(res['wer'])})")
    parts = {
        k: paired_wer_difference(texts, [r[k] for r in theirs[:n]], [r[k] for r in mine[:n]]) for k in keys
    }
    return {"file": name, "flow_step": baseline.get("flow_step"), "parts": parts}


def report(res: dict[str, Any]) -> str:
    from duplex.eval.paired import describe

    lines = [
        f"own voice vs hibari ({res['date']}, profile {res['profile']}, flow step {res['flow_step']}, n={res['n']})"
    ]
    lines += [f"  WER {k:<8} {100 * v:5.1f} %" for k, v in res["wer"].items()]
    lines += [f"  {'met ' if ok else 'MISS'} {what}: {val}" for what, val, ok in verdicts(res)]
    if res.get("vs_baseline"):
        vs = res["vs_baseline"]
        lines += [f"  vs baseline {vs['file']} (flow step {vs['flow_step']}):"]
        lines += [f"    {k:<8} {describe(d)}" for k, d in vs["parts"].items()]
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    names = list(res["wer"])
    vals = [100 * res["wer"][k] for k in names]
    palette = {"hibari": "tab:gray", "codec": "tab:blue", "hibari_live": "tab:gray"}
    colors = [palette.get(k, "tab:orange") for k in names]
    ax[0].bar(names, vals, color=colors)
    ax[0].axhline(100 * res["targets"]["wer_flow"], color="k", ls="--", lw=0.8, label="target (own voice)")
    ax[0].set_ylabel("WER % (Moonshine)")
    ax[0].set_title(f"held-out sentences, n={res['n']}")
    ax[0].legend()
    steps = list(res["timing_one_thread"])
    tm = [res["timing_one_thread"][s] for s in steps]
    x = np.arange(len(steps))
    ax[1].bar(x - 0.2, [t["first_chunk_p50_ms"] for t in tm], 0.4, label="first chunk P50")
    ax[1].bar(x + 0.2, [t["first_chunk_p90_ms"] for t in tm], 0.4, label="first chunk P90")
    ax[1].axhline(res["targets"]["first_chunk_p50_ms"], color="tab:blue", ls="--", lw=0.8)
    ax[1].axhline(res["targets"]["first_chunk_p90_ms"], color="tab:orange", ls="--", lw=0.8)
    ax[1].set_xticks(x, [f"{s} steps" for s in steps])
    ax[1].set_ylabel("ms, one thread")
    ax[1].set_title("text in -> first 225 ms of audio out")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    baseline = None
    if getattr(args, "baseline", None):  # read it before an evaluation of many minutes, not after
        try:
            baseline = json.loads(Path(args.baseline).read_text())
        except (OSError, ValueError) as exc:
            raise SystemExit(f"eval tts: cannot read --baseline {args.baseline}: {exc}") from None
    res = evaluate(args)
    if baseline is not None:
        try:
            res["vs_baseline"] = compare_to_baseline(res, baseline, args.baseline)
        except ValueError as exc:
            print(f"eval tts: not compared with the baseline: {exc}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tts.json").write_text(json.dumps(res, indent=1))
    plot(res, out / "tts.png")
    print(report(res))
    print(f"wrote {out / 'tts.json'} and {out / 'tts.png'}")
    return 0
