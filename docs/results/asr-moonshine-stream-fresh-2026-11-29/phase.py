"""The live bench's questions, offline, at several lead silences: where the 480 ms chunks fall.

The live compare (`duplex bench --serve --compare-asr cpu-streaming --voice heldout`) mishears the same few
questions run after run. This reads the bench's 29 prompts in the same held-out voices (`HeldoutSynth`, seed 0: the
bench's rate and pitch per prompt) with 0-400 ms of silence before the speech, through the streamed encoder as the
profile loads it (Moonshine's decoder over its chunk-masked frames; streaming equals offline under the mask) and
through Moonshine whole, and counts per lead silence how many are misheard the bench's way (more than a third of the
words wrong, British and American spellings alike). A diagnostic, not a training set: the bench's prompts must stay
out of every pool.

    python docs/results/asr-moonshine-stream-fresh-2026-11-29/phase.py --profile cpu-streaming --out phase.json
    python docs/results/asr-moonshine-stream-fresh-2026-11-29/phase.py --rescore phase.json --out phase.json
"""

import argparse
import json

import numpy as np
import torch

from asr.moonshine import MoonshineModel, decode_tokens
from asr.training.train_moonshine_stream import read_frames
from duplex.base.config import load_profile
from duplex.bench.common import INTERRUPTIONS, LONG_PROMPTS, QUESTIONS, HeldoutSynth, trim_speech
from duplex.bench.serve import MISHEARD, share_misheard
from duplex.runtime.service import load_asr

LEADS_S = (0.0, 0.08, 0.16, 0.24, 0.32, 0.40)
PROMPTS = (*QUESTIONS, *LONG_PROMPTS, *INTERRUPTIONS)
NAMES = ("streamed", "whole")


def summary(rows: list[dict]) -> dict:
    """Per recogniser and lead silence: prompts misheard (> 1/3 of the words wrong) and heard word for word."""

    def of(name: str, lead: float) -> list[dict]:
        return [r for r in rows if r["asr"] == name and r["lead_s"] == lead]

    table = {
        name: {
            str(lead): {
                "misheard": sum(r["wer"] > MISHEARD for r in of(name, lead)),
                "word_for_word": sum(r["wer"] == 0 for r in of(name, lead)),
            }
            for lead in LEADS_S
        }
        for name in NAMES
    }
    ever = {
        name: sorted({r["text"] for r in rows if r["asr"] == name and r["wer"] > MISHEARD}) for name in NAMES
    }
    return {"table": table, "misheard_at_some_lead": ever}


def decode_all(profile: str) -> list[dict]:
    torch.set_num_threads(1)
    encoder = load_asr(load_profile(profile).component("asr")).encoder.eval()
    moonshine = MoonshineModel(threads=1)
    synth = HeldoutSynth(seed=0)

    def streamed(audio: np.ndarray) -> str:
        with torch.no_grad():
            return read_frames(moonshine, encoder(torch.from_numpy(audio)[None]).numpy(), audio)

    def whole(audio: np.ndarray) -> str:
        return decode_tokens(moonshine.tokens, moonshine._greedy(audio))

    rows = []
    tail = np.zeros(int(0.3 * 16000), np.float32)
    for text in PROMPTS:
        speech = trim_speech(np.asarray(synth(text), np.float32))
        for lead in LEADS_S:
            audio = np.concatenate([np.zeros(int(lead * 16000), np.float32), speech, tail])
            for name, read in zip(NAMES, (streamed, whole), strict=True):
                hyp = read(audio)
                rows.append({"text": text, "voice": synth.voice_of.get(text), "lead_s": lead, "asr": name,
                             "heard": hyp, "wer": share_misheard(text, hyp)})  # fmt: skip
        print(text, [r["heard"] for r in rows[-2 * len(LEADS_S) :: 2]], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="cpu-streaming")
    ap.add_argument("--out", default="phase.json")
    ap.add_argument("--rescore", default=None, help="score an earlier run's rows again (decodes nothing)")
    args = ap.parse_args()
    if args.rescore:
        with open(args.rescore) as f:
            res = json.load(f)
        res.pop("misheard_at_every_lead", None)
        for r in res["rows"]:
            r["wer"] = share_misheard(r["text"], r["heard"])
        res.update(summary(res["rows"]))
    else:
        rows = decode_all(args.profile)
        res = {
            "profile": args.profile,
            "n_prompts": len(PROMPTS),
            "leads_s": LEADS_S,
            **summary(rows),
            "rows": rows,
        }
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}, indent=1))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
