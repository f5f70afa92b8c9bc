"""Recipe 2's data: a pool of clean synthetic speech reused for a few epochs with cheap augmentation.

Synthesis is most of the data cost (Kokoro alone runs at RTF ~0.55 on one core); augmentation
(`data.augment_timed`: speed by soxr resampling, reverberation, silence, noise, telephone band, gain) is
~8 ms per example. So each data worker (shard w of W) synthesises a pool of `pool_size // W`
clean examples, trains `epochs` epochs on it, each epoch in a new order with new augmentation, while it
makes the next pool a slice after each batch (so no batch waits for a whole pool but the first).
Batches carry their targets, built in the worker: CTC token ids, and for espeak speech the
alignment-loss frames and dense phone labels (the encoder's frame count follows from the audio length,
`encoder_frames`).

Global batch i comes from shard i % W (torch's DataLoader takes workers in turn) as that shard's batch
i // W, and everything in it is a pure function of (seed, W, pool_size, epochs, batch_size, i): the data
position saved with a checkpoint is i, rounded down to a multiple of W on resume.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from duplex.base.audio import SAMPLE_RATE

SORT_GROUP = 4  # batches drawn together and sorted by length, so a batch pads little


def smooth_ramp(t: float, start: float, end: float) -> float:
    """0 before `start`, 1 after `end`, a smoothstep (no kink, no jump) between."""
    if end <= start:
        return float(t >= start)
    x = min(max((t - start) / (end - start), 0.0), 1.0)
    return x * x * (3 - 2 * x)


@dataclass(frozen=True)
class Schedule:
    """Recipe 2's ramps over t = steps since the recipe started (smooth, no step changes).

    The defaults continue a model that has learnt short and long sentences (the shipped one, trained to
    step 2476 with the alignment and phone losses at ~0.5): no word cap, augmentation 0.5 -> 1,
    SpecAugment 0 -> full, the alignment loss 0.5 -> 0.1, the dense phone loss 0.5 -> 0.2 (kept).
    A from-scratch run sets `words_from` (7) so sentences grow to any length over `words_ramp`."""

    words_from: int = 0
    words_ramp: tuple[int, int] = (0, 1500)
    strength: tuple[float, float] = (0.5, 1.0)
    strength_ramp: tuple[int, int] = (0, 2000)
    spec_ramp: tuple[int, int] = (500, 3000)
    align: tuple[float, float] = (0.5, 0.1)
    phone: tuple[float, float] = (0.5, 0.2)
    loss_ramp: tuple[int, int] = (0, 2000)

    def max_words(self, t: int) -> int:
        if not self.words_from:
            return 0
        r = smooth_ramp(t, *self.words_ramp)
        words = round(self.words_from + r * (24 - self.words_from))
        return 0 if words >= 24 else words

    def augment_strength(self, t: int) -> float:
        a, b = self.strength
        return a + (b - a) * smooth_ramp(t, *self.strength_ramp)

    def spec_scale(self, t: int) -> float:
        return smooth_ramp(t, *self.spec_ramp)

    def align_weight(self, t: int) -> float:
        a, b = self.align
        return a + (b - a) * smooth_ramp(t, *self.loss_ramp)

    def phone_weight(self, t: int) -> float:
        a, b = self.phone
        return a + (b - a) * smooth_ramp(t, *self.loss_ramp)


def lr_schedule(
    t: int, peak: float, warmup: int = 200, hold: int = 2000, total: int = 12000, floor: float = 0.05
) -> float:
    """AdamW's rate t steps into the recipe: linear re-warm over `warmup`, `hold` steps at `peak`, then a
    cosine to `floor * peak` at `total`, flat after."""
    t = max(t, 1)
    if t <= warmup:
        return peak * t / warmup
    if t <= warmup + hold:
        return peak
    done = min(1.0, (t - warmup - hold) / max(total - warmup - hold, 1))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * done)))


def encoder_frames(n_samples: int, subsampling: int = 8) -> int:
    """Encoder frames NeMo's preprocessor (10 ms hop, centred) and causal dw-striding subsampling give."""
    n = n_samples // 160 + 1
    for _ in range(int(round(math.log2(subsampling)))):
        n = n // 2 + 1
    return n


def scale_spec_augment(module, scale: float, base: dict[str, float]) -> bool:
    """Set NeMo's SpectrogramAugmentation masks to `scale` of `base` (counts and widths); False: off."""
    inner = getattr(module, "spec_augment", None)
    if inner is None or scale <= 0:
        return False
    inner.freq_masks = max(1, round(base["freq_masks"] * scale))
    inner.time_masks = max(1, round(base["time_masks"] * scale))
    inner.freq_width = max(1, round(base["freq_width"] * scale))
    inner.time_width = base["time_width"] * scale
    return True


@dataclass
class CleanExample:
    text: str  # normalised
    audio: np.ndarray  # float32 16 kHz, clean and trimmed
    voice: str
    engine: str
    word_times: tuple[tuple[float, float], ...] | None
    phones: tuple[tuple[str, float, float], ...] | None
    teacher: np.ndarray | None = None  # Moonshine's encoder frames of `audio` (distill.py), float16


def make_clean(
    synth, table, dictionary, conversational, seed: int, index: int, max_words: int = 0
) -> CleanExample:
    """Clean example `index` of stream `seed`: its text (conversational with CONVERSATIONAL_SHARE) and
    its speaker (drawn from `table`), rendered and trimmed; times relative to the trimmed audio."""
    from asr.training.data import _trim, normalize_text
    from asr.training.espeak_voice import SynthesisCrash
    from asr.training.speakers import CONVERSATIONAL_SHARE

    rng = np.random.default_rng([seed, index, 2])
    for _attempt in range(8):
        texts = conversational if conversational and rng.random() < CONVERSATIONAL_SHARE else dictionary
        sentence = texts[int(rng.integers(len(texts)))]
        while max_words and len(sentence.split()) > max_words:
            sentence = texts[int(rng.integers(len(texts)))]
        speaker = table.draw(rng)
        try:
            r = synth.render(sentence, speaker, rng)
        except (SynthesisCrash, OSError, RuntimeError):
            continue
        if r.audio.size < SAMPLE_RATE // 10:
            continue
        audio, first = _trim(r.audio)
        shift = first / SAMPLE_RATE
        times = None if r.word_times is None else tuple((a - shift, b - shift) for a, b in r.word_times)
        phones = None if r.phones is None else tuple((p, a - shift, b - shift) for p, a, b in r.phones)
        return CleanExample(
            normalize_text(sentence), audio.astype(np.float32), r.voice, speaker.engine, times, phones
        )
    raise RuntimeError(f"no voice could say example {index} of stream {seed}")


class PoolStream(torch.utils.data.IterableDataset):
    """Batches (dicts of tensors, targets included) from per-worker pools of clean speech; see the module doc."""

    def __init__(
        self,
        seed: int,
        batch_size: int,
        tokenizer_model: str,
        *,
        pool_size: int = 1024,
        epochs: int = 4,
        start_batch: int = 0,
        start_t: int = 0,
        schedule: Schedule | None = None,
        workers: int = 1,
        engines: tuple[str, ...] | None = None,
        example_offset: int = 0,
        teacher: bool = False,
    ) -> None:
        """`example_offset`: the stream's first example index, so a run that goes on from another run's
        export hears examples that run never made (a pure function of (seed, index)). `teacher`: each
        clean example also carries Moonshine's encoder features and each batch their distillation
        targets (asr/training/distill.py); the audio and every other target are unchanged."""
        self.seed, self.batch_size, self.tokenizer_model = seed, batch_size, tokenizer_model
        self.example_offset = example_offset
        self._key = [example_offset] if example_offset else []  # offset 0: the original streams, unchanged
        self.pool_size, self.epochs, self.workers = pool_size, epochs, max(workers, 1)
        self.start_batch = start_batch // self.workers * self.workers
        self.start_t = start_t - (start_batch - self.start_batch)
        self.schedule = schedule or Schedule()
        self.engines = engines
        self.teacher = teacher

    def examples_made(self, batches: int) -> int:
        """An upper bound on the example indices (from 0, offset excluded) a stream has made after
        `batches` batches: whole pools of every worker, the next pool (made ahead) included."""
        per_pool = self.epochs * self.batches_per_epoch() * self.workers
        return (batches // per_pool + 2) * self.shard_pool() * self.workers

    # the layout of a shard's stream
    def shard_pool(self) -> int:
        return max(self.pool_size // self.workers, self.batch_size)

    def batches_per_epoch(self) -> int:
        return self.shard_pool() // self.batch_size

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        w, n_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if n_workers != self.workers:
            raise RuntimeError(f"PoolStream built for {self.workers} workers, run with {n_workers}")
        torch.set_num_threads(1)
        import sentencepiece as spm

        from asr.training.speakers import (
            SpeakerTable,
            Synth,
            conversational_sentences,
            dictionary_sentences,
            training_speakers,
        )

        sp = spm.SentencePieceProcessor(model_file=self.tokenizer_model)
        synth, table = Synth(), SpeakerTable(training_speakers(self.engines))
        dictionary, conversational = dictionary_sentences(), conversational_sentences()
        per_pool = self.epochs * self.batches_per_epoch()
        teacher = None
        if self.teacher:
            from asr.training.distill import MoonshineTeacher

            teacher = MoonshineTeacher(threads=1)
        j = self.start_batch // self.workers
        n = self.shard_pool()

        def pool_example(k: int, q: int) -> CleanExample:
            # the word cap of pool k is the schedule's at the pool's first batch, whenever it is made
            t_k = self.start_t + (k * per_pool * self.workers + w - self.start_batch)
            words = self.schedule.max_words(t_k)
            first = self.example_offset + (k * self.workers + w) * n
            e = make_clean(synth, table, dictionary, conversational, self.seed, first + q, words)
            if teacher is not None:
                e.teacher = teacher.features(e.audio)
            return e

        pool_k, pool, gen_s, order_key, batches = -1, [], 0.0, None, []  # gen_s: synthesis since last batch
        ahead: list[CleanExample] = []  # the next pool, made a slice per batch so no batch waits for it
        while True:
            i = j * self.workers + w
            t = self.start_t + (i - self.start_batch)
            k, within = divmod(j, per_pool)
            epoch, b = divmod(within, self.batches_per_epoch())
            if k != pool_k:
                start = time.perf_counter()
                if pool_k != k - 1:
                    ahead = []  # started (or resumed) inside this pool: make it whole now
                pool = ahead + [pool_example(k, q) for q in range(len(ahead), n)]
                ahead, pool_k = [], k
                gen_s += time.perf_counter() - start
            if order_key != (k, epoch):
                batches = self._epoch_batches(pool, k, w, epoch)
                order_key = (k, epoch)
            rng = np.random.default_rng([self.seed, k, w, epoch, b, 3, *self._key])
            batch = build_batch([pool[q] for q in batches[b]], rng, self.schedule.augment_strength(t), sp)
            batch["batch_index"] = i
            batch["pool_gen_s"], gen_s = gen_s, 0.0
            yield batch
            start = time.perf_counter()
            for _ in range(min(-(-n // per_pool), n - len(ahead))):
                ahead.append(pool_example(k + 1, len(ahead)))
            gen_s += time.perf_counter() - start
            j += 1

    def _epoch_batches(self, pool: list[CleanExample], k: int, w: int, epoch: int) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, k, w, epoch, 4, *self._key])
        order = rng.permutation(len(pool))
        size, out = self.batch_size, []
        group = size * SORT_GROUP
        for g in range(0, len(order) - size + 1, group):
            members = sorted(order[g : g + group], key=lambda q: pool[q].audio.size)
            chunk = [members[c : c + size] for c in range(0, len(members) - size + 1, size)]
            out.extend(chunk[c] for c in rng.permutation(len(chunk)))
        return out[: self.batches_per_epoch()]


def build_batch(examples: list[CleanExample], rng: np.random.Generator, strength: float, sp) -> dict:
    """Augment each example, pad the audio and build every target (CTC ids, alignment frames, phones)."""
    from asr.training.data import augment_timed
    from asr.training.targets import alignment_targets, phone_targets

    audios, texts, times, phones, maps = [], [], [], [], []
    for e in examples:
        audio, offset, scale = augment_timed(e.audio, rng, strength)
        audios.append(audio)
        maps.append((offset, scale))
        texts.append(e.text)
        times.append(
            None
            if e.word_times is None
            else [(offset + scale * a, offset + scale * b) for a, b in e.word_times]
        )
        phones.append(
            None
            if e.phones is None
            else [(p, offset + scale * a, offset + scale * b) for p, a, b in e.phones]
        )
    lengths = [a.size for a in audios]
    audio = torch.zeros(len(audios), max(lengths))
    for i, a in enumerate(audios):
        audio[i, : a.size] = torch.from_numpy(a)
    ids = [sp.encode_as_ids(t) for t in texts]
    targets = torch.zeros(len(ids), max(max(len(t) for t in ids), 1), dtype=torch.long)
    for i, t in enumerate(ids):
        targets[i, : len(t)] = torch.tensor(t, dtype=torch.long)
    frames = [encoder_frames(n) for n in lengths]
    pieces = [[sp.id_to_piece(x) for x in t] for t in ids]
    extra = {}
    if examples and all(e.teacher is not None for e in examples):
        from asr.training.distill import student_targets

        n = max(frames)
        dim = examples[0].teacher.shape[1]  # type: ignore[union-attr]
        teach = torch.zeros(len(examples), n, dim, dtype=torch.float16)
        tmask = torch.zeros(len(examples), n, dtype=torch.bool)
        for i, (e, (offset, scale)) in enumerate(zip(examples, maps, strict=True)):
            tg, m = student_targets(e.teacher, offset, scale, frames[i], e.audio.size / SAMPLE_RATE)  # type: ignore[arg-type]
            teach[i, : frames[i]] = torch.from_numpy(tg)
            tmask[i, : frames[i]] = torch.from_numpy(m)
        extra = {"teacher": teach, "teacher_mask": tmask}
    return {
        "audio": audio,
        "lengths": torch.tensor(lengths),
        "targets": targets,
        "target_lengths": torch.tensor([len(t) for t in ids]),
        "align": alignment_targets(pieces, times, frames, sp.get_piece_size(), ids),
        "phones": phone_targets(phones, frames),
        "texts": texts,
        "engines": [e.engine for e in examples],
        **extra,
    }
