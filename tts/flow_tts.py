"""The project's own streaming voice: text deltas -> phrases -> hibari's G2P -> the flow model's codec latent,
chunk by chunk -> the speech codec's streaming decoder -> 24 kHz audio chunks of ~225 ms, each tagged with
exactly the words whose last sound it carries (so a barge-in knows what was heard to the chunk).

Per session the state is the phrase segmenter's and the codec decoder's (continuous over a response); each
phoneme utterance (a sentence of a phrase) gets a fresh `FlowState`. `step_batch` runs every session's
chunks in lock-step: one batched flow step and one batched codec step per round for all sessions whose next
chunk has the same length.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from codec.speech_codec import DecoderState, SpeechCodec
from duplex.base.config import ComponentConfig, ConfigError
from duplex.base.devices import check_device, check_threads, require_device, torch_threads
from duplex.base.errors import ModelError
from duplex.base.messages import TtsChunk, TtsInput
from duplex.base.phrases import PhraseSegmenter, PhraseState
from tts.flow_model import UNIT_SUBFRAMES, FlowConfig, FlowModel, FlowState

SAMPLE_RATE = 24000
WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
CODEC_WEIGHTS = Path(__file__).resolve().parents[1] / "codec" / "weights" / "speech_codec.safetensors"
TRAIN_HINT = (
    "train it with `python -m tts.training.train_flow --run ~/.cache/duplex/runs/flow/run1 --minutes 150` "
    "and export with `python -m tts.training.train_flow --run ~/.cache/duplex/runs/flow/run1 --export tts/weights`"
)
#: pauses as durations of the utterance's boundary pad tokens, in hibari units (25 ms). The leading pad is
#: what hibari gives it (~13 units): the model learnt to start speech after it, and a 1-unit lead made the
#: first word of every phrase unintelligible (held-out WER 41 % vs 11 %, docs/tts.md). Its audio is not
#: played: all but LEAD_KEEP_FRAMES codec frames of it are dropped (`Utterance.skip`).
LEAD_UNITS = 13
LEAD_KEEP_FRAMES = 1
PAUSE_UNITS = {"sentence": 10, "clause": 5, "none": 1}


def pause_kind(text: str) -> str:
    core = text.rstrip("\"')]}”’»")
    if core.endswith((".", "!", "?", "…")):
        return "sentence"
    if core.endswith((",", ";", ":")):
        return "clause"
    return "none"


class FrontEnd(Protocol):
    """Text -> phoneme ids: `sentences(text)` gives one id list per sentence (with hibari's 0 pads);
    `space_id` separates words inside an id list."""

    space_id: int

    def sentences(self, text: str) -> list[list[int]]: ...


class HibariFrontEnd:
    """hibari's G2P and vocabulary, without its acoustic model (the same ids the teacher saw)."""

    def __init__(self) -> None:
        try:
            from hibari import Hibari
            from hibari.g2p import G2P
        except ImportError:
            raise ModelError("the flow TTS uses hibari's G2P: pip install hibari-tts==0.2.1") from None
        import hibari

        self._split = Hibari.split_sentences
        vocab_path = Path(hibari.__file__).resolve().parent / "assets" / "vocab.json"
        self.vocab: dict[str, int] = json.loads(vocab_path.read_text(encoding="utf-8"))
        self.space_id = self.vocab[" "]
        self._g2p = G2P(british=False)
        # the G2P is not documented as thread-safe; it takes well under a millisecond per phrase
        self._lock = threading.Lock()

    def phonemes(self, text: str) -> list[str]:
        with self._lock:
            return [ps for ps in (self._g2p(s) for s in self._split(text)) if ps]

    def ids(self, phonemes: str) -> list[int]:
        return [0, *[self.vocab[c] for c in phonemes if c in self.vocab], 0]

    def sentences(self, text: str) -> list[list[int]]:
        return [self.ids(ps) for ps in self.phonemes(text)]


def _phoneme_words(ids: list[int], space_id: int) -> list[int]:
    """Word index (within this id list) of every position; -1 on pads and spaces."""
    out, w, seen = [], 0, False
    for i, t in enumerate(ids):
        if i in (0, len(ids) - 1) or t == space_id:
            if t == space_id and seen:
                w, seen = w + 1, False
            out.append(-1)
        else:
            out.append(w)
            seen = True
    return out


def word_map(text_words: list[str], counts: list[int], front: FrontEnd) -> list[int]:
    """Text word that each phoneme word (over all sentences, in order) belongs to. Phoneme words and text
    words usually pair one to one; numbers and symbols expand ("$5" -> "five dollars"), then each text word
    is phonemised alone to count its phoneme words, and if that still disagrees words are spread evenly."""
    total = sum(counts)
    n = len(text_words)
    if total == n:
        return list(range(n))
    per = [
        sum(len(set(w for w in _phoneme_words(ids, front.space_id) if w >= 0)) for ids in front.sentences(t))
        for t in text_words
    ]
    if sum(per) == total:
        return [i for i, k in enumerate(per) for _ in range(k)]
    return [min(n - 1, (j * n) // max(total, 1)) for j in range(total)]


@dataclass
class Utterance:
    """One sentence of a phrase, ready to stream: frame conditions, and the codec frame at which each of
    its words has been fully spoken (exclusive end)."""

    cond: torch.Tensor  # [1, N, dim]
    mu: torch.Tensor  # [1, N, D]
    words: list[str]
    word_end: list[int]
    word_ids: list[int]  # indices of `words` in the phrase
    skip: int = 0  # leading codec frames (the lead pad's silence) whose audio is dropped

    @property
    def frames(self) -> int:
        return int(self.cond.shape[1])


@dataclass
class FlowTtsState:
    """Per-response state: the phrase segmenter's, the codec decoder's (continuous over the response), and
    what is owed: utterances not yet fully spoken (`backlog`, the first one begun at `frame` with its flow
    state), and the count of utterances before them (the noise of each utterance depends on its index)."""

    phrases: PhraseState
    decoder: DecoderState | None = None
    utterances: int = 0
    backlog: list[Utterance] = field(default_factory=list)
    frame: int = 0
    flow: FlowState | None = None
    done_words: int = 0
    final: bool = False  # the response's last text has arrived (flush once the backlog is spoken)


@dataclass
class _Cursor:
    """One session's work inside one call: its utterances, where it is, what it has produced."""

    utterances: list[Utterance]
    decoder: DecoderState
    seed: int
    first_utterance: int  # utterances of this response before this call (each gets its own noise)
    u: int = 0
    frame: int = 0
    flow: FlowState | None = None
    chunks: list[TtsChunk] = field(default_factory=list)
    done_words: int = 0
    limit: int = 0  # chunks with speech to produce in this call (0: all)
    audible: int = 0  # chunks produced in this call that reach past their utterance's lead

    def next_n(self, chunk: int) -> int | None:
        if self.u >= len(self.utterances) or (self.limit and self.audible >= self.limit):
            return None
        return min(chunk, self.utterances[self.u].frames - self.frame)


class FlowTtsStage:
    """Streaming TTS stage over the flow model and the speech codec (`StreamingStage[FlowTtsState,
    TtsInput, list[TtsChunk]]`)."""

    kind = "tts"
    sample_rate = SAMPLE_RATE

    def __init__(
        self,
        model: FlowModel,
        codec: SpeechCodec,
        front: FrontEnd,
        *,
        steps: int = 4,
        chunk: int | None = None,
        seed: int = 0,
        speed: float = 1.0,
        snap: bool = True,
        first_phrase_words: int = 3,
        max_phrase_words: int = 12,
        chunks_per_call: int = 0,
        temperature: float = 1.0,
        device: str | torch.device = "cpu",
        front_on_cpu: bool = True,
        front_batch: bool = True,
        threads: int | None = None,
    ) -> None:
        if model.cfg.latent_dim != codec.cfg.latent_dim:
            raise ModelError(
                f"flow model predicts {model.cfg.latent_dim}-d latents but the codec takes {codec.cfg.latent_dim}"
            )
        if not 0.5 <= speed <= 2.0:
            raise ConfigError("tts option 'speed' must be in [0.5, 2.0]")
        #: where the flow's sampler and the codec run (the `gpu` profile: cuda). The front half (phoneme
        #: encoder, durations, length regulator) stays on the CPU: per phrase it is a few dozen tiny ops with
        #: host syncs, ~2 ms on one CPU core against ~5 ms of launches on a GPU (H200, docs/operations.md),
        #: and it keeps the rounded durations identical to the CPU voice's. Only its output moves.
        self.device = torch.device(device)
        self.front_device = torch.device("cpu") if front_on_cpu else self.device
        #: a step_batch runs every session's new phrases through the front half in one padded pass (False:
        #: session by session, the A/B of `duplex.bench.gpu_capacity --tts-front cpu-serial`)
        self.front_batch = bool(front_batch)
        same = self.front_device == self.device
        self.front_model = model.eval() if same else copy.deepcopy(model).eval()
        self.model, self.codec, self.front = model.eval().to(self.device), codec.eval().to(self.device), front
        # code frames between a latent frame and its audio (overlap-add + the vocoder's envelope delay)
        self.lag = -(-self.codec.cfg.output_delay // self.codec.cfg.samples_per_code)
        self.steps, self.seed, self.speed, self.snap = int(steps), int(seed), float(speed), bool(snap)
        if not 0.0 <= temperature <= 1.5:
            raise ConfigError("tts option 'temperature' must be in [0, 1.5]")
        self.temperature = float(temperature)  # scales the fixed noise the flow starts from
        self.chunk = int(chunk or model.cfg.chunk)
        #: 0: a call speaks every phrase that is ready; n: a response's first call returns after its first
        #: chunk and later calls after n chunks, owing the rest (`pending`), so speech starts after one chunk
        self.chunks_per_call = max(0, int(chunks_per_call))
        self.segmenter = PhraseSegmenter(first_phrase_words, max_phrase_words)
        #: torch intra-op threads around each call (None: the process's). The server's process has torch's
        #: default (one per core) while the dialogue engine's process takes a core of its own; two threads
        #: there made every chunk wait on the other's barrier (live RTF 0.21 against 0.066 alone, docs/tts.md)
        self.threads = check_threads(threads, "tts")
        self.meta: dict = {}  # the weights' metadata (step, data, command) when loaded from a folder

    def init_state(self) -> FlowTtsState:
        return FlowTtsState(phrases=self.segmenter.init_state())

    # -- front half: phrase -> utterances ---------------------------------------------------------------
    @torch.no_grad()
    def utterances(self, phrase: str) -> list[Utterance]:
        """G2P, durations (pauses set by punctuation), frame conditions and word ends for one phrase."""
        return self.utterances_batch([phrase])[0]

    @torch.no_grad()
    def utterances_batch(self, phrases: Sequence[str]) -> list[list[Utterance]]:
        """`utterances` for several phrases at once: G2P phrase by phrase, then one encoder, duration and
        length-regulator pass over every sentence of every phrase, padded (the encoder is causal with a
        fixed lookahead and padding reads as the end of a sentence, the regulator works frame by frame, so
        each sentence gets what it would alone, up to float rounding). A `step_batch` of many sessions'
        first phrases pays these small models' per-call cost once instead of once per phrase."""
        plans = []
        rows: list[tuple[int, int, list[int]]] = []  # (phrase, sentence, phoneme ids)
        for k, phrase in enumerate(phrases):
            sents = self.front.sentences(phrase)
            words = phrase.split()
            pw = [_phoneme_words(ids, self.front.space_id) for ids in sents]
            counts = [len({w for w in p if w >= 0}) for p in pw]
            plans.append((words, pw, counts, word_map(words, counts, self.front), len(sents)))
            rows.extend((k, si, list(ids)) for si, ids in enumerate(sents))
        out: list[list[Utterance]] = [[] for _ in phrases]
        if rows:
            fm, sub = self.front_model, self.model.cfg.subframes
            width = max(len(ids) for _, _, ids in rows)
            ids_t = torch.zeros(len(rows), width, dtype=torch.long)
            valid = torch.zeros(len(rows), width, dtype=torch.bool)
            for r, (_, _, ids) in enumerate(rows):
                ids_t[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                valid[r, : len(ids)] = True
            ids_t, valid = ids_t.to(self.front_device), valid.to(self.front_device)
            h = fm.encoder(ids_t, valid if len(rows) > 1 else None)
            units = fm.predict_units(h, self.speed)
            skip = max(0, int(LEAD_UNITS * UNIT_SUBFRAMES) // sub - LEAD_KEEP_FRAMES)
            for r, (k, si, ids) in enumerate(rows):
                last = si == plans[k][4] - 1
                units[r, len(ids) :] = 0  # padding: no frames
                units[r, 0] = LEAD_UNITS
                units[r, len(ids) - 1] = PAUSE_UNITS[pause_kind(phrases[k]) if last else "sentence"]
            cond = fm.regulate(h, units)
            base = [0] * len(phrases)
            for r, (k, si, ids) in enumerate(rows):
                words, pw, counts, owner, _ = plans[k]
                ends_sub = torch.cumsum(units[r, : len(ids)] * UNIT_SUBFRAMES, 0).tolist()
                end: dict[int, int] = {}
                for pos, w in enumerate(pw[si]):
                    if w >= 0:
                        tw = owner[min(base[k] + w, len(owner) - 1)]
                        end[tw] = max(end.get(tw, 0), -(-int(ends_sub[pos]) // sub))
                base[k] += counts[si]
                mine = sorted(end)
                n = int(cond.frames[r])
                c_dev = cond.cond[r : r + 1, :n].to(self.device)
                mu_dev = cond.mu[r : r + 1, :n].to(self.device)
                out[k].append(
                    Utterance(c_dev, mu_dev, [words[i] for i in mine], [end[i] for i in mine], mine, skip)
                )
        for k, utts in enumerate(out):
            _attach_unmapped(utts, plans[k][0])
        return out

    # -- back half: utterances -> chunks, batched over sessions ---------------------------------------------
    def _latent(self, y: torch.Tensor) -> torch.Tensor:
        return self.codec.fsq.snap(y) if self.snap else y

    def _advance(self, cur: _Cursor, audio: np.ndarray, n: int) -> None:
        """Record one decoded chunk: tag it with the words whose end it carries (`self.lag` frames of codec delay)."""
        utt = cur.utterances[cur.u]
        if utt.skip:
            # the codec's output lags its input by one frame: this audio is utterance frames frame-1 ..
            # frame+n-2; drop those in [0, skip) (the lead's silence), keep the previous utterance's tail
            hop = len(audio) // n if n else 0
            lo, hi = max(0, -(cur.frame - 1)), min(n, utt.skip - (cur.frame - 1))
            if hi > lo:
                audio = np.concatenate([audio[: lo * hop], audio[hi * hop :]])
        cur.frame += n
        last = cur.frame >= utt.frames
        if last or cur.frame > utt.skip + self.lag:  # the codec's frames of delay
            cur.audible += 1
        k = cur.done_words
        while k < len(utt.words) and (last or utt.word_end[k] + self.lag <= cur.frame):
            k += 1
        text = " ".join(utt.words[cur.done_words : k])
        cur.chunks.append(TtsChunk(audio=audio, text=text))
        cur.done_words = k
        if last:
            cur.u, cur.frame, cur.flow, cur.done_words = cur.u + 1, 0, None, 0

    @torch.no_grad()
    def _run(self, cursors: list[_Cursor]) -> None:
        while True:
            todo = [(c, c.next_n(self.chunk)) for c in cursors]
            todo = [(c, n) for c, n in todo if n]
            if not todo:
                return
            by_n: dict[int, list[_Cursor]] = {}
            for c, n in todo:
                by_n.setdefault(n, []).append(c)
            for n, group in by_n.items():
                for c in group:
                    if c.flow is None:
                        c.flow = self.model.init_state(
                            1,
                            self.steps,
                            self.chunk,
                            seed=c.seed + 7919 * (c.first_utterance + c.u),
                            device=self.device,
                        )
                flow = FlowState.stack([c.flow for c in group])  # type: ignore[misc]
                cond = torch.cat([c.utterances[c.u].cond[:, c.frame : c.frame + n] for c in group])
                mu = torch.cat([c.utterances[c.u].mu[:, c.frame : c.frame + n] for c in group])
                y, flow = self.model.step(flow, cond, mu, temperature=self.temperature)
                dec = DecoderState.stack([c.decoder for c in group])
                audio, dec = self.codec.decode_latent_step(dec, self._latent(y))
                samples = audio.float().cpu().numpy()  # one copy off the device per round
                for c, f, d, a in zip(group, flow.unbind(), dec.unbind(), samples, strict=True):
                    c.flow, c.decoder = f, d
                    self._advance(c, a.astype(np.float32), n)

    def _prepare(self, state: FlowTtsState, chunk: TtsInput, new: list[list[Utterance]]) -> _Cursor:
        """The session's cursor over its backlog and `new` (its new phrases' utterances)."""
        utts = [*state.backlog, *(u for p in new for u in p)]
        decoder = state.decoder if state.decoder is not None else self.codec.init_state(1, self.device)
        cur = _Cursor(utts, decoder, self.seed, state.utterances, frame=state.frame, flow=state.flow)
        cur.done_words = state.done_words
        if self.chunks_per_call and not chunk.whole:
            cur.limit = 1 if state.decoder is None else self.chunks_per_call
        return cur

    def _finish(
        self, state: FlowTtsState, cur: _Cursor, phrase_state: PhraseState, final: bool
    ) -> tuple[list[TtsChunk], FlowTtsState]:
        out = cur.chunks
        final = final or state.final
        owed = cur.u < len(cur.utterances)
        # a decoder that has decoded nothing is still the fresh one: keep None (the next call's first chunk)
        decoder: DecoderState | None = cur.decoder if (out or state.decoder is not None) else None
        if final and not owed and (state.decoder is not None or out):
            tail = self.codec.flush(cur.decoder)[0].float().cpu().numpy()
            if out:
                out[-1] = TtsChunk(np.concatenate([out[-1].audio, tail]), out[-1].text)
            else:
                out = [TtsChunk(tail, "")]
            decoder = None
        return out, FlowTtsState(
            phrases=phrase_state,
            decoder=decoder,
            utterances=state.utterances + cur.u,
            backlog=cur.utterances[cur.u :],
            frame=cur.frame,
            flow=cur.flow,
            done_words=cur.done_words,
            final=final,
        )

    def pending(self, state: FlowTtsState) -> bool:
        """True while the state owes audio for text already given (`IncrementalStage`)."""
        return bool(state.backlog)

    def step(self, state: FlowTtsState, chunk: TtsInput) -> tuple[list[TtsChunk], FlowTtsState]:
        """Add a text delta; synthesise the phrases that became ready (all of them, or `chunks_per_call`
        chunks with the rest owed: `pending`). The input state is not modified."""
        return self.step_batch([(state, chunk)])[0]

    def step_batch(
        self, items: list[tuple[FlowTtsState, TtsInput]]
    ) -> list[tuple[list[TtsChunk], FlowTtsState]]:
        """Several sessions at once: the flow and the codec run batched over their chunks, round by round."""
        with torch_threads(self.threads):
            return self._step_batch(items)

    def _step_batch(
        self, items: list[tuple[FlowTtsState, TtsInput]]
    ) -> list[tuple[list[TtsChunk], FlowTtsState]]:
        # every session's new phrases through the front half in one batch, then each session's cursor
        segmented = [self.segmenter.step(s.phrases, c.text, c.final) for s, c in items]
        per_item: list[list[list[Utterance]]] = []
        if self.front_batch:
            flat = self.utterances_batch([p for phrases, _ in segmented for p in phrases])
            for phrases, _ in segmented:
                per_item.append(flat[: len(phrases)])
                flat = flat[len(phrases) :]
        else:
            per_item = [self.utterances_batch(phrases) for phrases, _ in segmented]
        cursors = [self._prepare(s, c, new) for (s, c), new in zip(items, per_item, strict=True)]
        self._run(cursors)
        return [
            self._finish(s, cur, ps, c.final)
            for (s, c), cur, (_, ps) in zip(items, cursors, segmented, strict=True)
        ]


def _attach_unmapped(out: list[Utterance], words: list[str]) -> None:
    """Every text word is spoken by exactly one utterance: one no phoneme maps to ("&", a stray symbol)
    rides with the word before it (or opens the first utterance)."""
    mapped = {i for u in out for i in u.word_ids}
    for i in range(len(words)):
        if i in mapped or not out:
            continue
        target = out[0]
        for u in out:
            if any(j < i for j in u.word_ids):
                target = u
        k = sum(1 for j in target.word_ids if j < i)
        target.word_ids.insert(k, i)
        target.words.insert(k, words[i])
        target.word_end.insert(k, target.word_end[k - 1] if k else 0)


# -- loading ------------------------------------------------------------------------------------------------
def load_flow_model(path: Path) -> tuple[FlowModel, dict]:
    """A FlowModel from DIR/flow_model.safetensors + DIR/flow_model.json (dimensions in the json)."""
    st, meta_path = path / "flow_model.safetensors", path / "flow_model.json"
    if not st.is_file() or not meta_path.is_file():
        raise ModelError(
            f"flow TTS weights not found in {path} (flow_model.safetensors + flow_model.json); {TRAIN_HINT}"
        )
    from safetensors.torch import load_file

    meta = json.loads(meta_path.read_text())
    model = FlowModel(FlowConfig.from_dict(meta["config"]))
    model.load_state_dict({k: v.float() for k, v in load_file(str(st)).items()})
    return model.eval(), meta


def _flow_files(cfg: ComponentConfig) -> tuple[Path, Path, dict]:
    """(weights folder, codec file, metadata) for a `flow` component, checked: both present, codec's sha256."""
    path = Path(cfg.weights.get("path", WEIGHTS_DIR))  # {shipped: true} (or nothing): tts/weights
    if not path.is_absolute() and not path.is_dir():
        path = Path(__file__).resolve().parents[1] / path
    meta_path = path / "flow_model.json"
    if not (path / "flow_model.safetensors").is_file() or not meta_path.is_file():
        raise ModelError(
            f"flow TTS weights not found in {path} (flow_model.safetensors + flow_model.json); {TRAIN_HINT}"
        )
    meta = json.loads(meta_path.read_text())
    codec_path = Path(cfg.weights.get("codec", meta.get("codec_file", CODEC_WEIGHTS)))
    if not codec_path.is_absolute():  # relative to the weights folder, else to the repository
        inside = path / codec_path
        codec_path = inside if inside.is_file() else Path(__file__).resolve().parents[1] / codec_path
    if not codec_path.is_file():
        raise ModelError(
            f"speech codec weights not found at {codec_path}: the flow TTS decodes with the codec it was trained on "
            f"(python -m codec.training.train_codec ... --export codec/weights)"
        )
    check_codec(meta, codec_path)
    return path, codec_path, meta


def check_codec(meta: dict, codec_path: Path) -> None:
    """ModelError unless `codec_path` is the codec the flow model was trained on, or one with its latent.

    The file's sha256 must match `codec_sha256`; failing that, the fingerprint of its encoder
    (`codec_latent_sha256`), so a codec whose decoder alone was trained further still fits.
    """
    from codec.speech_codec import fits_codec

    want, want_latent = meta.get("codec_sha256"), meta.get("codec_latent_sha256")
    if not want or fits_codec(str(codec_path), want, want_latent):
        return
    if want_latent:
        raise ModelError(
            f"the flow model predicts the latent of codec encoder {want_latent[:12]}, but {codec_path} has another "
            f"encoder: retrain it on this codec ({TRAIN_HINT})"
        )
    import hashlib

    got = hashlib.sha256(codec_path.read_bytes()).hexdigest()
    raise ModelError(
        f"the flow model was trained on codec {want[:12]} but {codec_path} is {got[:12]}: retrain it "
        f"on this codec ({TRAIN_HINT})"
    )


def check_flow_weights(cfg: ComponentConfig) -> tuple[str, str]:
    """For `duplex models`: (where, what) of a flow component's weights, or ModelError naming what is wrong."""
    path, codec_path, meta = _flow_files(cfg)
    size = (path / "flow_model.safetensors").stat().st_size + codec_path.stat().st_size
    return str(path), f"flow step {meta.get('step', '?')} + codec {codec_path.name} ({size / 1e6:.1f} MB)"


def load_flow_tts_stage(cfg: ComponentConfig) -> FlowTtsStage:
    """Build the stage from the models.yaml `tts` component (backend `flow`)."""
    if cfg.backend != "flow":
        raise ConfigError(f"component {cfg.name!r}: unknown TTS backend {cfg.backend!r} for the flow stage")
    from codec.speech_codec import load_codec

    opts = cfg.options
    device = str(opts.get("device", "cpu"))
    check_device(device, what="tts")
    threads = check_threads(opts.get("threads"), "tts")
    target = require_device(device, what="tts")
    path, codec_path, _ = _flow_files(cfg)
    model, meta = load_flow_model(path)
    stage = FlowTtsStage(
        model,
        load_codec(str(codec_path)),
        HibariFrontEnd(),
        steps=int(opts.get("steps", 4)),
        chunk=int(opts.get("chunk_frames", model.cfg.chunk)),
        seed=int(opts.get("seed", 0)),
        speed=float(opts.get("speed", 1.0)),
        snap=bool(opts.get("snap", True)),
        first_phrase_words=int(opts.get("first_phrase_words", 3)),
        max_phrase_words=int(opts.get("max_phrase_words", 12)),
        chunks_per_call=int(opts.get("chunks_per_call", 0)),
        temperature=float(opts.get("temperature", 1.0)),
        device=target,
        threads=threads,
    )
    stage.meta = meta
    return stage
