"""hibari 0.2.1 as a teacher: phonemes, per-phoneme durations, the six vocoder inputs and audio.

hibari's ONNX graph computes per-phoneme durations (25 ms units) and casts them at the node `/Cast_32`
just before its length regulator; we add that tensor as an extra graph output, so every frame of the
teacher's 80 Hz vocoder features (f0 [F]; lh, theta, ln, lr, phi [601, F]) comes with an exact alignment
(frames = 2 x sum(durations)) and no aligner is needed. The edited model is cached under
~/.cache/duplex/codec/. The node name is specific to hibari 0.2.1: other versions fail loudly.

Text: the same corpus and the same train/held-out split as the project's ASR recipe (WordNet examples,
fortunes, chatterbot-corpus; 1 sentence in 20 by a hash of its normalised words is held out), minus every
sentence of the shipped held-out file (data/asr/heldout_sentences.txt), which is evaluation only.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from asr.training.data import corpus, heldout_sentences, normalize_text

HIBARI_VERSION = "0.2.1"
DURATION_NODE = "/Cast_32"
DURATION_OUTPUT = "durations"
FEATURE_NAMES = ("lh", "theta", "ln", "lr", "phi", "f0")
FRAME_RATE = 80  # teacher feature frames per second (hop 300 at 24 kHz)
SAMPLE_RATE = 24000
HOP = 300
CACHE_DIR = Path(os.environ.get("DUPLEX_CACHE", Path.home() / ".cache" / "duplex")) / "codec"


class TeacherVersionError(RuntimeError):
    """The installed hibari is not the version whose graph this module knows how to edit."""


@dataclass(frozen=True)
class TeacherOutput:
    """One phoneme string through the teacher: ids [N] (with the 0 pads), durations [N] in 25 ms units,
    vocoder features at 80 Hz (f0 [F]; the others [601, F]) and, when asked for, 24 kHz audio."""

    phonemes: str
    ids: np.ndarray
    durations: np.ndarray
    f0: np.ndarray
    lh: np.ndarray
    theta: np.ndarray
    ln: np.ndarray
    lr: np.ndarray
    phi: np.ndarray
    audio: np.ndarray | None = None

    @property
    def frames(self) -> int:
        return int(self.f0.shape[0])


def _hibari_assets() -> Path:
    import hibari

    version = getattr(hibari, "__version__", "?")
    if version != HIBARI_VERSION:
        raise TeacherVersionError(
            f"hibari {version} is installed but the codec teacher edits the graph of hibari {HIBARI_VERSION} "
            f"(node {DURATION_NODE}); pin hibari-tts=={HIBARI_VERSION} or re-derive the node name"
        )
    return Path(hibari.__file__).resolve().parent / "assets"


def edited_model_path(cache_dir: Path = CACHE_DIR) -> Path:
    """hibari.onnx with the durations added as an extra output, cached (keyed by the source file's hash)."""
    import onnx

    src = _hibari_assets() / "hibari.onnx"
    digest = hashlib.sha256(src.read_bytes()).hexdigest()[:16]
    dst = cache_dir / f"hibari-{HIBARI_VERSION}-{digest}-durations.onnx"
    if dst.is_file():
        return dst
    model = onnx.load(str(src))
    nodes = [n for n in model.graph.node if n.name == DURATION_NODE]
    if len(nodes) != 1 or nodes[0].op_type != "Cast" or not nodes[0].input[0].startswith("/Clip"):
        raise TeacherVersionError(
            f"node {DURATION_NODE} (Cast of the clipped, rounded durations) not found in {src}: "
            f"the graph differs from hibari {HIBARI_VERSION}'s"
        )
    node = nodes[0]
    # rename via an Identity so the public output name says what it is
    model.graph.node.append(
        onnx.helper.make_node("Identity", [node.output[0]], [DURATION_OUTPUT], name="codec_teacher/durations")
    )
    model.graph.output.append(
        onnx.helper.make_tensor_value_info(DURATION_OUTPUT, onnx.TensorProto.INT64, None)
    )
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".tmp")
    onnx.save(model, str(tmp))
    os.replace(tmp, dst)
    return dst


class HibariTeacher:
    """The edited hibari graph + hibari's G2P and DSP. `threads`: onnxruntime intra-op threads."""

    def __init__(self, threads: int = 1) -> None:
        import onnxruntime as ort
        from hibari import Hibari

        path = edited_model_path()
        self.tts = Hibari(threads=threads)  # G2P, vocabulary, and the reference (unedited) graph
        so = ort.SessionOptions()
        so.intra_op_num_threads = so.inter_op_num_threads = threads
        so.log_severity_level = 3
        # every sentence has another shape: the CPU arena would keep growing (GBs over a training run)
        so.enable_cpu_mem_arena = False
        so.enable_mem_pattern = False
        self.sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        names = [o.name for o in self.sess.get_outputs()]
        if names != [*FEATURE_NAMES, DURATION_OUTPUT]:
            raise TeacherVersionError(f"unexpected outputs of the edited hibari graph: {names}")

    def phonemize(self, text: str) -> list[str]:
        """Phoneme strings (one per sentence) in hibari's alphabet."""
        return self.tts.phonemize(text)

    def ids(self, phonemes: str) -> list[int]:
        return self.tts.ids(phonemes)

    def run(self, phonemes: str, speed: float = 1.0, audio_seed: int | None = None) -> TeacherOutput:
        """Phoneme string -> durations + vocoder features (+ audio from hibari's DSP if audio_seed is given)."""
        from hibari import dsp

        ids = self.ids(phonemes)
        outs = self.sess.run(
            None, {"ids": np.asarray([ids], np.int64), "speed": np.asarray([speed], np.float32)}
        )
        lh, th, ln, lr, phi, f0 = (o[0] for o in outs[:6])
        dur = np.asarray(outs[6]).reshape(-1).astype(np.int64)
        audio = None
        if audio_seed is not None:
            audio = dsp.synth(lh, th, ln, lr, phi, f0, np.random.default_rng(audio_seed))
        return TeacherOutput(phonemes, np.asarray(ids, np.int64), dur, f0, lh, th, ln, lr, phi, audio)

    def synth(self, features: TeacherOutput | dict, seed: int = 0) -> np.ndarray:
        """hibari's own numpy DSP on (possibly modified) features -> 24 kHz float32 audio."""
        from hibari import dsp

        g = features if isinstance(features, dict) else features.__dict__
        return dsp.synth(
            g["lh"], g["theta"], g["ln"], g["lr"], g["phi"], g["f0"], np.random.default_rng(seed)
        )

    def text(self, text: str, speed: float = 1.0, audio_seed: int | None = 0) -> list[TeacherOutput]:
        """Every sentence of `text` through the teacher."""
        return [self.run(ps, speed, audio_seed) for ps in self.phonemize(text)]


def merged_noise(ln: np.ndarray, lr: np.ndarray) -> np.ndarray:
    """hibari's noise (exp(ln) Z, complex Gaussian) + free-phase branch (exp(lr) e^{i phi}) as one
    random-phase noise log-envelope of equal expected power."""
    a, b = 2.0 * ln.astype(np.float64), 2.0 * lr.astype(np.float64)
    m = np.maximum(a + math.log(2.0), b)
    return (0.5 * (m + np.log(np.exp(a + math.log(2.0) - m) + np.exp(b - m)))).astype(np.float32)


# -- text ---------------------------------------------------------------------------------------------
def training_sentences() -> list[str]:
    """Training text: the project's corpus (asr.training.data: WordNet glosses, fortunes, chatterbot and
    the dialogue data's caller lines), its training split minus anything in the held-out file."""
    train, _ = corpus()
    banned = {normalize_text(s) for s in heldout_sentences()}
    out = [s for s in train if normalize_text(s) not in banned]
    if not out:
        raise RuntimeError(
            "no training text found: install Debian's wordnet-base and fortunes "
            "(apt-get install wordnet-base fortunes) or chatterbot-corpus"
        )
    return out
