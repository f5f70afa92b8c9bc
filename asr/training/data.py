"""Training and held-out speech for the streaming ASR, synthesised from English text on the fly.

Text: WordNet's example sentences (Debian `wordnet-base`), `fortunes` quotes, chatterbot-corpus and the
project's dialogue lines; sentences are split into train / held-out by a hash of their text. Voices:
hibari (af_heart) and espeak-ng accents x variants; the held-out *voices* (`HELDOUT_VARIANTS`,
`HELDOUT_ACCENTS`) are never used for training. Every example is a pure function of (seed, index):
the same index always gives the same audio, so training resumes exactly and runs are reproducible.
Augmentation: speaking rate, pitch, speed perturbation, gain, reverberation, noise, telephone band.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from codec.resample import resample
from duplex.base.audio import SAMPLE_RATE
from duplex.base.paths import DATA_ROOT

WORDNET_DIR = "/usr/share/wordnet"
FORTUNE_DIR = "/usr/share/games/fortunes"
DIALOGUE_DATA = DATA_ROOT / "dialogue"

ACCENTS = (
    "en-US",
    "en",
    "en-GB-scotland",
    "en-GB-x-rp",
    "en-029",
    "en-GB-x-gbclan",
    "en-US-nyc",
    "en-GB-x-gbcwmd",
)
HELDOUT_ACCENTS = ("en-GB-x-gbcwmd",)
# espeak-ng variants (espeak-ng-data/voices/!v); "" is the accent's own voice
VARIANTS = (
    "",
    "m1",
    "m2",
    "m3",
    "m4",
    "m5",
    "m6",
    "m7",
    "m8",
    "f1",
    "f2",
    "f3",
    "f4",
    "f5",
    "klatt",
    "klatt2",
    "klatt3",
    "klatt4",
    "klatt5",
    "klatt6",
    "Alex",
    "Andy",
    "Annie",
    "adam",
    "anika",
    "aunty",
    "belinda",
    "benjamin",
    "caleb",
    "david",
    "ed",
    "edward",
    "grandma",
    "grandpa",
    "iven",
    "iven2",
    "john",
    "linda",
    "max",
    "michel",
    "norbert",
    "paul",
    "quincy",
    "rob",
    "robert",
    "steph",
    "steph2",
    "travis",
    "victor",
    "zac",
    "croak",
    "Gene",
    "Lee",
    "Michael",
    "Storm",
    "shelby",
    "Mike",
    "Jacky",
    "Hugo",
    "Reed",
    "Tweaky",
    "kaukovalta",
    "ian",
    "Alicia",
    "Andrea",
)
HELDOUT_VARIANTS = ("m6", "f4", "klatt3", "Andy", "linda", "steph2", "grandpa", "Storm", "anika", "Hugo")
TRAIN_VARIANTS = tuple(v for v in VARIANTS if v not in HELDOUT_VARIANTS)
TRAIN_ACCENTS = tuple(a for a in ACCENTS if a not in HELDOUT_ACCENTS)
HIBARI_SHARE = 0.2  # fraction of training examples spoken by hibari (the service's own voice)

_WORD_OK = re.compile(r"^[a-z']+$")


def normalize_text(text: str) -> str:
    """Lower case, letters and apostrophes only, single spaces: the form the ASR writes and WER compares."""
    text = text.lower().replace("’", "'").replace("-", " ")
    text = re.sub(r"[^a-z' ]+", " ", text)
    words = [w.strip("'") for w in text.split()]
    return " ".join(w for w in words if w)


def _clean_sentence(raw: str) -> str | None:
    """A sentence fit to be spoken and scored: no digits or symbols espeak would spell, 3-24 words."""
    raw = " ".join(raw.split())
    if not raw or re.search(r"[0-9@#$%&*_/\\<>=+|~^{}\[\]]", raw):
        return None
    words = normalize_text(raw).split()
    if not 3 <= len(words) <= 24 or not all(_WORD_OK.match(w) for w in words):
        return None
    return raw


def _wordnet_sentences() -> Iterator[str]:
    for path in sorted(glob.glob(os.path.join(WORDNET_DIR, "data.*"))):
        with open(path, encoding="latin-1") as f:
            for line in f:
                if line.startswith("  "):
                    continue  # licence header
                yield from re.findall(r'"([^"]+)"', line)


def _fortune_sentences() -> Iterator[str]:
    for path in sorted(glob.glob(os.path.join(FORTUNE_DIR, "*"))):
        if path.endswith((".dat", ".u8")) or os.path.islink(path) or not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="ignore") as f:
            for entry in f.read().split("\n%\n"):
                if "--" in entry:
                    entry = entry.split("--")[0]  # drop the attribution
                yield from re.split(r"(?<=[.!?])\s+", " ".join(entry.split()))


def _chatterbot_sentences() -> Iterator[str]:
    try:
        import chatterbot_corpus
        import yaml
    except ImportError:
        return
    root = os.path.join(os.path.dirname(chatterbot_corpus.__file__), "data", "english")
    for path in sorted(glob.glob(os.path.join(root, "*.yml"))):
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f) or {}
        for conv in doc.get("conversations", []):
            for line in conv:
                if isinstance(line, str):
                    yield from re.split(r"(?<=[.!?])\s+", line)


def _dialogue_sentences() -> Iterator[str]:
    for name in ("turn_generated.jsonl", "turn_eval.jsonl", "relay_eval.jsonl"):
        path = DIALOGUE_DATA / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            for key in ("text", "prompt", "user", "line"):
                if isinstance(rec.get(key), str):
                    yield from re.split(r"(?<=[.!?])\s+", rec[key])


def is_heldout_text(sentence: str) -> bool:
    """1 sentence in 20, by a hash of its normalised words, is held out of training."""
    digest = hashlib.sha1(normalize_text(sentence).encode()).digest()
    return digest[0] % 20 == 0


@functools.cache
def corpus() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(train sentences, held-out sentences), deduplicated by normalised text, in a fixed order."""
    seen: set[str] = set()
    train: list[str] = []
    heldout: list[str] = []
    sources = (_wordnet_sentences(), _fortune_sentences(), _chatterbot_sentences(), _dialogue_sentences())
    for source in sources:
        for raw in source:
            sentence = _clean_sentence(raw)
            if sentence is None:
                continue
            key = normalize_text(sentence)
            if key in seen:
                continue
            seen.add(key)
            (heldout if is_heldout_text(sentence) else train).append(sentence)
    if not train:
        raise RuntimeError(
            "no training text found: install Debian's wordnet-base and fortunes "
            "(apt-get install wordnet-base fortunes) or chatterbot-corpus"
        )
    return tuple(train), tuple(heldout)


HELDOUT_FILE = DATA_ROOT / "asr" / "heldout_sentences.txt"


def heldout_sentences() -> tuple[str, ...]:
    """The held-out sentences as shipped (data/asr/heldout_sentences.txt, written from `corpus()` when the
    model was trained), so evaluation needs neither the text packages nor a rebuild of the corpus."""
    if HELDOUT_FILE.is_file():
        return tuple(line for line in HELDOUT_FILE.read_text().splitlines() if line.strip())
    return corpus()[1]


@dataclass(frozen=True)
class VoiceSpec:
    """Who speaks an example and how: `engine` 'espeak' (voice 'accent+variant') or 'hibari'."""

    engine: str
    voice: str = ""
    rate: int = 175
    pitch: int = 50
    pitch_range: int = 50
    word_gap: int = 0
    speed: float = 1.0

    def name(self) -> str:
        return "hibari" if self.engine == "hibari" else self.voice


def espeak_name(accent: str, variant: str) -> str:
    return f"{accent}+{variant}" if variant else accent


EASY_VARIANTS = ("", "m1", "m3", "f1", "f2")  # the curriculum's first voices: plain en-US variants


def random_voice(rng: np.random.Generator, heldout: bool = False, easy: bool = False) -> VoiceSpec:
    """A random speaker: held-out voices only when `heldout`, otherwise training voices and hibari;
    `easy`: hibari or a plain en-US espeak voice at a moderate rate (the curriculum's start)."""
    if easy:
        if rng.random() < 0.4:
            return VoiceSpec("hibari", speed=float(rng.uniform(0.9, 1.1)))
        variant = EASY_VARIANTS[rng.integers(len(EASY_VARIANTS))]
        return VoiceSpec("espeak", espeak_name("en-US", variant), rate=int(rng.integers(150, 191)))
    if not heldout and rng.random() < HIBARI_SHARE:
        return VoiceSpec("hibari", speed=float(rng.uniform(0.85, 1.2)))
    if heldout:
        # a held-out voice: a held-out variant with any accent, or the held-out accent with any variant
        if rng.random() < 0.75:
            accent, variant = (
                ACCENTS[rng.integers(len(ACCENTS))],
                HELDOUT_VARIANTS[rng.integers(len(HELDOUT_VARIANTS))],
            )
        else:
            accent, variant = (
                HELDOUT_ACCENTS[rng.integers(len(HELDOUT_ACCENTS))],
                VARIANTS[rng.integers(len(VARIANTS))],
            )
    else:
        accent, variant = (
            TRAIN_ACCENTS[rng.integers(len(TRAIN_ACCENTS))],
            TRAIN_VARIANTS[rng.integers(len(TRAIN_VARIANTS))],
        )
    return VoiceSpec(
        "espeak",
        espeak_name(accent, variant),
        rate=int(rng.integers(135, 221)),
        pitch=int(rng.integers(25, 76)),
        pitch_range=int(rng.integers(20, 91)),
        word_gap=int(rng.integers(0, 3)) if rng.random() < 0.3 else 0,
    )


class Speaker:
    """Synthesises a VoiceSpec at 16 kHz (espeak-ng and hibari are loaded on first use)."""

    def __init__(self) -> None:
        self._espeak = None
        self._hibari = None

    def speak(self, text: str, spec: VoiceSpec) -> np.ndarray:
        return self.speak_words(text, spec)[0]

    def speak_words(self, text: str, spec: VoiceSpec) -> tuple[np.ndarray, list[tuple[float, float]] | None]:
        """Audio at 16 kHz and, for espeak voices, each normalised word's (start, end) in seconds
        (`word_times`); None for hibari, which does not report where its words are."""
        audio, words, _ = self.speak_timed(text, spec)
        return audio, words

    def speak_timed(
        self, text: str, spec: VoiceSpec
    ) -> tuple[np.ndarray, list[tuple[float, float]] | None, list[tuple[str, float, float]] | None]:
        """`speak_words` plus espeak's phonemes as (mnemonic, start, end) seconds (None for hibari)."""
        if spec.engine == "hibari":
            from tts.hibari_tts import SAMPLE_RATE as HIBARI_RATE
            from tts.hibari_tts import HibariSynth

            if self._hibari is None:
                self._hibari = HibariSynth(threads=1)
            self._hibari.speed = float(spec.speed)  # read per call by synthesize()
            audio = self._hibari.synthesize(text)
            return resample(audio, HIBARI_RATE, SAMPLE_RATE).astype(np.float32), None, None
        from asr.training.espeak_voice import IsolatedEspeak

        if self._espeak is None:
            self._espeak = (
                IsolatedEspeak()
            )  # espeak-ng segfaults on rare inputs: keep that out of this process
        audio, events, phonemes = self._espeak.synthesize_timed(
            text,
            spec.voice,
            rate=spec.rate,
            pitch=spec.pitch,
            pitch_range=spec.pitch_range,
            word_gap=spec.word_gap,
        )
        audio = resample(audio, self._espeak.sample_rate, SAMPLE_RATE).astype(np.float32)
        total = audio.size / SAMPLE_RATE
        spans = [
            (name, t, phonemes[k + 1][1] if k + 1 < len(phonemes) else total)
            for k, (name, t) in enumerate(phonemes)
        ]
        return audio, word_times(text, events, audio), [s for s in spans if s[2] > s[1]]


def word_times(
    text: str, events: list[tuple[int, int, float]], audio: np.ndarray, threshold: float = 0.02
) -> list[tuple[float, float]] | None:
    """Each word of `normalize_text(text)` as (start, end) seconds in `audio` (16 kHz), from espeak's word
    events (character span, start time): a word ends at the last 10 ms of sound (RMS above `threshold`
    of the peak) before the next word starts. None when the events do not cover the words one to one."""
    starts: list[float] = []
    if events and normalize_text(text[: events[0][0]]):
        return None
    for k, (pos, _length, t) in enumerate(events):
        # the text up to the next event: espeak reports "well-known" as one word event at "well"
        n = len(normalize_text(text[pos : events[k + 1][0] if k + 1 < len(events) else len(text)]).split())
        starts.extend([t] * n)  # an event of several words: its span is split evenly below
    if not starts or len(starts) != len(normalize_text(text).split()):
        return None
    hop = SAMPLE_RATE // 100
    frames = audio[: audio.size // hop * hop].reshape(-1, hop)
    loud = np.sqrt(np.mean(frames.astype(np.float64) ** 2, axis=1)) > threshold * (
        np.max(np.abs(audio)) + 1e-9
    )
    total = audio.size / SAMPLE_RATE
    out: list[tuple[float, float]] = []
    i = 0
    while i < len(starts):
        j = i
        while j + 1 < len(starts) and starts[j + 1] == starts[i]:
            j += 1
        start = starts[i]
        nxt = starts[j + 1] if j + 1 < len(starts) else total
        a, b = int(start * 100), min(int(nxt * 100), loud.size)
        sound = np.flatnonzero(loud[a:b])
        end = (a + sound[-1] + 1) / 100 if sound.size else min(nxt, start + 0.1)
        end = max(end, start + 0.03)
        step = (end - start) / (j - i + 1)
        out.extend((start + k * step, start + (k + 1) * step) for k in range(j - i + 1))
        i = j + 1
    return out


def _trim(audio: np.ndarray, threshold: float = 1e-3) -> tuple[np.ndarray, int]:
    """`audio` without its leading and trailing near-silence, and the index of its first kept sample."""
    idx = np.flatnonzero(np.abs(audio) > threshold)
    return (audio[idx[0] : idx[-1] + 1], int(idx[0])) if idx.size else (audio, 0)


def _colored_noise(rng: np.random.Generator, n: int) -> np.ndarray:
    white = rng.standard_normal(n)
    kind = rng.integers(3)
    if kind == 0:
        return white
    spec = np.fft.rfft(white)
    f = np.arange(spec.size) + 1.0
    spec /= np.sqrt(f) if kind == 1 else f  # pink or brown
    out = np.fft.irfft(spec, n)
    return out / (out.std() + 1e-9)


def augment(audio: np.ndarray, rng: np.random.Generator, strength: float = 1.0) -> np.ndarray:
    """Speed perturbation, reverberation, leading/trailing silence, noise, telephone band and gain;
    `strength` scales how often each is applied (the curriculum starts light)."""
    return augment_timed(audio, rng, strength)[0]


def augment_timed(
    audio: np.ndarray, rng: np.random.Generator, strength: float = 1.0
) -> tuple[np.ndarray, float, float]:
    """`augment`, plus how it moved time: a moment t (s) of `audio` is at `offset + scale * t` in the result."""
    trimmed, first = _trim(audio)
    x = trimmed.astype(np.float64)
    scale = 1.0
    if rng.random() < 0.5 * strength:  # speed perturbation (changes pitch too), as Kaldi's 0.9/1.0/1.1
        factor = float(rng.uniform(0.9, 1.1))
        scale = 1.0 / factor
        import soxr

        x = soxr.resample(x, SAMPLE_RATE * factor, SAMPLE_RATE)
    if rng.random() < 0.3 * strength:  # synthetic room: exponentially decaying noise, RT60 0.1-0.6 s
        rt60 = rng.uniform(0.1, 0.6)
        n = int(rt60 * SAMPLE_RATE)
        t = np.arange(n) / SAMPLE_RATE
        rir = rng.standard_normal(n) * np.exp(-6.9 * t / rt60)
        rir[0] = 1.0 / rng.uniform(0.3, 1.0)  # direct path
        rir /= np.sqrt(np.sum(rir**2))
        x = np.fft.irfft(np.fft.rfft(x, x.size + n) * np.fft.rfft(rir, x.size + n), x.size + n)[
            : x.size + n // 2
        ]
    lead, tail = (int(rng.uniform(0.05, 0.6) * SAMPLE_RATE) for _ in range(2))
    x = np.concatenate([np.zeros(lead), x, np.zeros(tail)])
    if rng.random() < 0.6 * strength:
        snr_db = rng.uniform(5, 40)
        speech_power = np.mean(x[lead : x.size - tail] ** 2) + 1e-12
        x = x + _colored_noise(rng, x.size) * np.sqrt(speech_power / 10 ** (snr_db / 10))
    if rng.random() < 0.1 * strength:  # telephone band
        x = resample(resample(x.astype(np.float32), SAMPLE_RATE, 8000), 8000, SAMPLE_RATE).astype(np.float64)
    peak = np.max(np.abs(x)) + 1e-9
    x *= 10 ** (rng.uniform(-30, -1) / 20) / peak
    return x.astype(np.float32), lead / SAMPLE_RATE - scale * first / SAMPLE_RATE, scale


@dataclass(frozen=True)
class Example:
    text: str  # normalised transcript
    audio: np.ndarray  # float32, 16 kHz
    voice: str
    word_times: tuple[tuple[float, float], ...] | None = None  # each word's (start, end) s in `audio`
    phones: tuple[tuple[str, float, float], ...] | None = None  # espeak phonemes (mnemonic, start, end) s


def make_example(
    speaker: Speaker,
    sentences: tuple[str, ...],
    seed: int,
    index: int,
    heldout: bool = False,
    clean: bool = False,
    max_words: int = 0,
    strength: float = 1.0,
    easy: bool = False,
) -> Example:
    """Example `index` of the stream `seed`: a pure function of its arguments. `max_words` and
    `strength` are the curriculum: short sentences and light augmentation first."""
    rng = np.random.default_rng([seed, index, int(heldout)])
    sentence = (
        sentences[int(rng.integers(len(sentences)))] if not heldout else sentences[index % len(sentences)]
    )
    while max_words and len(sentence.split()) > max_words:
        sentence = sentences[int(rng.integers(len(sentences)))]
    from asr.training.espeak_voice import SynthesisCrash

    for _attempt in range(8):
        spec = random_voice(rng, heldout=heldout, easy=easy)
        try:
            audio, times, phones = speaker.speak_timed(sentence, spec)
            break
        except SynthesisCrash:
            continue  # another voice from the same stream: the example stays a pure function of its index
    else:
        raise RuntimeError(f"espeak-ng crashed on 8 voices saying {sentence!r}")
    if clean:
        trimmed, first = _trim(audio)
        offset, scale = 0.2 - first / SAMPLE_RATE, 1.0
        audio = np.concatenate([np.zeros(3200, np.float32), trimmed, np.zeros(4800, np.float32)])
        audio *= 0.5 / (np.max(np.abs(audio)) + 1e-9)
    else:
        audio, offset, scale = augment_timed(audio, rng, strength)
    moved = None if times is None else tuple((offset + scale * a, offset + scale * b) for a, b in times)
    moved_phones = (
        None if phones is None else tuple((p, offset + scale * a, offset + scale * b) for p, a, b in phones)
    )
    return Example(normalize_text(sentence), audio, spec.name(), moved, moved_phones)
