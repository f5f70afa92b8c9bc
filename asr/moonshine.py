"""Moonshine base-en (the model files shipped in `moonshine_cpp`) as a segment-level ASR stage.

Moonshine is not a streaming model: each transcription re-reads the whole open segment. The session
asks for partials every `partial_interval_ms` and a final at end of turn; a new segment starts with
a fresh `init_state()`.

The package's own runtime (`libmoonshine.so`) is compiled for AVX-512 and dies with SIGILL on CPUs without
it (AMD EPYC with AVX2 only, most laptops), so it is never loaded: its encoder/decoder `.ort` files and
`tokenizer.bin` run here through PyPI's onnxruntime, which picks its kernels for the CPU it finds. Greedy
decoding with the decoder's key/value cache, as libmoonshine does.

Re-reading a segment is mostly re-decoding words already known: the state keeps the last transcript's
tokens, and the next transcription of the same segment (a later partial, or the final at the pause) feeds
them to the decoder as a *draft* in one call, keeps the longest prefix the decoder itself would have
chosen, and decodes greedily only from the first disagreement. The result is greedy decoding's (the draft
is checked token by token against the decoder's own argmax); a 12-token question's final costs the
encoder, one decoder call and a step or two for the words said since the last partial, instead of 13
decoder steps.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from asr.end_of_turn import WEIGHTS as END_OF_TURN_WEIGHTS
from asr.end_of_turn import EndOfTurnModel
from asr.ort_format import ort_to_onnx
from asr.ort_options import session_options
from asr.vad import ModelError, package_file
from duplex.base.audio import SAMPLE_RATE
from duplex.base.config import ComponentConfig, ConfigError
from duplex.base.messages import AsrChunk, AsrResult
from duplex.base.stage import SequentialBatchMixin

#: below ~1000 samples the encoder's convolutions get an empty input and onnxruntime *aborts the
#: process* (an uncaught C++ exception), so anything shorter than 0.1 s is answered without the model
MIN_SAMPLES = SAMPLE_RATE // 10
PIP_NAME = "moonshine-cpp==0.1.4"
MODEL_DIR = "models/base-en"
#: Moonshine's decoder special tokens
BOS, EOS, N_SPECIAL = 1, 2, 3
#: greedy decoding stops after this many tokens per second of audio (speech runs at ~3-4 tokens/s)
MAX_TOKENS_PER_SECOND = 6.0
_SPACE_MARK = "\u2581"  # sentencepiece's word-start mark


@dataclass
class AsrState:
    """The open segment's audio, kept as the chunks received; joined only when transcribed, and the
    tokens of its last transcript (the next transcription's draft)."""

    chunks: tuple[np.ndarray, ...] = ()
    n_samples: int = 0
    draft: tuple[int, ...] = ()

    def audio(self) -> np.ndarray:
        if not self.chunks:
            return np.zeros(0, np.float32)
        return self.chunks[0] if len(self.chunks) == 1 else np.concatenate(self.chunks)


def clean_text(text: str) -> str:
    """Strip and collapse whitespace."""
    return " ".join(text.split())


def load_tokenizer(path: str | os.PathLike[str]) -> list[bytes]:
    """Token id -> bytes from Moonshine's `tokenizer.bin`.

    The file is the vocabulary in id order, each entry a length (one byte; two, little-endian base 128, when
    the first has its top bit set) followed by that many bytes. Byte-fallback tokens are single raw bytes, so
    joining a sequence's bytes and decoding UTF-8 once gives the text.
    """
    data = memoryview(open(path, "rb").read())
    tokens: list[bytes] = []
    i = 0
    while i < len(data):
        n = data[i]
        i += 1
        if n >= 0x80:
            if i >= len(data):
                raise ModelError(f"{path}: truncated length at byte {i}")
            n = (n & 0x7F) | (data[i] << 7)
            i += 1
        if i + n > len(data):
            raise ModelError(f"{path}: token {len(tokens)} runs past the end of the file")
        tokens.append(bytes(data[i : i + n]))
        i += n
    if len(tokens) <= N_SPECIAL:
        raise ModelError(f"{path}: only {len(tokens)} tokens")
    return tokens


def decode_tokens(tokens: list[bytes], ids: list[int]) -> str:
    """Text of token ids (special and out-of-vocabulary ids are dropped)."""
    raw = b"".join(tokens[i] for i in ids if N_SPECIAL <= i < len(tokens))
    return clean_text(raw.decode("utf-8", errors="replace").replace(_SPACE_MARK, " "))


def model_file(name: str, package: str = "moonshine_cpp") -> str:
    """Path of Moonshine base-en's file `name` inside the installed `package`."""
    pip_name = PIP_NAME if package == "moonshine_cpp" else package.replace("_", "-")
    return package_file(package, f"{MODEL_DIR}/{name}", pip_name)


def ort_session(path: str, threads: int):  # -> onnxruntime.InferenceSession
    """An onnxruntime session of a Moonshine `.ort` file on `threads` intra-op threads (a pool that sleeps
    between runs, asr/ort_options.py), loaded as ONNX, not .ort: see asr/ort_format.py (the dequantised
    weights are folded once: ~3x faster)."""
    import onnxruntime as ort

    return ort.InferenceSession(
        ort_to_onnx(path).SerializeToString(), session_options(threads), providers=["CPUExecutionProvider"]
    )


class MoonshineModel:
    """Moonshine base-en's encoder and decoder in onnxruntime, shared by all sessions and executor threads.

    onnxruntime's `run()` is thread-safe, so one pair of sessions serves every thread; `instances` bounds how
    many transcriptions run at once (more would only fight over the cores) and `threads` is each call's
    intra-op thread count.
    """

    def __init__(self, instances: int = 1, threads: int = 2, package: str = "moonshine_cpp") -> None:
        if instances < 1:
            raise ConfigError("asr option 'instances' must be >= 1")
        if threads < 1:
            raise ConfigError("asr option 'threads' must be >= 1")
        try:
            import onnxruntime  # noqa: F401  (here, for a clear error before any file is read)
        except ImportError:
            raise ModelError("the Moonshine ASR needs onnxruntime: pip install 'onnxruntime>=1.18'") from None
        pip_name = PIP_NAME if package == "moonshine_cpp" else package.replace("_", "-")
        encoder = model_file("encoder_model.ort", package)
        decoder = model_file("decoder_model_merged.ort", package)
        self.tokens = load_tokenizer(model_file("tokenizer.bin", package))
        try:
            self._encoder = ort_session(encoder, threads)
            self._decoder = ort_session(decoder, threads)
        except ModelError as exc:
            raise ModelError(f"{exc}; reinstall: pip install --force-reinstall {pip_name}") from None
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph types for damaged files
            raise ModelError(
                f"cannot load Moonshine base-en from {os.path.dirname(encoder)} ({exc}); "
                f"reinstall: pip install --force-reinstall {pip_name}"
            ) from None
        past = [i for i in self._decoder.get_inputs() if i.name.startswith("past_key_values.")]
        if not past or any(len(i.shape) != 4 for i in past):
            raise ModelError(f"{decoder}: not a Moonshine merged decoder (no 4-D past_key_values inputs)")
        self._past_shape = {i.name: (int(i.shape[1]), int(i.shape[3])) for i in past}  # heads, head size
        # the decoder returns `present.<layer>.<attention>.<key|value>` for each `past_key_values.<same>`
        self._past_names = [
            o.name.replace("present.", "past_key_values.", 1) for o in self._decoder.get_outputs()[1:]
        ]
        if sorted(self._past_names) != sorted(self._past_shape):
            raise ModelError(f"{decoder}: its present.* outputs do not match its past_key_values.* inputs")
        self._slots = threading.BoundedSemaphore(instances)
        self.threads = threads
        self.transcribe(np.zeros(SAMPLE_RATE, np.float32))  # warm-up: the first call is ~2x slower

    def transcribe(self, audio: np.ndarray) -> str:
        """Transcript of 16 kHz mono float32 audio; '' for audio shorter than 0.1 s."""
        return decode_tokens(self.tokens, self.transcribe_ids(audio))

    def transcribe_ids(self, audio: np.ndarray, draft: tuple[int, ...] | list[int] = ()) -> list[int]:
        """Greedy token ids of the audio's transcript (no BOS/EOS); [] for audio shorter than 0.1 s.

        `draft`: tokens that probably begin the transcript (an earlier transcript of the same segment). They
        are checked in one decoder call and only the prefix the decoder agrees with is kept, so the result
        is the same as without a draft; a good draft only makes it cheaper.
        """
        x = np.ascontiguousarray(audio, dtype=np.float32).reshape(-1)
        if x.size < MIN_SAMPLES:
            return []
        with self._slots:  # onnxruntime releases the GIL inside run(), so other sessions' Python work goes on
            return self._greedy(x, draft)

    def _greedy(self, x: np.ndarray, draft: tuple[int, ...] | list[int] = ()) -> list[int]:
        hidden = self._encoder.run(None, {"input_values": x[None, :]})[0]
        return self._decode(hidden, x.size, draft)

    def decode_frames(
        self, hidden: np.ndarray, n_samples: int, draft: tuple[int, ...] | list[int] = ()
    ) -> list[int]:
        """Greedy token ids from encoder frames [1, T, 416] that another encoder computed (the streaming one,
        asr/moonshine_stream.py) for `n_samples` of audio; the draft is checked as in `transcribe_ids`."""
        if n_samples < MIN_SAMPLES or hidden.shape[1] == 0:
            return []
        with self._slots:
            return self._decode(np.ascontiguousarray(hidden, dtype=np.float32), n_samples, draft)

    def decode_frames_constrained(
        self, hidden: np.ndarray, n_samples: int, allowed: Callable[[list[int]], Sequence[int]]
    ) -> list[int] | None:
        """Greedy decoding of encoder frames [1, T, 416] in which each next token is the decoder's choice
        among `allowed(ids so far)` (EOS among them ends it); None where nothing is allowed. Training uses it
        to spell a known transcript the way the decoder would (asr/training/forced.py)."""
        if n_samples < MIN_SAMPLES or hidden.shape[1] == 0:
            return None
        with self._slots:
            return self._run_decoder(np.ascontiguousarray(hidden, dtype=np.float32), n_samples, (), allowed)

    def _decode(
        self, hidden: np.ndarray, n_samples: int, draft: tuple[int, ...] | list[int] = ()
    ) -> list[int]:
        return self._run_decoder(hidden, n_samples, draft, None) or []

    def _run_decoder(
        self,
        hidden: np.ndarray,
        n_samples: int,
        draft: tuple[int, ...] | list[int],
        allowed: Callable[[list[int]], Sequence[int]] | None,
    ) -> list[int] | None:
        max_tokens = int(n_samples / SAMPLE_RATE * MAX_TOKENS_PER_SECOND) + 1
        if allowed is not None:
            max_tokens = 4 * max_tokens  # the transcript is known: the length cap is only a backstop

        def pick(row: np.ndarray, ids: list[int]) -> int | None:
            if allowed is None:
                return int(row.argmax())
            ok = np.fromiter(allowed(ids), np.int64)
            return int(ok[row[ok].argmax()]) if ok.size else None

        past = {
            name: np.zeros((1, heads, 0, size), np.float32)
            for name, (heads, size) in self._past_shape.items()
        }
        # the first call reads BOS and the draft at once: position i's logits are greedy decoding's choice
        # after the first i draft tokens, so the draft holds as far as each token is that choice
        prompt = [BOS, *(int(t) for t in draft[: max_tokens - 1] if N_SPECIAL <= int(t) < len(self.tokens))]
        feed: dict[str, np.ndarray] = {
            "input_ids": np.array([prompt], np.int64),
            "encoder_hidden_states": hidden,
            "use_cache_branch": np.array([False]),
            **past,
        }
        logits, *present = self._decoder.run(None, feed)
        choices = logits[0].argmax(-1)
        kept = 0
        while kept < len(prompt) - 1 and int(choices[kept]) == prompt[kept + 1]:
            kept += 1
        ids = prompt[1 : kept + 1]
        token = int(choices[kept]) if allowed is None else pick(logits[0, kept], ids)
        if token is None:
            return None
        for name, value in zip(self._past_names, present, strict=True):
            # the cross-attention keys/values are computed once, on the first call, and then reused; the
            # self-attention's keep BOS and the kept draft tokens only
            past[name] = value[:, :, : kept + 1] if ".decoder." in name else value
        while token != EOS and len(ids) < max_tokens:
            ids.append(token)
            if len(ids) == max_tokens:
                break
            feed = {
                "input_ids": np.array([[token]], np.int64),
                "encoder_hidden_states": hidden,
                "use_cache_branch": np.array([True]),
                **past,
            }
            logits, *present = self._decoder.run(None, feed)
            token = pick(logits[0, -1], ids)
            if token is None:
                return None
            for name, value in zip(self._past_names, present, strict=True):
                if ".decoder." in name:
                    past[name] = value
        return ids


class MoonshineAsrStage(SequentialBatchMixin[AsrState, AsrChunk, AsrResult]):
    """Segment ASR stage: buffers the open segment, transcribes all of it on request.

    The encoder takes no padding mask, so segments of different lengths cannot share a call: `step_batch`
    transcribes sessions in turn.
    """

    kind = "asr"
    streaming = False  # transcribes the whole segment on request
    sample_rate = SAMPLE_RATE

    def __init__(self, model: MoonshineModel, end_of_turn: EndOfTurnModel | None = None) -> None:
        self.model = model
        self.end_of_turn = end_of_turn  # the acoustic end-of-turn cue, given with each transcript

    def init_state(self) -> AsrState:
        return AsrState()

    def step(self, state: AsrState, chunk: AsrChunk) -> tuple[AsrResult, AsrState]:
        """Append `chunk.samples`; transcribe the whole segment if asked (`final` implies it).

        The input state is not modified.
        """
        x = np.asarray(chunk.samples, dtype=np.float32)
        if x.ndim != 1:
            raise ValueError(f"ASR expects mono 1-D float32 samples at 16 kHz, got shape {x.shape}")
        chunks = (*state.chunks, x.copy()) if x.size else state.chunks
        new_state = AsrState(chunks=chunks, n_samples=state.n_samples + x.size, draft=state.draft)
        seconds = new_state.n_samples / SAMPLE_RATE
        if not (chunk.transcribe or chunk.final):
            return AsrResult(None, False, seconds, 0.0), new_state
        audio = new_state.audio()
        t0 = time.perf_counter()
        ids = self.model.transcribe_ids(audio, state.draft)
        new_state = AsrState(chunks=(audio,) if audio.size else (), n_samples=audio.size, draft=tuple(ids))
        text = decode_tokens(self.model.tokens, ids)
        p_complete = (
            self.end_of_turn.p_complete(audio) if self.end_of_turn is not None and audio.size else None
        )
        return AsrResult(
            text, chunk.final, seconds, time.perf_counter() - t0, p_complete=p_complete
        ), new_state

    def restart_state(self, state: AsrState) -> AsrState:
        """A fresh state for transcribing the segment again from its start (the final at a pause) that keeps
        the last transcript's tokens as the draft (`RestartableStage`)."""
        return AsrState(draft=state.draft)


def load_end_of_turn(cfg: ComponentConfig) -> EndOfTurnModel | None:
    """The acoustic end-of-turn cue (asr.end_of_turn) an `asr` component asks for (`end_of_turn`, default on)."""
    if not cfg.options.get("end_of_turn", True):
        return None
    path = Path(str(cfg.options.get("end_of_turn_weights", END_OF_TURN_WEIGHTS)))
    if not path.exists():
        raise ConfigError(f"component {cfg.name!r}: no acoustic end-of-turn weights at {path}")
    return EndOfTurnModel.load(path)


def load_asr_stage(cfg: ComponentConfig) -> MoonshineAsrStage:
    """Build the ASR stage from the models.yaml `asr` component (backend `moonshine`)."""
    if cfg.backend != "moonshine":
        raise ConfigError(f"component {cfg.name!r}: unknown ASR backend {cfg.backend!r} (known: moonshine)")
    end_of_turn = load_end_of_turn(cfg)
    package = str(cfg.weights.get("package", "moonshine_cpp"))
    model = MoonshineModel(
        instances=int(cfg.options.get("instances", 1)),
        threads=int(cfg.options.get("threads", 2)),
        package=package,
    )
    return MoonshineAsrStage(model, end_of_turn)
