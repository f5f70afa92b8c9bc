"""Cache-aware streaming ASR on NeMo FastConformer: constant cost per chunk, partial words within one
chunk plus lookahead, many sessions stepped as one batch.

Per session the stage keeps (in `StreamState`, owned by the session, never by the stage):
- a raw-audio tail and a feature-frame counter, so log-mel frames are computed incrementally and equal
  the offline preprocessor's frames exactly (`features_for` below explains the arithmetic);
- feature frames not yet consumed and the pre-encode cache (the last frames of the previous chunk);
- the encoder's activation caches (`cache_last_channel`, `cache_last_time`, `cache_last_channel_len`);
- the decoder's state: the CTC tokens so far with their frames, or the RNNT partial hypothesis.

`step_batch` stacks the caches of every session that has a chunk ready into one encoder call (sessions
in their first chunk and sessions with a final short chunk are grouped separately, since NeMo's first
chunk and last chunk have other sizes). Chunking follows NeMo's `CacheAwareStreamingAudioBuffer`, so
the outputs equal the model's full-context forward with the same `att_context_size`.

NeMo is imported only when a model is loaded.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from duplex.base.audio import SAMPLE_RATE
from duplex.base.config import ComponentConfig, ConfigError
from duplex.base.errors import ModelError
from duplex.base.messages import AsrChunk, AsrResult, Word

log = logging.getLogger("duplex.asr.nemo")


HOP = 160  # feature frame: 10 ms
HALF_FFT = 256  # NeMo pads n_fft // 2 (constant zeros) on both sides: frame t spans [160t - 256, 160t + 256)
CONTEXT = 2 * HOP  # a feature call starts 2 frames early so no frame we keep sees its edge
PIP_HINT = 'pip install -c constraints.txt "nemo-toolkit[asr]==3.0.0"'
SHIPPED = Path(__file__).resolve().parent / "weights" / "fc_small.nemo"


@dataclass(frozen=True)
class StreamState:
    """One session's streaming state. Steps return a new state; an input state is never changed."""

    tail: np.ndarray = field(default_factory=lambda: np.zeros(CONTEXT, np.float32))
    n_samples: int = 0
    next_frame: int = 0
    pending: Any = None  # torch [80, n] feature frames not yet given to the encoder
    pre_cache: Any = None  # torch [80, k] last frames of the previous chunk (the pre-encode cache)
    chunks: int = 0
    cache: tuple[Any, Any, Any] | None = None  # per-session encoder caches, batch dim 1
    enc_frames: int = 0
    tokens: tuple[int, ...] = ()
    token_frames: tuple[int, ...] = ()
    last_label: int = -1  # CTC: the previous frame's label, for collapsing repeats across chunks
    hyp: Any = None  # RNNT: the partial hypothesis
    finished: bool = False
    encoded: tuple[Any, ...] = ()  # encoder outputs per chunk, kept only when the model's keep_encoded is set


def complete_frames(n_samples: int) -> int:
    """Feature frames whose whole window has arrived after `n_samples` samples."""
    return 0 if n_samples < HALF_FFT else (n_samples - HALF_FFT) // HOP + 1


class NemoStreamingModel:
    """A loaded cache-aware streaming NeMo model at one lookahead, shared by all sessions."""

    def __init__(
        self,
        model: Any,
        att_context_size: list[int] | None = None,
        decoder: str = "auto",
        device: str = "cpu",
        eou_silence_ms: float = 640.0,
    ) -> None:
        import torch

        self.torch = torch
        self.model = model.to(device).eval()
        self.device = torch.device(device)
        enc = self.model.encoder
        contexts = [list(c) for c in getattr(enc, "att_context_size_all", [enc.att_context_size])]
        if att_context_size is None:
            att_context_size = list(enc.att_context_size)
        if list(att_context_size) not in contexts:
            raise ConfigError(
                f"att_context_size {att_context_size} is not one the model was trained with: {contexts}"
            )
        enc.set_default_att_context_size(list(att_context_size))
        enc.setup_streaming_params()
        self.att_context_size = list(att_context_size)
        self.cfg = enc.streaming_cfg
        self.subsampling = int(getattr(enc, "subsampling_factor", 8))
        self.frame_seconds = self.subsampling * HOP / SAMPLE_RATE
        self.lookahead_ms = 1000 * self.att_context_size[1] * self.frame_seconds
        self.chunk_ms = 1000 * (self.att_context_size[1] + 1) * self.frame_seconds
        has_rnnt = hasattr(self.model, "joint")
        if decoder == "auto":
            decoder = "rnnt" if has_rnnt else "ctc"
        if decoder == "rnnt" and not has_rnnt:
            raise ConfigError("decoder 'rnnt' needs an RNNT or hybrid RNNT/CTC model; this one is CTC")
        if decoder == "ctc" and not (hasattr(self.model, "ctc_decoder") or not has_rnnt):
            raise ConfigError("decoder 'ctc' needs a CTC or hybrid RNNT/CTC model; this one is RNNT only")
        if decoder not in ("ctc", "rnnt"):
            raise ConfigError(f"decoder must be 'ctc', 'rnnt' or 'auto', not {decoder!r}")
        self.decoder = decoder
        self.ctc_head = getattr(self.model, "ctc_decoder", None) if has_rnnt else self.model.decoder
        self.tokenizer = self.model.tokenizer
        self.blank = self.tokenizer.vocab_size
        self.eou_frames = max(1, round(eou_silence_ms / 1000 / self.frame_seconds))
        self.keep_encoded = False  # tests: keep every chunk's encoder output in the state
        self._word_start = self._word_start_table()

    def _word_start_table(self) -> list[bool]:
        starts = []
        for i in range(self.blank):
            piece = self.tokenizer.ids_to_tokens([i])[0]
            starts.append(piece.startswith("▁"))
        return starts

    # -- features ------------------------------------------------------------------------

    def features_for(self, state: StreamState, samples: np.ndarray, final: bool) -> tuple[StreamState, Any]:
        """New feature frames for `samples`, identical to the offline preprocessor's frames.

        Offline, frame t is the window centred on sample 160t (zeros beyond both ends), and an utterance
        of L samples has L // 160 frames. Here frame t is computed once samples up to 160t + 256 have
        arrived, from a call over [160 t0 - 320, 160 (t1-1) + 256) whose first two frames (touched by the
        call's own padding and pre-emphasis start) are dropped. `tail` holds the samples from 160 t0 - 320.
        """
        torch = self.torch
        x = np.asarray(samples, dtype=np.float32)
        tail = np.concatenate([state.tail, x]) if x.size else state.tail
        n = state.n_samples + x.size
        t0 = state.next_frame
        t1 = n // HOP if final else complete_frames(n)
        if final:
            tail = np.concatenate([tail, np.zeros(HALF_FFT + HOP, np.float32)])
        if t1 <= t0:
            return replace(state, tail=tail if not final else state.tail, n_samples=n), None
        seg_len = (t1 - t0 - 1) * HOP + CONTEXT + HALF_FFT
        seg = torch.from_numpy(np.ascontiguousarray(tail[:seg_len]))[None].to(self.device)
        with torch.inference_mode():
            feats, _ = self.model.preprocessor(
                input_signal=seg, length=torch.tensor([seg_len], device=self.device)
            )
        feats = feats[0, :, 2 : 2 + (t1 - t0)]
        return replace(state, tail=tail[(t1 - t0) * HOP :], n_samples=n, next_frame=t1), feats

    # -- chunking ------------------------------------------------------------------------

    def _chunk_sizes(self, first: bool) -> tuple[int, int, int]:
        """(chunk, shift, pre-encode cache) in feature frames for the first or a later chunk."""
        cfg = self.cfg

        def pick(v: Any) -> int:
            return int(v[0] if first else v[1]) if isinstance(v, (list, tuple)) else int(v)

        return pick(cfg.chunk_size), pick(cfg.shift_size), pick(cfg.pre_encode_cache_size)

    def initial_cache(self, batch: int = 1) -> tuple[Any, Any, Any]:
        c = self.model.encoder.get_initial_cache_state(
            batch_size=batch, dtype=self.torch.float32, device=self.device
        )
        return c[0], c[1], c[2]


@dataclass
class _Work:
    """One session's part of a batched step."""

    state: StreamState
    chunk: AsrChunk
    ready: list[tuple[Any, int, bool, bool]] = field(default_factory=list)  # (features, valid, first, last)
    started: float = 0.0


class NemoStreamingAsrStage:
    """The `asr` stage on a cache-aware streaming NeMo model (contract: duplex/base/stage.py)."""

    kind = "asr"
    sample_rate = SAMPLE_RATE
    streaming = True

    def __init__(self, model: NemoStreamingModel) -> None:
        self.m = model

    def init_state(self) -> StreamState:
        return StreamState()

    def step(self, state: StreamState, chunk: AsrChunk) -> tuple[AsrResult, StreamState]:
        return self.step_batch([(state, chunk)])[0]

    def step_batch(
        self, items: Sequence[tuple[StreamState, AsrChunk]]
    ) -> list[tuple[AsrResult, StreamState]]:
        torch = self.m.torch
        works: list[_Work] = []
        for state, chunk in items:
            x = np.asarray(chunk.samples, dtype=np.float32)
            if x.ndim != 1:
                raise ValueError(f"ASR expects mono 1-D float32 samples at 16 kHz, got shape {x.shape}")
            if state.finished:
                raise ValueError("this ASR stream was finalised; start a new one with init_state()")
            w = _Work(state, chunk, started=time.perf_counter())
            new_state, feats = self.m.features_for(state, x, bool(chunk.final))
            pending = new_state.pending
            if feats is not None:
                pending = feats if pending is None else torch.cat([pending, feats], dim=1)
            w.state = replace(new_state, pending=pending)
            self._cut_chunks(w)
            works.append(w)
        with torch.inference_mode():
            # round r: every session's r-th ready chunk, grouped by (first chunk?, length, last?)
            rounds = max((len(w.ready) for w in works), default=0)
            for r in range(rounds):
                groups: dict[tuple[bool, int, bool], list[_Work]] = {}
                for w in works:
                    if r < len(w.ready):
                        feats, valid, first, last = w.ready[r]
                        groups.setdefault((first, feats.shape[1], last), []).append(w)
                for (first, _, last), group in groups.items():
                    self._encode(group, r, first, last)
        results = []
        for w in works:
            state = w.state
            if w.chunk.final:
                state = replace(state, finished=True, pending=None, tail=np.zeros(0, np.float32))
            results.append((self._output(state, w), state))
        return results

    def _cut_chunks(self, w: _Work) -> None:
        """Move every complete chunk (and, when final, the short last one) from pending to ready."""
        torch = self.m.torch
        s = w.state
        pending, pre_cache, chunks = s.pending, s.pre_cache, s.chunks
        while pending is not None and pending.shape[1] > 0:
            first = chunks == 0
            size, shift, cache_size = self.m._chunk_sizes(first)
            if pending.shape[1] < size and not w.chunk.final:
                break
            body = pending[:, :size]
            valid = body.shape[1]
            if first:
                cache = torch.zeros(pending.shape[0], cache_size, device=pending.device)
            else:
                cache = pre_cache if pre_cache is not None else pending.new_zeros(pending.shape[0], 0)
                if cache.shape[1] < cache_size:
                    cache = torch.cat(
                        [cache.new_zeros(cache.shape[0], cache_size - cache.shape[1]), cache], dim=1
                    )
            last = bool(w.chunk.final) and pending.shape[1] <= size
            w.ready.append((torch.cat([cache, body], dim=1), cache.shape[1] + valid, first, last))
            # the next chunk's pre-encode cache: the frames just before it (NeMo's buffer[idx - k: idx])
            consumed = (
                torch.cat([pre_cache, pending[:, :shift]], dim=1)
                if pre_cache is not None
                else pending[:, :shift]
            )
            _, _, next_cache = self.m._chunk_sizes(False)
            pre_cache = consumed[:, -next_cache:] if next_cache else consumed[:, :0]
            pending = pending[:, shift:]
            chunks += 1
        w.state = replace(s, pending=pending, pre_cache=pre_cache, chunks=chunks)

    def _encode(self, group: list[_Work], r: int, first: bool, last: bool) -> None:
        torch = self.m.torch
        feats = torch.stack([w.ready[r][0] for w in group])
        lengths = torch.tensor([w.ready[r][1] for w in group], device=self.m.device)
        caches = [w.state.cache if w.state.cache is not None else self.m.initial_cache(1) for w in group]
        c_ch = torch.cat([c[0] for c in caches], dim=1)
        c_t = torch.cat([c[1] for c in caches], dim=1)
        c_len = torch.cat([c[2] for c in caches], dim=0)
        enc = self.m.model.encoder
        out = enc.cache_aware_stream_step(
            processed_signal=feats,
            processed_signal_length=lengths,
            cache_last_channel=c_ch,
            cache_last_time=c_t,
            cache_last_channel_len=c_len,
            keep_all_outputs=last,
            drop_extra_pre_encoded=0 if first else self.m.cfg.drop_extra_pre_encoded,
        )
        encoded, enc_len, n_ch, n_t, n_len = out
        if self.m.decoder == "ctc":
            log_probs = self.m.ctc_head(encoder_output=encoded)
            labels = log_probs.argmax(-1).tolist()
            for i, w in enumerate(group):
                s = w.state
                toks, frames, prev = list(s.tokens), list(s.token_frames), s.last_label
                for f, lab in enumerate(labels[i][: int(enc_len[i])]):
                    if lab != prev and lab != self.m.blank:
                        toks.append(lab)
                        frames.append(s.enc_frames + f)
                    prev = lab
                w.state = replace(s, tokens=tuple(toks), token_frames=tuple(frames), last_label=prev)
        else:
            prev_hyps = [w.state.hyp for w in group]
            hyps = self.m.model.decoding.rnnt_decoder_predictions_tensor(
                encoder_output=encoded,
                encoded_lengths=enc_len,
                return_hypotheses=True,
                partial_hypotheses=prev_hyps if any(h is not None for h in prev_hyps) else None,
            )
            if isinstance(hyps, tuple):
                hyps = hyps[0]
            for i, w in enumerate(group):
                h = hyps[i]
                toks = [
                    int(t)
                    for t in (h.y_sequence.tolist() if hasattr(h.y_sequence, "tolist") else h.y_sequence)
                ]
                old = len(w.state.tokens)
                # RNNT: new tokens are timed at the chunk's last frame (chunk resolution, not frame)
                frames = list(w.state.token_frames) + [w.state.enc_frames + max(int(enc_len[i]) - 1, 0)] * (
                    len(toks) - old
                )
                w.state = replace(w.state, hyp=h, tokens=tuple(toks), token_frames=tuple(frames[: len(toks)]))
        for i, w in enumerate(group):
            cache = (n_ch[:, i : i + 1].clone(), n_t[:, i : i + 1].clone(), n_len[i : i + 1].clone())
            kept = (
                w.state.encoded + (encoded[i, :, : int(enc_len[i])].clone(),) if self.m.keep_encoded else ()
            )
            w.state = replace(
                w.state, cache=cache, enc_frames=w.state.enc_frames + int(enc_len[i]), encoded=kept
            )

    def _output(self, state: StreamState, w: _Work) -> AsrResult:
        words: list[Word] = []
        pieces: list[list[int]] = []
        frames: list[tuple[int, int]] = []
        for tok, f in zip(state.tokens, state.token_frames, strict=False):
            if not pieces or self.m._word_start[tok]:
                pieces.append([tok])
                frames.append((f, f))
            else:
                pieces[-1].append(tok)
                frames[-1] = (frames[-1][0], f)
        fs = self.m.frame_seconds
        for ids, (f0, f1) in zip(pieces, frames, strict=False):
            text = self.m.tokenizer.ids_to_text(ids).strip()
            if text:
                words.append(Word(text, round(f0 * fs, 3), round((f1 + 1) * fs, 3)))
        trailing = state.enc_frames - (state.token_frames[-1] + 1) if state.token_frames else state.enc_frames
        text = " ".join(wd.word for wd in words)
        asked = w.chunk.transcribe or w.chunk.final
        return AsrResult(
            text=text if asked else None,
            is_final=bool(w.chunk.final),
            audio_seconds=state.n_samples / SAMPLE_RATE,
            compute_seconds=time.perf_counter() - w.started,
            words=tuple(words),
            eou=bool(words) and trailing >= self.m.eou_frames,
            trailing_silence_ms=round(1000 * trailing * fs, 1),
            chunks=state.chunks,
            no_words=not words and trailing >= self.m.eou_frames,
            heard_seconds=None
            if w.chunk.final
            else min(state.n_samples / SAMPLE_RATE, state.enc_frames * fs),
        )


def load_nemo_model(source: str | os.PathLike) -> Any:
    """A NeMo ASR model from a `.nemo` path, or by published name (which needs network access)."""
    try:
        logging.getLogger("nemo_logger").setLevel(logging.ERROR)
        from nemo.collections.asr.models import ASRModel
    except ImportError as exc:
        raise ModelError(f"the nemo-streaming ASR backend needs NeMo ({exc}): {PIP_HINT}") from None
    src = str(source)
    if src.endswith(".nemo") or os.path.sep in src:
        path = Path(src).expanduser()
        if not path.is_file():
            raise ModelError(f"NeMo checkpoint {path} does not exist")
        try:
            return ASRModel.restore_from(str(path), map_location="cpu")
        except Exception as exc:  # a corrupt or foreign file: say which
            raise ModelError(f"cannot load NeMo checkpoint {path}: {exc}") from exc
    try:
        return ASRModel.from_pretrained(src, map_location="cpu")
    except Exception as exc:
        raise ModelError(
            f"cannot load NeMo model {src!r} (published names need network access): {exc}"
        ) from exc


def load_streaming_asr_stage(cfg: ComponentConfig) -> NemoStreamingAsrStage:
    """Build the ASR stage from a models.yaml `asr` component with backend `nemo-streaming`.

    weights: {shipped: true} (asr/weights/fc_small.nemo), {path: x.nemo} or {name: stt_en_...}
    options: lookahead_ms (one of the model's, e.g. 0/80/480/1040), decoder (ctc|rnnt|auto), device,
    eou_silence_ms.
    """
    if cfg.backend != "nemo-streaming":
        raise ConfigError(f"component {cfg.name!r}: backend {cfg.backend!r} is not nemo-streaming")
    w = cfg.weights
    if w.get("path"):
        source: str | Path = Path(str(w["path"])).expanduser()
    elif w.get("name"):
        source = str(w["name"])
    elif w.get("shipped", False):
        source = SHIPPED
        if not SHIPPED.is_file():
            raise ModelError(
                f"component {cfg.name!r}: the project's streaming model {SHIPPED} is not trained yet; train it "
                "with `python -m asr.training.train_streaming` and `--export` (docs/asr.md), or point weights at "
                "{path: your.nemo} or {name: stt_en_fastconformer_hybrid_large_streaming_multi}"
            )
    else:
        raise ConfigError(f"component {cfg.name!r}: weights need one of shipped: true, path: or name:")
    opts = cfg.options
    device = str(opts.get("device", "cpu"))
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"component {cfg.name!r}: device {device!r} asked for but CUDA is not available"
            )
    model = load_nemo_model(source)
    enc = model.encoder
    lookahead_ms = opts.get("lookahead_ms")
    att = None
    if lookahead_ms is not None:
        frame_ms = 1000 * int(getattr(enc, "subsampling_factor", 8)) * HOP / SAMPLE_RATE
        contexts = [list(c) for c in getattr(enc, "att_context_size_all", [enc.att_context_size])]
        match = [c for c in contexts if abs(c[1] * frame_ms - float(lookahead_ms)) < 1e-6]
        if not match:
            have = ", ".join(f"{c[1] * frame_ms:g}" for c in contexts)
            raise ConfigError(
                f"component {cfg.name!r}: lookahead_ms {lookahead_ms} is not one of the model's ({have})"
            )
        att = match[0]
    return NemoStreamingAsrStage(
        NemoStreamingModel(
            model,
            att_context_size=att,
            decoder=str(opts.get("decoder", "auto")),
            device=device,
            eou_silence_ms=float(opts.get("eou_silence_ms", 640)),
        )
    )
