"""The `asr` stage on Moonshine's encoder streamed (asr/moonshine_stream.py) and Moonshine's own decoder.

Audio is encoded as it arrives, chunk by chunk (480 ms by default), with per-session caches; a partial or the
final decodes the frames so far with Moonshine's decoder, checking the last transcript as a draft (one decoder
call when nothing changed). So a final at the user's pause costs the last, short chunk of encoder work and the
decoder, never a pass over the whole segment. The encoder's frames are those of the packaged weights plus the
project's adapters (`asr/weights/moonshine_stream_lora.*`, asr/training/train_moonshine_stream.py) when they are
shipped, or the packaged weights alone (`adapters: false`).

States are never changed by a step (the session core keeps a partial's state while a speculative final runs
from it): each step copies the small per-session state it advances.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from asr.end_of_turn import EndOfTurnModel
from asr.moonshine import MoonshineModel, decode_tokens, load_end_of_turn
from duplex.base.audio import SAMPLE_RATE
from duplex.base.config import ComponentConfig, ConfigError
from duplex.base.devices import Threads, check_threads, torch_threads
from duplex.base.messages import AsrChunk, AsrResult

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
ADAPTERS = WEIGHTS_DIR / "moonshine_stream_lora.safetensors"


@dataclass(frozen=True)
class MoonshineStreamState:
    enc: Any = None  # asr.moonshine_stream.StreamState (copied, never changed, by each step)
    frames: tuple[np.ndarray, ...] = ()  # encoder frames so far, per step [n, 416]
    audio: tuple[np.ndarray, ...] = field(
        default=()
    )  # the segment's audio (for the acoustic end-of-turn cue)
    n_samples: int = 0
    draft: tuple[int, ...] = ()
    chunks: int = 0
    finished: bool = False


class MoonshineStreamAsrStage:
    """Streaming ASR stage (contract: duplex/base/stage.py): encoder chunk by chunk, Moonshine's decoder."""

    kind = "asr"
    sample_rate = SAMPLE_RATE
    streaming = True

    def __init__(
        self,
        encoder: Any,
        model: MoonshineModel,
        end_of_turn: EndOfTurnModel | None = None,
        threads: Threads = 1,
    ) -> None:
        import torch

        from asr.moonshine_stream import HOP

        self.hop = HOP  # samples per encoder frame
        self.encoder = encoder
        self.model = model
        self.end_of_turn = end_of_turn
        self._torch = torch
        self.threads = threads  # torch threads around the encoder's work (duplex.base.devices.torch_threads)

    def init_state(self) -> MoonshineStreamState:
        return MoonshineStreamState(enc=self.encoder.init_state())

    def step(self, state: MoonshineStreamState, chunk: AsrChunk) -> tuple[AsrResult, MoonshineStreamState]:
        x = np.asarray(chunk.samples, dtype=np.float32)
        if x.ndim != 1:
            raise ValueError(f"ASR expects mono 1-D float32 samples at 16 kHz, got shape {x.shape}")
        if state.finished:
            raise ValueError("this ASR stream was finalised; start a new one with init_state()")
        t0 = time.perf_counter()
        enc = copy.copy(state.enc)
        enc.keys, enc.values = list(enc.keys), list(enc.values)
        with self._torch.inference_mode(), torch_threads(self.threads):
            new = self.encoder.step(enc, self._torch.from_numpy(x)[None], final=bool(chunk.final))
        frames = state.frames + ((new[0].numpy(),) if new.shape[1] else ())
        n = state.n_samples + x.size
        audio = state.audio + ((x.copy(),) if x.size else ())
        new_state = MoonshineStreamState(
            enc, frames, audio, n, state.draft, state.chunks + int(new.shape[1] > 0), bool(chunk.final)
        )
        if not (chunk.transcribe or chunk.final):
            return AsrResult(
                None, False, n / SAMPLE_RATE, time.perf_counter() - t0, chunks=new_state.chunks
            ), new_state
        hidden = np.concatenate(frames)[None] if frames else np.zeros((1, 0, 416), np.float32)
        ids = self.model.decode_frames(hidden, n, state.draft)
        new_state = MoonshineStreamState(
            enc, frames, audio, n, tuple(ids), new_state.chunks, new_state.finished
        )
        heard = None if chunk.final else min(n, self.hop * sum(f.shape[0] for f in frames)) / SAMPLE_RATE
        p_complete = None
        if chunk.final and self.end_of_turn is not None and n:
            p_complete = self.end_of_turn.p_complete(np.concatenate(audio))
        return (
            AsrResult(
                decode_tokens(self.model.tokens, ids),
                bool(chunk.final),
                n / SAMPLE_RATE,
                time.perf_counter() - t0,
                chunks=new_state.chunks,
                p_complete=p_complete,
                heard_seconds=heard,
            ),
            new_state,
        )

    def step_batch(
        self, items: Sequence[tuple[MoonshineStreamState, AsrChunk]]
    ) -> list[tuple[AsrResult, MoonshineStreamState]]:
        return [self.step(s, c) for s, c in items]


def load_moonshine_stream_stage(cfg: ComponentConfig) -> MoonshineStreamAsrStage:
    """Build the stage from a models.yaml `asr` component with backend `moonshine-stream`."""
    from asr.moonshine_stream import load_packaged, merge_adapters

    if cfg.backend != "moonshine-stream":
        raise ConfigError(f"component {cfg.name!r}: backend {cfg.backend!r} is not moonshine-stream")
    opts = cfg.options
    chunk = int(opts.get("chunk_frames", 20))
    left = int(opts.get("left_frames", 250))
    if chunk < 1 or left < 0:
        raise ConfigError(f"component {cfg.name!r}: chunk_frames must be >= 1 and left_frames >= 0")
    encoder = load_packaged(chunk_frames=chunk, left_frames=left)
    adapters = cfg.weights.get("adapters", str(ADAPTERS)) if opts.get("adapters", True) else None
    if adapters:
        path = Path(str(adapters))
        if not path.exists():
            raise ConfigError(
                f"component {cfg.name!r}: no streaming adapters at {path} (or set adapters: false)"
            )
        from safetensors.torch import load_file

        meta = json.loads(path.with_suffix(".json").read_text())
        if int(meta["cfg"]["chunk_frames"]) != chunk:
            raise ConfigError(
                f"component {cfg.name!r}: the adapters were trained for chunk_frames {meta['cfg']['chunk_frames']}"
            )
        merge_adapters(encoder, load_file(str(path)), int(meta["cfg"]["rank"]), float(meta["cfg"]["alpha"]))
    end_of_turn = load_end_of_turn(cfg)
    model = MoonshineModel(instances=int(opts.get("instances", 1)), threads=int(opts.get("threads", 1)))
    threads = check_threads(opts.get("threads", 1), "asr")
    return MoonshineStreamAsrStage(encoder, model, end_of_turn, threads)
