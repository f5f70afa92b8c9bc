"""Mid-sentence pauses cut from whole sentences' audio, for `duplex eval eot --cut-audio whole`.

A held-out "cut" turn ("Artificial Intelligence is the") spoken on its own ends the way a finished
sentence ends: the voice falls and lengthens its last word. A person who pauses mid-sentence does not.
Here the whole sentence is spoken instead, with the same voice and the same random draws (rate, F0),
the cut text is spoken too, and its end is found in the whole sentence's audio by dynamic time warping
of the two log-mel spectrograms; the whole sentence's audio up to that point is the turn. No word
timings are needed, so any engine (flite, Kokoro, hibari) works.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from asr.end_of_turn import HOP, log_mel

__all__ = ["HOP", "cut_whole", "log_mel", "prefix_end", "render_turn", "whole_sentence_for"]


def _words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]", " ", text.lower()).split()


def whole_sentence_for(cut: dict[str, Any], examples: list[dict[str, Any]]) -> str | None:
    """The longest held-out turn of the same group whose words begin with the cut's words (the whole
    sentence it was cut from, or a longer cut of it); None when the group has none."""
    head = _words(cut["text"])
    best: str | None = None
    best_len = len(head)
    for ex in examples:
        if ex is cut or ex.get("group") != cut.get("group"):
            continue
        words = _words(ex["text"])
        if len(words) > best_len and words[: len(head)] == head:
            best, best_len = ex["text"], len(words)
    return best


def _trim_trailing_silence(feats: np.ndarray, floor_db: float = 35.0) -> np.ndarray:
    energy = feats.max(axis=1)
    loud = np.nonzero(energy > energy.max() - floor_db / 10 * np.log(10))[0]
    return feats[: (loud[-1] + 1 if len(loud) else len(feats))]


def prefix_end(whole: np.ndarray, prefix: np.ndarray) -> int:
    """The frame of `whole` where `prefix` (spoken alone, same voice) ends: dynamic time warping with
    both starts aligned and an open end in `whole`; each prefix frame advances `whole` by 0, 1 or 2
    frames (the two renderings share a speaking rate). Cosine distance of mean-removed log-mels."""
    p = _trim_trailing_silence(prefix)
    a = p - p.mean(axis=1, keepdims=True)
    b = whole - whole.mean(axis=1, keepdims=True)
    a /= np.linalg.norm(a, axis=1, keepdims=True) + 1e-8
    b /= np.linalg.norm(b, axis=1, keepdims=True) + 1e-8
    cost = 1.0 - a @ b.T  # (len(p), len(whole))
    inf = np.float32(np.inf)
    acc = np.full(cost.shape[1], inf, np.float32)
    acc[0] = cost[0, 0]
    for i in range(1, len(p)):
        prev = acc
        best = prev.copy()
        best[1:] = np.minimum(best[1:], prev[:-1])
        best[2:] = np.minimum(best[2:], prev[:-2])
        acc = cost[i] + best
    return int(np.argmin(acc))


def cut_whole(whole_audio: np.ndarray, prefix_audio: np.ndarray, sr: int = 16000) -> np.ndarray:
    """`whole_audio` up to where `prefix_audio`'s words end in it. Checked against flite's own phone
    timings (slt, 49 cuts): median -5 ms, 80 % within 50 ms, 8 % more than 50 ms early, 12 % late;
    moving the cut to the quietest frame nearby made it worse (65 % within 50 ms with -20..+50 ms)."""
    w = log_mel(whole_audio, sr)
    end = prefix_end(w, log_mel(prefix_audio, sr))
    return np.asarray(whole_audio[: (end + 1) * HOP], np.float32)


def render_turn(
    synth: Any,
    ex: dict[str, Any],
    examples: list[dict[str, Any]],
    speaker: Any,
    rng: np.random.Generator,
    cut_audio: str = "whole",
    pause_s: float = 0.2,
) -> tuple[np.ndarray, str | None]:
    """One turn's audio (16 kHz float32) and the whole sentence a cut was taken from (None if spoken as is).

    A complete turn, and a cut with `cut_audio="alone"` or without a whole sentence in `examples`, is
    spoken as it is. Otherwise the whole sentence and the cut text are spoken with the same random draws
    (rate, F0), the whole sentence's audio is cut where the cut's words end, and `pause_s` of silence
    follows (the live final is asked once the VAD hears the pause). `duplex eval eot` and the acoustic
    end-of-turn recipe both render turns here, so the two see the same audio for the same draws."""
    if cut_audio not in ("alone", "whole"):
        raise ValueError(f"cut_audio must be 'alone' or 'whole', not {cut_audio!r}")
    whole = whole_sentence_for(ex, examples) if cut_audio == "whole" and ex["kind"] == "cut" else None
    if whole is None:
        return np.asarray(synth.render(ex["text"], speaker, rng).audio, np.float32), None
    draw = int(rng.integers(2**62))
    full = synth.render(whole, speaker, np.random.default_rng(draw)).audio
    alone = synth.render(ex["text"], speaker, np.random.default_rng(draw)).audio
    silence = np.zeros(int(pause_s * 16000), np.float32)
    return np.concatenate([cut_whole(full, alone), silence]), whole
