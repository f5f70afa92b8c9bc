"""Frame-level targets only a synthesiser gives for free: the alignment loss's piece-per-frame targets and
the dense phone labels (espeak's word and phoneme events), shared by both recipes' data paths."""

from __future__ import annotations

import numpy as np
import torch

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
