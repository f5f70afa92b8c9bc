"""`duplex eval asr`: word error rate of the streaming ASR per lookahead, beside Moonshine on the same audio.

Data:
- the held-out synthetic set (default): held-out sentences (asr/training/data.py: 1 in 20 by hash) spoken
  by espeak-ng voices that training never used (`HELDOUT_VARIANTS`, `HELDOUT_ACCENTS`), clean, and
  optionally augmented (`--augmented`: the training augmentation: noise, reverb, speed, telephone);
- `--data DIR`: any folder of audio + transcript pairs: `x.wav` (or .flac) with `x.txt`, or the
  LibriSpeech layout (`<spk>/<chapter>/<spk>-<chapter>.trans.txt` beside `<id>.flac`).

Per lookahead the streaming model is run as the server runs it (the `nemo-streaming` stage, audio in
80 ms packets), so the time at which each word first appears in a partial transcript is measured
against the time the word ended: "first partial after spoken". On the synthetic set that end is the
synthesiser's (espeak-ng's word events), for each final word an edit alignment pairs with the same
reference word; on `--data` sets it is the model's own CTC timestamp.
Moonshine (the cpu profile's ASR) transcribes each utterance whole. Text is normalised the same way for
every system (lower case, letters and apostrophes). Results: asr.json and asr.png in `--out`.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from duplex.base.audio import SAMPLE_RATE as SR

log = logging.getLogger("duplex.eval.asr")

PACKET = 1280  # 80 ms


@dataclass
class Utterance:
    id: str
    text: str
    audio: np.ndarray
    voice: str = ""
    word_ends: tuple[float, ...] | None = (
        None  # when each reference word ends (s), where the synthesiser says
    )


def synthetic_set(n: int, augmented: bool, seed: int = 11) -> list[Utterance]:
    from asr.training.data import Speaker, heldout_sentences, make_example

    heldout = heldout_sentences()
    speaker = Speaker()
    out = []
    for i in range(n):
        e = make_example(speaker, heldout, seed, i, heldout=True, clean=not augmented)
        ends = tuple(b for _, b in e.word_times) if e.word_times else None
        out.append(Utterance(f"heldout-{i}", e.text, e.audio, e.voice, ends))
    return out


def panel_sets(n: int = 60, which: str = "all") -> dict[str, list[Utterance]]:
    """The validation panel's sets (cached audio; asr/training/panel.py) as evaluation utterances."""
    from asr.training.panel import SETS, panel_set

    names = SETS if which == "all" else tuple(x.strip() for x in which.split(",") if x.strip())
    unknown = [x for x in names if x not in SETS]
    if unknown:
        raise SystemExit(f"eval asr: unknown panel sets {unknown}; sets: {', '.join(SETS)}")
    return {
        name: [Utterance(u.id, u.text, u.audio, u.voice, u.word_ends) for u in panel_set(name, n)]
        for name in names
    }


def _read_audio(path: Path) -> np.ndarray:
    import soundfile as sf

    from codec.resample import resample

    audio, rate = sf.read(str(path), dtype="float32", always_2d=True)
    audio = audio.mean(axis=1)
    return resample(audio, rate, SR) if rate != SR else audio


def directory_set(root: Path, limit: int = 0) -> list[Utterance]:
    """wav/flac + same-name .txt pairs, or LibriSpeech `*.trans.txt` chapters, under `root`."""
    if not root.is_dir():
        raise SystemExit(f"eval asr: {root} is not a directory")
    pairs: list[tuple[str, Path, str]] = []
    for trans in sorted(root.rglob("*.trans.txt")):  # LibriSpeech
        for line in trans.read_text().splitlines():
            if not line.strip():
                continue
            uid, _, text = line.partition(" ")
            for ext in (".flac", ".wav"):
                audio = trans.parent / f"{uid}{ext}"
                if audio.exists():
                    pairs.append((uid, audio, text))
                    break
    if not pairs:
        for audio in sorted([*root.rglob("*.wav"), *root.rglob("*.flac")]):
            txt = audio.with_suffix(".txt")
            if txt.exists():
                pairs.append((str(audio.relative_to(root)), audio, txt.read_text().strip()))
    if not pairs:
        raise SystemExit(
            f"eval asr: no audio with transcripts under {root} (x.wav + x.txt, or LibriSpeech layout)"
        )
    if limit:
        pairs = pairs[:limit]
    return [Utterance(uid, text, _read_audio(path)) for uid, path, text in pairs]


def stream_utterance(
    stage: Any, audio: np.ndarray, reference: str = "", word_ends: tuple[float, ...] | None = None
) -> tuple[str, list[float], float]:
    """Final text, per-word delay (s) from the end of the word to its first appearance in a partial, and
    compute seconds. A word's end is the synthesiser's (`word_ends` of `reference`, for the final words
    an edit alignment pairs with equal reference words) or else the model's own CTC timestamp."""
    from duplex.base.messages import AsrChunk

    state = stage.init_state()
    first_seen: dict[int, float] = {}
    compute = 0.0
    pos = 0
    out = None
    while True:
        final = pos >= audio.size
        chunk = audio[pos : pos + PACKET] if not final else np.zeros(0, np.float32)
        t = time.perf_counter()
        out, state = stage.step(state, AsrChunk(chunk, transcribe=True, final=final))
        compute += time.perf_counter() - t
        pos += chunk.size
        arrived = min(pos, audio.size) / SR
        # a recogniser without word times (moonshine-stream) gives its partial's words by position
        seen = [w.word for w in out.words] or (out.text or "").split()
        for i, _ in enumerate(seen):
            first_seen.setdefault(i, arrived if not final else audio.size / SR)
        if final:
            break
    if word_ends is not None:
        from asr.training.data import normalize_text
        from asr.training.wer import matched_words

        hyp = [normalize_text(w) for w in ([w.word for w in out.words] or (out.text or "").split())]
        pairs = matched_words(normalize_text(reference).split(), hyp)
        delays = [first_seen[h] - word_ends[r] for r, h in pairs if h in first_seen and r < len(word_ends)]
    else:
        delays = [first_seen[i] - w.end for i, w in enumerate(out.words) if i in first_seen]
    return out.text or "", delays, compute


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--profile",
        default="cpu-streaming",
        help="profile whose streaming asr (moonshine-stream or nemo-streaming) is evaluated",
    )
    ap.add_argument(
        "--model", default=None, help="a .nemo file (run as cpu-fastconformer's FastConformer) instead"
    )
    ap.add_argument(
        "--lookaheads", default="all", help="'all' or a comma list of lookaheads in ms (e.g. 480,80)"
    )
    ap.add_argument("-n", "--n", type=int, default=200, help="held-out synthetic utterances")
    ap.add_argument(
        "--augmented", action="store_true", help="also score the held-out set with training augmentation"
    )
    ap.add_argument(
        "--data", default=None, help="a folder of wav+txt pairs or LibriSpeech instead of the synthetic set"
    )
    ap.add_argument("--limit", type=int, default=0, help="with --data: at most this many utterances")
    ap.add_argument(
        "--panel",
        action="store_true",
        help="the validation panel (asr/training/panel.py): training voices, plain held-out voices, hard "
        "espeak variants, natural held-out voices on conversational and dictionary text; -n per set (60)",
    )
    ap.add_argument("--panel-sets", default="all", help="with --panel: 'all' or a comma list of set names")
    ap.add_argument("--no-moonshine", action="store_true", help="skip the Moonshine baseline")
    ap.add_argument("--out", default="eval-out", help="folder for asr.json and asr.png")
    ap.add_argument("--no-progress", action="store_true")


def _progress(items: list, desc: str, enabled: bool):
    if not enabled:
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, unit="utt", leave=False)


def run(args: argparse.Namespace) -> int:
    import torch

    from asr.nemo_streaming import NemoStreamingAsrStage, NemoStreamingModel, load_nemo_model
    from duplex.base.config import load_profile

    torch.set_num_threads(1)
    progress = not args.no_progress
    cfg = load_profile(args.profile).component("asr")
    if cfg.backend == "moonshine-stream" and not args.model:
        return _run_moonshine_stream(args, cfg)
    if args.model:
        source = Path(args.model)
        if cfg.backend != "nemo-streaming":  # a .nemo file runs with the FastConformer profile's options
            cfg = load_profile("cpu-fastconformer").component("asr")
    else:
        if cfg.backend != "nemo-streaming":
            raise SystemExit(
                f"eval asr: profile {args.profile!r} has asr backend {cfg.backend!r}, not nemo-streaming "
                "or moonshine-stream"
            )
        from asr.nemo_streaming import SHIPPED

        source = (
            Path(cfg.weights["path"]) if cfg.weights.get("path") else (cfg.weights.get("name") or SHIPPED)
        )
    nemo_model = load_nemo_model(source)
    enc = nemo_model.encoder
    contexts = [list(c) for c in getattr(enc, "att_context_size_all", [enc.att_context_size])]
    frame_ms = 1000 * int(getattr(enc, "subsampling_factor", 8)) * 160 / SR
    if args.lookaheads != "all":
        wanted = {float(x) for x in args.lookaheads.split(",")}
        contexts = [c for c in contexts if c[1] * frame_ms in wanted]
        if not contexts:
            raise SystemExit(f"eval asr: none of the lookaheads {sorted(wanted)} is the model's")
    sets = _sets(args)
    results: dict[str, Any] = {"model": str(source), "date": time.strftime("%Y-%m-%d %H:%M"), "sets": {}}
    moonshine = None if args.no_moonshine else _moonshine()
    for name, utts in sets.items():
        entry = _entry(utts)
        for ctx in contexts:
            stage = NemoStreamingAsrStage(NemoStreamingModel(nemo_model, att_context_size=ctx))
            la = ctx[1] * frame_ms
            entry["streaming"][f"{la:g}"] = {
                "att_context_size": ctx,
                **_stream_set(stage, utts, f"{name} lookahead {la:g} ms", progress, la, stage.m.chunk_ms),
            }
            log.info("%s lookahead %g ms: WER %.3f", name, la, entry["streaming"][f"{la:g}"]["wer"])
        if moonshine is not None:
            entry["moonshine"] = _moonshine_set(moonshine, utts, name, progress)
        results["sets"][name] = entry
    return _write(args, results)


def _run_moonshine_stream(args: argparse.Namespace, cfg: Any) -> int:
    """The same report for the `moonshine-stream` backend: one "lookahead", its chunk."""
    from duplex.runtime.service import load_asr

    stage = load_asr(cfg)
    chunk_ms = 24.0 * int(cfg.options.get("chunk_frames", 20))
    progress = not args.no_progress
    results: dict[str, Any] = {
        "model": f"moonshine-stream ({args.profile}; adapters: {cfg.options.get('adapters', True)})",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "sets": {},
    }
    moonshine = None if args.no_moonshine else _moonshine()
    for name, utts in _sets(args).items():
        entry = _entry(utts)
        entry["streaming"][f"{chunk_ms:g}"] = _stream_set(stage, utts, name, progress, chunk_ms, chunk_ms)
        log.info("%s chunk %g ms: WER %.3f", name, chunk_ms, entry["streaming"][f"{chunk_ms:g}"]["wer"])
        if moonshine is not None:
            entry["moonshine"] = _moonshine_set(moonshine, utts, name, progress)
        results["sets"][name] = entry
    return _write(args, results)


def _moonshine() -> Any:
    from asr.moonshine import MoonshineModel

    return MoonshineModel()


def _entry(utts: list[Utterance]) -> dict[str, Any]:
    refs = [u.text for u in utts]
    return {
        "n": len(utts),
        "words": sum(len(r.split()) for r in refs),
        "audio_minutes": round(sum(u.audio.size for u in utts) / SR / 60, 2),
        "streaming": {},
    }


def _stream_set(
    stage: Any, utts: list[Utterance], desc: str, progress: bool, lookahead_ms: float, chunk_ms: float
) -> dict[str, Any]:
    from asr.training.wer import wer

    refs = [u.text for u in utts]
    audio_s = sum(u.audio.size for u in utts) / SR
    hyps, delays, compute = [], [], 0.0
    for u in _progress(utts, desc, progress):
        text, d, c = stream_utterance(stage, u.audio, u.text, u.word_ends)
        hyps.append(text)
        delays.extend(d)
        compute += c
    return {
        "lookahead_ms": lookahead_ms,
        "chunk_ms": chunk_ms,
        "wer": round(wer(refs, hyps), 4),
        "rtf": round(compute / audio_s, 4),
        "first_partial_after_word_end_ms": {
            "p50": round(1000 * float(np.percentile(delays, 50)), 1) if delays else None,
            "p90": round(1000 * float(np.percentile(delays, 90)), 1) if delays else None,
            "n": len(delays),
            "bound_chunk_plus_lookahead_ms": chunk_ms + lookahead_ms,
            "word_end": "synthesiser" if all(u.word_ends for u in utts) else "model timestamps",
        },
        "examples": [{"ref": r, "hyp": h} for r, h in list(zip(refs, hyps, strict=False))[:5]],
    }


def _moonshine_set(moonshine: Any, utts: list[Utterance], name: str, progress: bool) -> dict[str, Any]:
    from asr.training.wer import wer

    refs = [u.text for u in utts]
    audio_s = sum(u.audio.size for u in utts) / SR
    hyps, compute = [], 0.0
    for u in _progress(utts, f"{name} moonshine", progress):
        t = time.perf_counter()
        hyps.append(moonshine.transcribe(u.audio))
        compute += time.perf_counter() - t
    return {
        "wer": round(wer(refs, hyps), 4),
        "rtf": round(compute / audio_s, 4),
        "examples": [{"ref": r, "hyp": h} for r, h in list(zip(refs, hyps, strict=False))[:5]],
    }


def _sets(args: argparse.Namespace) -> dict[str, list[Utterance]]:
    sets: dict[str, list[Utterance]] = {}
    if args.panel:
        sets.update(panel_sets(args.n if args.n != 200 else 60, args.panel_sets))
    elif args.data:
        sets[Path(args.data).name or "data"] = directory_set(Path(args.data), args.limit)
    else:
        sets["heldout-voices"] = synthetic_set(args.n, augmented=False)
        if args.augmented:
            sets["heldout-voices-augmented"] = synthetic_set(args.n, augmented=True)
    return sets


def _write(args: argparse.Namespace, results: dict[str, Any]) -> int:
    results["summary"] = summary(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "asr.json").write_text(json.dumps(results, indent=1) + "\n")
    _print(results)
    _plot(results, out / "asr.png")
    print(f"wrote {out / 'asr.json'} and {out / 'asr.png'}")
    return 0


def summary(results: dict[str, Any]) -> dict[str, Any]:
    """WER per set and lookahead (and Moonshine's), plus the streaming / Moonshine WER ratio per set."""
    table: dict[str, Any] = {}
    for name, e in results["sets"].items():
        row: dict[str, Any] = {f"stream_{la}": s["wer"] for la, s in e["streaming"].items()}
        if "moonshine" in e:
            row["moonshine"] = e["moonshine"]["wer"]
            for la, s in e["streaming"].items():
                row[f"ratio_{la}"] = round(s["wer"] / max(e["moonshine"]["wer"], 1e-3), 2)
        table[name] = row
    return table


def _print(results: dict[str, Any]) -> None:
    for name, e in results["sets"].items():
        print(f"\n{name}: {e['n']} utterances, {e['words']} words, {e['audio_minutes']} min")
        print(f"  {'system':<28} {'WER':>7} {'RTF':>7}  first partial after word end P50/P90 (bound)")
        for la, s in e["streaming"].items():
            d = s["first_partial_after_word_end_ms"]
            print(
                f"  {'streaming, lookahead ' + la + ' ms':<28} {100 * s['wer']:6.1f}% {s['rtf']:7.3f}  "
                f"{d['p50']}/{d['p90']} ms (<= {d['bound_chunk_plus_lookahead_ms']:g} ms), n={d['n']}"
            )
        if "moonshine" in e:
            print(
                f"  {'moonshine base-en (whole)':<28} {100 * e['moonshine']['wer']:6.1f}% {e['moonshine']['rtf']:7.3f}"
            )


def _plot(results: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    sets = list(results["sets"].items())
    cols = min(3, len(sets))
    rows = -(-len(sets) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False)
    for ax in axes.flat[len(sets) :]:
        ax.axis("off")
    for ax, (name, e) in zip(axes.flat, sets, strict=False):
        labels = [f"stream\n{la} ms" for la in e["streaming"]]
        values = [100 * s["wer"] for s in e["streaming"].values()]
        colors = ["tab:blue"] * len(values)
        if "moonshine" in e:
            labels.append("moonshine\n(whole)")
            values.append(100 * e["moonshine"]["wer"])
            colors.append("tab:gray")
        ax.bar(labels, values, color=colors)
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.1f}", ha="center", va="bottom")
        ax.set_ylabel("WER %")
        ax.set_title(f"{name} (n={e['n']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
