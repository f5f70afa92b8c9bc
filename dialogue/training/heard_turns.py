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

The transcripts are kept in `data/dialogue/turn_heard.jsonl` (text, heard, voice), written as they are
made, so a run resumes where it stopped and `train_turn` reads them without running a model. Each
text's voice is a pure function of the text (seeded hash), so a rerun makes the same rows.
"""

from __future__ import annotations

import argparse
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


def transcribe_all(
    texts: Sequence[str],
    path: Path = HEARD_FILE,
    seed: int = 0,
    progress: bool = True,
    limit_s: float | None = None,
) -> int:
    """Speak and transcribe the texts not yet in `path`; append each row as it is made. Returns rows added."""
    from tqdm.auto import tqdm

    from asr.moonshine import load_asr_stage
    from asr.training.data import Speaker
    from duplex.base.config import load_profile
    from duplex.base.messages import AsrChunk

    done = read_heard(path)
    todo = [t for t in dict.fromkeys(texts) if t not in done]
    if not todo:
        return 0
    asr = load_asr_stage(load_profile("cpu").component("asr"))
    speaker = Speaker()
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    added = 0
    with path.open("a") as f:
        for text in tqdm(todo, desc="speak + transcribe", disable=not progress):
            if limit_s is not None and time.time() - t0 > limit_s:
                break
            spec = voice_for(text, seed)
            audio = speaker.speak(text, spec)
            out, _ = asr.step(asr.init_state(), AsrChunk(samples=audio, transcribe=True, final=True))
            heard = str(getattr(out, "text", "") or "").strip()
            f.write(json.dumps({"text": text, "heard": heard, "voice": spec.name()}) + "\n")
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
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    splits = D.split_examples(
        D.build_examples(seed=args.seed, progress=not args.no_progress, heard=False), args.seed
    )
    texts: list[str] = []
    for name in args.splits.split(","):
        mine = [str(e["text"]) for e in splits[name.strip()] if e.get("head") == "turn"]
        texts += mine[: args.limit] if args.limit else mine
    t0 = time.time()
    n = transcribe_all(
        texts,
        seed=args.seed,
        progress=not args.no_progress,
        limit_s=None if args.minutes is None else 60 * args.minutes,
    )
    heard = read_heard()
    left = sum(1 for t in dict.fromkeys(texts) if t not in heard)
    print(
        f"transcribed {n} texts in {time.time() - t0:.0f} s; {len(heard)} in {HEARD_FILE.name}, {left} left",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
