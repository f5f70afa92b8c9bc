"""The streaming ASR's validation panel: fixed sets that can show progress, each ~60 utterances.

| set | voices | text |
|---|---|---|
| `train-voices` | training speakers (`speakers.training_speakers`, drawn with their weights) | held-out dictionary sentences |
| `heldout-synthetic` | plain held-out espeak voices (held-out variants, en-US / en, moderate rate and pitch) | held-out dictionary sentences |
| `hard-espeak` | the old validation: any held-out variant or the held-out accent, any rate and pitch (report only, never steer by it) | held-out dictionary sentences |
| `natural-conversational` | natural voices never trained on (`speakers.HELDOUT_NATURAL`: flite slt, a Kokoro blend led by a style no training blend uses) | questions and requests of the dialogue eval sets (never trained on) |
| `natural-dictionary` | the same natural voices | held-out dictionary sentences |

Every utterance is clean, with 0.2 s of silence before and 0.3 s after (Moonshine repeats itself on
tightly trimmed clips) and peak 0.5; utterance i of a set is a pure function of (set, seed, i). The
audio is cached under `~/.cache/duplex/asr-panel/` (or `$DUPLEX_ASR_PANEL_CACHE`), keyed by a hash of
what defines it (panel version, set, seed, n, texts and voices), so a rerun loads it in a second.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from duplex.base.audio import SAMPLE_RATE

PANEL_VERSION = 1
SETS = ("train-voices", "heldout-synthetic", "hard-espeak", "natural-conversational", "natural-dictionary")
#: sets the recipe steers by (kill criterion, best checkpoint); `hard-espeak` is reported only
STEER_SETS = ("train-voices", "heldout-synthetic", "natural-conversational")
PLAIN_HELDOUT_VARIANTS = ("m6", "f4", "Andy", "linda", "steph2", "anika")
PLAIN_ACCENTS = ("en-US", "en")


@dataclass
class PanelUtterance:
    id: str
    text: str  # normalised
    audio: np.ndarray  # float32, 16 kHz
    voice: str
    word_ends: tuple[float, ...] | None = None


def cache_dir() -> Path:
    return Path(os.environ.get("DUPLEX_ASR_PANEL_CACHE", "~/.cache/duplex/asr-panel")).expanduser()


def _plan(name: str, n: int, seed: int) -> list[tuple[str, object]]:
    """(sentence, speaker) for each utterance of set `name`: what defines its audio."""
    from asr.training.data import heldout_sentences
    from asr.training.speakers import (
        Speaker,
        SpeakerTable,
        heldout_natural_speakers,
        panel_conversational_texts,
        training_speakers,
    )

    if name not in SETS:
        raise ValueError(f"unknown panel set {name!r}; sets: {', '.join(SETS)}")
    dictionary = heldout_sentences()
    k = SETS.index(name)
    rng = np.random.default_rng([seed, k])
    order = rng.permutation(len(dictionary))
    plan: list[tuple[str, object]] = []
    if name == "train-voices":
        # equal weights within an engine: the set must not change when the espeak scores are (re)written
        table = SpeakerTable([replace(s, weight=1.0) for s in training_speakers()])
        for i in range(n):
            plan.append((dictionary[order[i]], table.draw(rng)))
    elif name == "heldout-synthetic":
        for i in range(n):
            variant = PLAIN_HELDOUT_VARIANTS[i % len(PLAIN_HELDOUT_VARIANTS)]
            accent = PLAIN_ACCENTS[(i // len(PLAIN_HELDOUT_VARIANTS)) % len(PLAIN_ACCENTS)]
            params = (
                ("voice", f"{accent}+{variant}"),
                ("rate", int(rng.integers(150, 191))),
                ("pitch", int(rng.integers(40, 61))),
                ("pitch_range", int(rng.integers(40, 61))),
            )
            plan.append((dictionary[order[i]], Speaker(f"espeak:{accent}+{variant}", "espeak", params)))
    elif name == "hard-espeak":
        plan = [("", None)] * n  # asr.training.data.make_example(heldout=True) picks text and voice
    elif name in ("natural-conversational", "natural-dictionary"):
        texts = panel_conversational_texts() if name == "natural-conversational" else dictionary
        if name == "natural-dictionary":
            texts = tuple(dictionary[j] for j in order[n : 2 * n])
        voices = heldout_natural_speakers()
        for i in range(n):
            base = voices[i % len(voices)]
            plain = (("speed", 1.0), ("stretch", 1.0), ("f0_mean", 0.0))
            params = tuple(p for p in base.params) + plain
            plan.append((texts[i % len(texts)], Speaker(base.name, base.engine, params)))
    else:
        raise ValueError(f"unknown panel set {name!r}; sets: {', '.join(SETS)}")
    return plan


def _key(name: str, n: int, seed: int, plan: list[tuple[str, object]]) -> str:
    desc = [PANEL_VERSION, name, n, seed, [(t, repr(s)) for t, s in plan]]
    return hashlib.sha256(json.dumps(desc, default=str).encode()).hexdigest()[:16]


def _pad(audio: np.ndarray) -> tuple[np.ndarray, float]:
    """0.2 s silence, the trimmed audio, 0.3 s silence, peak 0.5; and how far the audio moved (s)."""
    from asr.training.data import _trim

    trimmed, first = _trim(audio)
    out = np.concatenate([np.zeros(3200, np.float32), trimmed, np.zeros(4800, np.float32)])
    out *= 0.5 / (np.max(np.abs(out)) + 1e-9)
    return out.astype(np.float32), 0.2 - first / SAMPLE_RATE


def _synthesise(name: str, n: int, seed: int, plan: list[tuple[str, object]]) -> list[PanelUtterance]:
    from asr.training.data import normalize_text
    from asr.training.speakers import Synth

    if name == "hard-espeak":
        from asr.training.data import Speaker as DataSpeaker
        from asr.training.data import heldout_sentences, make_example

        speaker = DataSpeaker()
        out = []
        for i in range(n):
            e = make_example(speaker, heldout_sentences(), seed, i, heldout=True, clean=True)
            ends = tuple(b for _, b in e.word_times) if e.word_times else None
            out.append(PanelUtterance(f"{name}-{i}", e.text, e.audio, f"espeak:{e.voice}", ends))
        return out
    synth = Synth()
    out = []
    for i, (text, speaker) in enumerate(plan):
        rng = np.random.default_rng([seed, SETS.index(name), i, 1])
        r = synth.render(text, speaker, rng)  # type: ignore[arg-type]
        audio, shift = _pad(r.audio)
        ends = tuple(b + shift for _, b in r.word_times) if r.word_times else None
        out.append(PanelUtterance(f"{name}-{i}", normalize_text(text), audio, r.voice, ends))
    return out


def _save(path: Path, utts: list[PanelUtterance]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lengths = np.array([u.audio.size for u in utts])
    pcm = np.concatenate([np.round(np.clip(u.audio, -1, 1) * 32767).astype(np.int16) for u in utts])
    meta = [{"id": u.id, "text": u.text, "voice": u.voice, "word_ends": u.word_ends} for u in utts]
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, pcm=pcm, lengths=lengths, meta=np.array(json.dumps(meta)))
    os.replace(tmp, path)


def _load(path: Path) -> list[PanelUtterance]:
    with np.load(path) as z:
        pcm, lengths, meta = z["pcm"], z["lengths"], json.loads(str(z["meta"]))
    out, pos = [], 0
    for m, n in zip(meta, lengths, strict=True):
        audio = pcm[pos : pos + n].astype(np.float32) / 32767
        pos += n
        ends = tuple(m["word_ends"]) if m["word_ends"] is not None else None
        out.append(PanelUtterance(m["id"], m["text"], audio, m["voice"], ends))
    return out


def panel_set(name: str, n: int = 60, seed: int = 11, cache: bool = True) -> list[PanelUtterance]:
    """Set `name` of the panel (synthesised once, then loaded from the cache)."""
    plan = _plan(name, n, seed)
    path = cache_dir() / f"{name}-{_key(name, n, seed, plan)}.npz"
    if cache and path.is_file():
        return _load(path)
    utts = _synthesise(name, n, seed, plan)
    for u in utts:  # as stored (16-bit), so a first run and a cached rerun score the same samples
        u.audio = (np.round(np.clip(u.audio, -1, 1) * 32767) / 32767).astype(np.float32)
    if cache:
        _save(path, utts)
    return utts


def panel(n: int = 60, seed: int = 11, sets: tuple[str, ...] = SETS) -> dict[str, list[PanelUtterance]]:
    return {name: panel_set(name, n, seed) for name in sets}
