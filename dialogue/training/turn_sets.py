"""The held-out turn-head examples that `duplex eval eot` and the acoustic end-of-turn recipe speak, and
which of them, in what order. Torch-free (the server's command line imports `duplex eval eot`'s
arguments); `turn_data` writes the file."""

from __future__ import annotations

import json
import random
from collections.abc import Collection
from pathlib import Path
from typing import Any

from duplex.base.paths import DATA_ROOT
from duplex.base.turn_policy import LISTEN, SPEAK

EVAL_FILE = DATA_ROOT / "dialogue" / "turn_eval.jsonl"


def heldout_turn_examples(path: Path = EVAL_FILE) -> list[dict[str, Any]]:
    """The held-out turn-head examples that end a turn or do not (complete: SPEAK, cut: LISTEN)."""
    lines = Path(path).read_text().splitlines()
    return [
        e
        for e in (json.loads(line) for line in lines if line.strip())
        if e.get("head", "turn") == "turn" and int(e["label"]) in (LISTEN, SPEAK)
    ]


def speech_examples(
    examples: list[dict[str, Any]], n: int, seed: int, exclude: Collection[str] = ()
) -> list[dict[str, Any]]:
    """The held-out turns `duplex eval eot --speech n` speaks, in its order: n // 2 cut, then n // 2
    complete. Turns whose text is in `exclude` (spoken in an earlier run) are never chosen."""
    rng = random.Random(seed)
    skip = set(exclude)
    chosen: list[dict[str, Any]] = []
    for lab in (LISTEN, SPEAK):
        pool = [e for e in examples if int(e["label"]) == lab and e["text"] not in skip]
        if len(pool) < n // 2:
            raise ValueError(
                f"only {len(pool)} held-out turns with label {lab} are left to speak, {n // 2} asked"
            )
        rng.shuffle(pool)
        chosen += pool[: n // 2]
    return chosen
