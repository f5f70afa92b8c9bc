"""Is it the durations? The shipped flow with hibari's own per-phoneme durations instead of its predicted ones.

`duplex eval tts --parts flow` as it is, except that the flow stage's duration predictor is replaced by the
teacher: every sentence the stage synthesises is run through the edited hibari graph (codec/training/
hibari_teacher.py) for its per-phoneme durations (25 ms units), and those are used; the stage still sets the lead
and the closing pause by punctuation as it ships. Everything else (encoder, regulator, estimator, 2 Euler steps,
codec, phrase cuts, scorer) is the shipped path, so the paired difference against the shipped flow's transcripts
of the same sentences says how much of the own voice's word error is its durations.

    python docs/results/flow-diagnostics-2026-11-29/oracle.py -n 600 --out /tmp/oracle
    (then the paired comparison: compare.py)
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

import tts.loading
from codec.training.hibari_teacher import HibariTeacher
from duplex.eval import tts as eval_tts

STATS = {"rows": 0, "teacher": 0, "mismatch": 0, "units_abs_diff": [], "units_pred": 0, "units_teacher": 0}


def patch(stage, teacher: HibariTeacher, mode: str) -> None:
    fm = stage.front_model
    inv = {v: k for k, v in stage.front.vocab.items()}
    enc_forward = fm.encoder.forward
    seen: dict[str, torch.Tensor] = {}

    def forward(ids, valid=None):
        seen["ids"], seen["valid"] = ids, valid
        return enc_forward(ids, valid)

    predict = fm.predict_units

    def predict_units(h, speed=1.0):
        units = predict(h, speed)
        ids, valid = seen["ids"], seen["valid"]
        for r in range(ids.shape[0]):
            n = int(valid[r].sum()) if valid is not None else ids.shape[1]
            row = ids[r, :n].tolist()
            ps = "".join(inv[i] for i in row[1:-1])
            out = teacher.run(ps)
            STATS["rows"] += 1
            if out.ids.tolist() != row:
                STATS["mismatch"] += 1
                continue
            t = torch.from_numpy(out.durations).long()
            inner = slice(1, n - 1)  # the stage sets the lead and the closing pause itself
            STATS["units_abs_diff"].extend((units[r, inner] - t[inner]).abs().tolist())
            STATS["units_pred"] += int(units[r, inner].sum())
            STATS["units_teacher"] += int(t[inner].sum())
            if mode == "teacher":
                units[r, :n] = t
            elif mode == "teacher-total":  # the predicted shape, rescaled to the teacher's total length
                p = units[r, inner].float()
                scaled = torch.clamp(torch.round(p * t[inner].sum() / p.sum()), 1, 40).long()
                units[r, inner] = scaled
            STATS["teacher"] += 1
        return units

    fm.predict_units = predict_units
    fm.encoder.forward = forward


def main() -> int:
    ap = argparse.ArgumentParser()
    eval_tts.add_arguments(ap)
    ap.add_argument("--durations", choices=["teacher", "teacher-total", "predicted"], default="teacher")
    args = ap.parse_args()
    args.parts, args.timing_repeats, args.long_minutes = ["flow"], 0, 0
    teacher = HibariTeacher(threads=1)
    load = tts.loading.load_tts

    def load_tts(cfg):
        stage = load(cfg)
        if cfg.backend == "flow":
            patch(stage, teacher, args.durations)
        return stage

    tts.loading.load_tts = load_tts
    rc = eval_tts.run(args)
    d = np.asarray(STATS["units_abs_diff"])
    print(
        f"rows {STATS['rows']} with teacher durations {STATS['teacher']} (id mismatches {STATS['mismatch']}); "
        f"predicted vs teacher units: mean |diff| {d.mean():.3f}, exact {np.mean(d == 0):.1%}, "
        f"total {STATS['units_pred']} vs {STATS['units_teacher']}",
        file=sys.stderr,
    )
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
