"""The streamed Moonshine encoder on the whole ASR panel (60 utterances per set), as the profile loads it, beside
Moonshine itself on the same audio: WER of the final transcript (Moonshine's decoder over the chunked encoder's
frames; streaming equals offline under the chunk mask, tests/asr/test_moonshine_stream.py).

    python docs/results/asr-moonshine-stream-2026-11-29/panel.py --profile cpu-moonshine-stream --out panel.json
"""

import argparse
import dataclasses
import json

import torch

from asr.moonshine import MoonshineModel
from asr.training.panel import SETS
from asr.training.train_moonshine_stream import panel_wer
from duplex.base.config import load_profile
from duplex.runtime.service import load_asr


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="cpu-moonshine-stream")
    ap.add_argument("--adapters", choices=["profile", "off"], default="profile")
    ap.add_argument("--out", default="panel.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_profile(args.profile).component("asr")
    if args.adapters == "off":
        cfg = dataclasses.replace(cfg, options={**cfg.options, "adapters": False})
    stage = load_asr(cfg)
    moonshine = MoonshineModel(threads=1)
    streamed = panel_wer(stage.encoder, moonshine, SETS)

    graph = moonshine._encoder  # panel_wer swaps the decoder's encoder out while it runs

    class Whole:  # Moonshine's own encoder (full context): the same function, the packaged graph
        def __call__(self, x):
            return torch.from_numpy(graph.run(None, {"input_values": x.numpy()})[0])

        def eval(self):
            return self

        def train(self):
            return self

    whole = panel_wer(Whole(), moonshine, SETS)
    res = {"profile": args.profile, "adapters": args.adapters, "streamed": streamed, "moonshine": whole}
    print(json.dumps(res, indent=1))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
