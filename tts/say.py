"""`duplex say "text" --out a.wav [--profile P]`: render text with a profile's voice, through the same TTS
stage the service runs (phrases, chunks), and write it as a WAV file."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from duplex.base.config import Profile
from duplex.base.messages import TtsInput
from tts.loading import load_tts, step_all


class SayError(RuntimeError):
    """The text could not be rendered or the file could not be written."""


@dataclass(frozen=True)
class Rendered:
    audio: np.ndarray  # float32 mono at `sample_rate`
    sample_rate: int
    first_chunk_s: float  # text in -> first audio chunk out (the stage's first call)
    compute_s: float
    chunks: int
    words: list[str]  # the words the chunks carry, in order (what a listener would have heard)

    @property
    def seconds(self) -> float:
        return len(self.audio) / self.sample_rate


def render(profile: Profile, text: str) -> Rendered:
    """Synthesise `text` with the profile's TTS stage, one word at a time as the LLM would stream it."""
    if not text.strip():
        raise SayError("nothing to say: the text is empty")
    stage = load_tts(profile.component("tts"))
    state = stage.init_state()
    chunks = []
    first = None
    t0 = time.perf_counter()
    words = text.split()
    for i, word in enumerate(words):
        final = i + 1 == len(words)
        out, state = stage.step(state, TtsInput(word + ("" if final else " "), final))
        if out and first is None:
            first = time.perf_counter() - t0  # the first chunk, as the session core would play it
        more, state = step_all(stage, state, TtsInput("", final))  # what a chunk-by-chunk stage owes
        chunks += [*out, *more]
    compute = time.perf_counter() - t0
    audio = [c.audio for c in chunks if c.audio.size]
    if not audio:
        raise SayError(f"the {profile.component('tts').backend} voice produced no audio for {text!r}")
    heard = [w for c in chunks for w in c.text.split()]
    return Rendered(
        np.concatenate(audio).astype(np.float32),
        int(stage.sample_rate),
        first if first is not None else compute,
        compute,
        len(chunks),
        heard,
    )


def write(path: Path, audio: np.ndarray, sample_rate: int) -> None:
    import soundfile as sf

    try:
        sf.write(str(path), np.clip(audio, -1.0, 1.0), sample_rate, subtype="PCM_16")
    except (OSError, RuntimeError, ValueError, sf.LibsndfileError) as exc:
        raise SayError(f"cannot write {path}: {exc}") from None
