"""The deeper flow vs the control on the same batches: flow loss by step (500-step means), one plot."""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

RUNS = Path.home() / ".cache" / "duplex" / "runs" / "flow"
HERE = Path(__file__).resolve().parent


def rows(run: str) -> list[dict]:
    src = RUNS / run / "metrics.jsonl"
    if not src.exists():
        src = HERE / f"metrics-{run}.jsonl"
    return [r for r in map(json.loads, open(src)) if r["kind"] == "train"]


def means(rs: list[dict], key: str, width: int = 500) -> dict[int, float]:
    """Mean of `key` over [s - width, s) for each s a multiple of width (rows are 25-step means)."""
    by = {r["step"]: r[key] for r in rs}
    out = {}
    for s in range(min(by) // width * width + width, max(by) + 1, width):
        v = [by[k] for k in by if s - width < k <= s]
        if len(v) == width // 25:
            out[s] = float(np.mean(v))
    return out


def main() -> None:
    names = sys.argv[1:] or ["control4", "grow8"]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    table = {}
    for n in names:
        rs = rows(n)
        for i, key in enumerate(("flow", "dur")):
            m = means(rs, key)
            ax[i].plot(list(m), list(m.values()), "o-", label=n)
            ax[i].set_title(f"{key} loss, 500-step means")
            ax[i].set_xlabel("step")
        table[n] = means(rs, "flow")
    for a in ax:
        a.legend()
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(HERE / "grow.png", dpi=90)
    steps = sorted(set.intersection(*(set(t) for t in table.values())))
    print("step " + " ".join(f"{n:>9}" for n in names) + "  diff")
    for s in steps:
        v = [table[n][s] for n in names]
        print(f"{s} " + " ".join(f"{x:9.4f}" for x in v) + f"  {v[-1] - v[0]:+.4f}")


if __name__ == "__main__":
    main()
