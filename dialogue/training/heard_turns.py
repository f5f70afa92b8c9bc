"""Turn-taking examples as the ASR hears them: each text spoken and transcribed once, cached.

    python -m dialogue.training.heard_turns [--limit N] [--splits val,heldout,train]

The turn head decides on the ASR's transcript at a pause, not on typed text. Spoken and transcribed,
a mid-sentence cut comes back with a full stop and sometimes with its last word turned into another
("What a thing to" -> "What a thing, too."; "interacting with my" -> "interacting with Mai."), and a
head trained on typed text takes such pauses over: 20 % of 100 held-out pauses on synthesised speech
against 6.4 % on their text (`duplex eval dialogue --speech 200`, 2026-11-25). So every turn-head
example is also spoken (hibari at speed 0.9-1.15 for 70 % of the texts, else a plain en-US espeak-ng voice
at 150-190 wpm: `voice_for`) and transcribed by the `cpu` profile's ASR (Moonshine);
`turn_data.build_examples(heard=True)` adds the transcript as an example with the same label and
group (so the same split), kind `<kind>+heard`.

A second voice set (`--voice-set 1`) speaks every text again in the natural training voices of the
streaming ASR (`asr.training.speakers.training_speakers`): flite kal/awb/rms, Kokoro blends and hibari
with its F0 and vocal tract edited, never the held-out flite `slt` or Kokoro blend that `duplex eval
eot` listens with. Those voices trip Moonshine in other places than hibari does: a complete question's
last word swallowed, a cut sentence closed with a full stop. Each text then has up to two transcripts,
and each that differs in its words is an example (`turn_data.heard_variants`).

The transcripts are kept in `data/dialogue/turn_heard.jsonl` (text, heard, voice, set), written as they
are made, so a run resumes where it stopped and `train_turn` reads them without running a model. Each
text's voice is a pure function of the text and the set (seeded hash), so a rerun makes the same rows.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dialogue.training import turn_data as D
from dialogue.training.turn_data import HEARD_FILE, read_heard

SPLIT_ORDER = ("val", "heldout", "train")  # validation first: the thresholds are tuned there
VOICE_SETS = {
    0: "hibari and plain en-US espeak-ng",
    1: "the natural training voices: flite, Kokoro, hibari edited",
}
#: set 1's engine shares: flite is cheap, Kokoro ~65x slower than hibari on a CPU core
NATURAL_SHARES = {"flite": 0.45, "kokoro": 0.25, "hibari": 0.30}


def _voice_rng(text: str, seed: int) -> np.random.Generator:
    h = int.from_bytes(hashlib.sha256(f"heard:{seed}:{text}".encode()).digest()[:8], "big")
    return np.random.default_rng(h)


def voice_for(text: str, seed: int = 0) -> Any:
    """Who says a text: hibari (70 %, speed 0.9-1.15) or a plain en-US espeak-ng voice; a pure function
    of the text. Moonshine hears espeak's robotic voices much worse than people, so they are the minority."""
    from asr.training.data import VoiceSpec, random_voice

    rng = _voice_rng(text, seed)
    if rng.random() < 0.7:
        return VoiceSpec("hibari", speed=float(rng.uniform(0.9, 1.15)))
    return random_voice(rng, easy=True)


def natural_voice_for(text: str, seed: int = 0) -> Any:
    """Voice set 1: a natural training voice of the streaming ASR (never a held-out one), drawn by
    `NATURAL_SHARES` over the engines installed here; a pure function of the text."""
    from asr.training.speakers import available_engines

    engines = tuple(e for e in available_engines() if e in NATURAL_SHARES)
    if not engines:
        raise RuntimeError("voice set 1 needs flite, Kokoro or hibari: `make asr-voices`")
    table = _natural_table(engines)
    return table.draw(_voice_rng(text, seed * 1000 + 1))


@functools.cache
def _natural_table(engines: tuple[str, ...]) -> Any:
    from asr.training.speakers import SpeakerTable, training_speakers

    return SpeakerTable(training_speakers(engines), dict(NATURAL_SHARES))


def transcribe_all(
    texts: Sequence[str],
    path: Path = HEARD_FILE,
    seed: int = 0,
    progress: bool = True,
    limit_s: float | None = None,
    voice_set: int = 0,
) -> int:
    """Speak and transcribe (in `voice_set`) the texts not yet in `path` for that set; append each row
    as it is made. Returns rows added."""
    from tqdm.auto import tqdm

    from asr.moonshine import load_asr_stage
    from asr.training.data import Speaker
    from asr.training.speakers import Synth
    from duplex.base.config import load_profile
    from duplex.base.messages import AsrChunk

    if voice_set not in VOICE_SETS:
        raise ValueError(f"voice set {voice_set} is not one of {sorted(VOICE_SETS)}")
    done = read_heard(path, voice_set)
    todo = [t for t in dict.fromkeys(texts) if t not in done]
    if not todo:
        return 0
    asr = load_asr_stage(load_profile("cpu").component("asr"))
    speaker = Speaker()
    synth = Synth()
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    added = 0
    with path.open("a") as f:
        for text in tqdm(todo, desc="speak + transcribe", disable=not progress):
            if limit_s is not None and time.time() - t0 > limit_s:
                break
            if voice_set == 0:
                spec = voice_for(text, seed)
                audio, voice = speaker.speak(text, spec), spec.name()
            else:
                who = natural_voice_for(text, seed)
                audio = synth.render(text, who, _voice_rng(text, seed * 1000 + 2)).audio
                voice = who.name
            out, _ = asr.step(asr.init_state(), AsrChunk(samples=audio, transcribe=True, final=True))
            heard = str(getattr(out, "text", "") or "").strip()
            row = {"text": text, "heard": heard, "voice": voice} | ({"set": voice_set} if voice_set else {})
            f.write(json.dumps(row) + "\n")
            f.flush()
            added += 1
    return added


def main(argv: Sequence[str] | None = None) -> int:

    ap = argparse.ArgumentParser(
        prog="python -m dialogue.training.heard_turns", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--splits", default=",".join(SPLIT_ORDER), help="splits to transcribe, in this order")
    ap.add_argument("--limit", type=int, default=None, help="at most N texts per split (quick runs)")
    ap.add_argument("--minutes", type=float, default=None, help="stop after this long (rerun to go on)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--shard",
        default="0/1",
        help="K/N: only the texts whose hash is K mod N (run N processes, one per core, on one file)",
    )
    ap.add_argument(
        "--voice-set",
        type=int,
        default=0,
        choices=sorted(VOICE_SETS),
        help="; ".join(f"{k}: {v}" for k, v in VOICE_SETS.items()),
    )
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    splits = D.split_examples(
        D.build_examples(seed=args.seed, progress=not args.no_progress, heard=False), args.seed
    )
    texts: list[str] = []
    for name in args.splits.split(","):
        mine = [str(e["text"]) for e in splits[name.strip()] if e.get("head") == "turn"]
        texts += mine[: args.limit] if args.limit else mine
    k, n_shards = (int(x) for x in args.shard.split("/"))
    if not 0 <= k < n_shards:
        ap.error(f"--shard {args.shard}: K must be in 0..N-1")
    texts = [t for t in texts if D.shard_of(t, n_shards) == k]
    t0 = time.time()
    n = transcribe_all(
        texts,
        seed=args.seed,
        progress=not args.no_progress,
        limit_s=None if args.minutes is None else 60 * args.minutes,
        voice_set=args.voice_set,
    )
    heard = read_heard(voice_set=args.voice_set)
    left = sum(1 for t in dict.fromkeys(texts) if t not in heard)
    print(
        f"transcribed {n} texts in {time.time() - t0:.0f} s; {len(heard)} of set {args.voice_set} in {HEARD_FILE.name}, {left} left",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
