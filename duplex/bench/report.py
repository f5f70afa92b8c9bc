"""The serve bench's outputs: bench.json, the table printed at the end, and bench.png."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from duplex.bench.common import TARGETS
from duplex.core.events import LATENCY_STAGES


def write_outputs(result: dict[str, Any], out_dir: str | Path, plot: bool = True) -> None:
    """OUT/bench.json (everything) and OUT/bench.png."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=2, default=_json_default))
    if plot:
        plot_results(result, out / "bench.png")


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


# -- report ------------------------------------------------------------------------------


def _fmt(v: float | None, scale: float = 1.0, digits: int = 0) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def format_table(result: dict[str, Any]) -> str:
    s = result["summary"]
    rows: list[tuple[str, dict[str, Any], float, str]] = [
        ("onset: end of speech -> first audio (client)", s["onset_s"], 1000.0, "P50<=1200 P90<=2000"),
    ]
    for kind, st in s["onset_by_kind_s"].items():
        if st["n"]:
            rows.append((f"  onset, {kind} turns", st, 1000.0, ""))
    for stage in LATENCY_STAGES:
        rows.append((f"  server turn.latency {stage}", s["server_latency_ms"][stage], 1.0, ""))
    rows.append(("barge-in: speech onset -> last answer frame", s["barge_in_reaction_s"], 1000.0, "P50<=200"))
    rows.append(("  barge-in: speech onset -> response.interrupted", s["barge_in_event_s"], 1000.0, ""))
    lines = [f"{'measure (ms)':<50} {'n':>4} {'P50':>7} {'P90':>7} {'P99':>7} {'min':>7} {'max':>7}  target"]
    for name, st, scale, target in rows:
        lines.append(
            f"{name:<50} {st['n']:>4} {_fmt(st['p50'], scale):>7} {_fmt(st['p90'], scale):>7} "
            f"{_fmt(st['p99'], scale):>7} {_fmt(st['min'], scale):>7} {_fmt(st['max'], scale):>7}  {target}"
        )
    tg = s["targets"]
    lines.append(
        "targets: "
        + ", ".join(
            f"{k} {'not measured' if v['value'] is None else 'met' if v['met'] else 'MISSED'} "
            f"({_fmt(v['value'], 1000)} ms vs {v['target'] * 1000:.0f})"
            for k, v in tg.items()
        )
    )
    lines.append(
        f"failures: {s['turns_failed']} turns, {s['barge_ins_failed']} barge-ins; leaked frames after "
        f"response.interrupted: {s['leaked_frames_total']}; VAD-split turns: {s['split_turns']}; barge-ins "
        f"not measurable (answer audio stalled at the interruption): {s['barge_ins_stalled']}"
    )
    if s.get("heard") is not None:
        h = s["heard"]
        lines.append(
            f"heard: {h['word_for_word']} of {h['n']} answered turns word for word; misheard (> 1/3 of the words "
            f"wrong): {len(h['misheard'])}"
            + "".join(f"\n  asked {m['text']!r}, heard {m['transcript']!r}" for m in h["misheard"])
        )
    if s.get("answer_gaps") is not None:
        g = s["answer_gaps"]
        lines.append(
            f"gaps inside answers (a client playing them runs dry): {g['count']} in {g['answers_with_gaps']} of "
            f"{g['answers']} answers, worst {g['worst_ms']:.0f} ms"
        )
    if s.get("relay_drafted"):
        lines.append(
            f"relay: {s['relay_committed']} of {s['relay_drafted']} answers started by the drafter "
            "(committed prefix)"
        )
    if s.get("early_answers"):
        early, late = s["onset_early_s"], s["onset_not_early_s"]
        lines.append(
            f"early answers (prepared while the user talked, final transcript agreed): {s['early_answers']}; "
            f"onset P50 {_ms(early.get('p50'))} with, {_ms(late.get('p50'))} without"
        )
    lines += format_cases(s)
    rtf = s["rtf"]
    lines.append("")
    lines.append(
        f"{'stage label':<14} {'jobs':>6} {'overruns':>8} {'run s':>8} {'per':>7} {'audio s':>8} {'RTF':>7}"
    )
    for label, r in rtf["labels"].items():
        lines.append(
            f"{label:<14} {r['jobs']:>6} {r['overruns']:>8} {r['run_s']:>8.2f} {r['per']:>7} "
            f"{r['audio_s']:>8.1f} {_fmt(r['rtf'], 1, 3):>7}"
        )
    for stage, r in rtf["stages"].items():
        if sum(1 for label in rtf["labels"] if label.split(".")[0] == stage) < 2:
            continue  # the label row says it all
        lines.append(
            f"{stage + ' (all)':<14} {r['jobs']:>6} {r['overruns']:>8} {r['run_s']:>8.2f} {'':>7} "
            f"{r['audio_s']:>8.1f} {_fmt(r['rtf'], 1, 3):>7}"
        )
    p = rtf["process"]
    lines.append(
        f"server process: CPU {_fmt(p['cpu_s'], 1, 1)} s over {rtf['wall_s']:.1f} s wall "
        f"({_fmt(p['cpu_cores_busy'], 1, 2)} cores busy, {_fmt(p['cpu_per_input_audio_s'], 1, 2)} CPU s per input s); "
        f"peak RSS {p['peak_rss_mb']} MB; input {rtf['input_audio_s']:.1f} s sent, answer audio "
        f"{rtf['output_audio_s']:.1f} s received; client mic max lag {s['client']['mic_max_lag_ms']} ms"
    )
    return "\n".join(lines)


def _pct(rate: float | None) -> str:
    return "-" if rate is None else f"{rate * 100:.0f}%"


def format_cases(s: dict[str, Any]) -> list[str]:
    """The facts, pause-takeover and memory lines (none for a case that was not asked)."""
    lines: list[str] = []
    f = s.get("facts") or {}
    if f.get("n"):
        lines.append(
            f"facts: {f['correct']}/{f['n']} correct ({_pct(f['rate'])}); {f['failed']} unanswered; "
            f"relay drafts committed on {f['draft_committed']}; wrong with a committed draft "
            f"{f['wrong_with_committed_draft']}, of which the draft held a wrong keyword {f['wrong_from_draft']}"
        )
        for w in f["wrong"]:
            draft = f" [draft {w['draft']!r}]" if "draft" in w else ""
            lines.append(f"  wrong: {w['q']!r} (heard {w['heard']!r}) -> {w['answer']!r}{draft}")
    p = s.get("pause_takeover") or {}
    if p.get("n"):
        lines.append(
            f"pause takeover: {p['taken']}/{p['n']} mid-sentence pauses taken over ({_pct(p['rate'])}); "
            f"answered the whole sentence {p['recovered']}/{p['n']}"
        )
    m = s.get("memory") or {}
    if m.get("n"):
        lines.append(f"memory: {m['correct']}/{m['n']} correct ({_pct(m['rate'])})")
        for w in m["wrong"]:
            lines.append(
                f"  wrong: {w['statement']!r} then {w['question']!r} -> {w['answer']!r} ({w['why']})"
            )
    return lines


def _cases_title(s: dict[str, Any]) -> str:
    parts = []
    for key, label, num in (("facts", "facts", "correct"), ("pause_takeover", "pauses taken over", "taken")):
        st = s.get(key) or {}
        if st.get("n"):
            parts.append(f"{label} {st[num]}/{st['n']}")
    st = s.get("memory") or {}
    if st.get("n"):
        parts.append(f"memory {st['correct']}/{st['n']}")
    return "\n" + ", ".join(parts) if parts else ""


def plot_results(result: dict[str, Any], path: str | Path) -> None:
    """Strip plot over box plot: onset and its server breakdown; barge-in reaction; targets as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = [t for t in result["samples"]["turns"] if t.get("ok")]
    groups: list[tuple[str, list[float]]] = []
    for stage in LATENCY_STAGES:
        vals = [
            t["server_latency_ms"][stage] / 1000
            for t in turns
            if isinstance((t.get("server_latency_ms") or {}).get(stage), (int, float))
        ]
        groups.append((f"server\n{stage}", vals))
    groups.append(("client\nonset", [t["onset_s"] for t in turns]))
    reaction = [
        b["reaction_s"]
        for b in result["samples"]["barge_ins"]
        if b.get("ok") and b.get("reaction_s") is not None
    ]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.5), gridspec_kw={"width_ratios": [5, 1.4]})
    rng = np.random.default_rng(0)

    def strip(ax: Any, data: list[list[float]], labels: list[str], scale: float = 1.0) -> None:
        for x, vals in enumerate(data, start=1):
            if vals:
                v = np.asarray(vals) * scale
                ax.boxplot([v], positions=[x], widths=0.5, showfliers=False)
                ax.scatter(x + rng.uniform(-0.15, 0.15, len(v)), v, s=14, alpha=0.6, zorder=3)
                ax.annotate(
                    f"n={len(v)}",
                    (x, 0),
                    xytext=(0, -4),
                    textcoords="offset points",
                    ha="center",
                    va="top",
                    fontsize=7,
                    annotation_clip=False,
                )
            else:
                ax.text(x, 0, "no samples", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(1, len(data) + 1), labels, fontsize=8)
        ax.set_xlim(0.4, len(data) + 0.6)

    strip(ax1, [g[1] for g in groups], [g[0] for g in groups])
    ax1.axhline(
        TARGETS["onset_p50_s"],
        color="tab:green",
        ls="--",
        label=f"onset P50 target {TARGETS['onset_p50_s']} s",
    )
    ax1.axhline(
        TARGETS["onset_p90_s"], color="tab:red", ls="--", label=f"onset P90 target {TARGETS['onset_p90_s']} s"
    )
    ax1.axhline(0, color="grey", lw=0.5)
    ax1.set_ylabel("seconds after the end of the user's speech")
    ax1.set_title("answer onset and the server's stage breakdown")
    ax1.legend(loc="upper left", fontsize=8)

    strip(ax2, [reaction], ["barge-in\nreaction"], scale=1000.0)
    ax2.axhline(
        TARGETS["barge_in_p50_s"] * 1000,
        color="tab:red",
        ls="--",
        label=f"target {TARGETS['barge_in_p50_s'] * 1000:.0f} ms",
    )
    ax2.set_ylabel("ms from interruption onset to last answer frame")
    ax2.set_title("barge-in")
    ax2.legend(loc="upper left", fontsize=8)
    top = max([TARGETS["barge_in_p50_s"] * 1000 * 1.5, *(np.asarray(reaction) * 1000 * 1.1)])
    ax2.set_ylim(min([0.0, *(np.asarray(reaction) * 1000)]) - 10, top)  # no barge-ins: just 0

    s = result["settings"]
    voice = f", voice {s['voice']}" if s.get("voice") else ""
    fig.suptitle(
        f"duplex bench: {s['turns']} turns, {s['barge_ins']} barge-ins{voice}, {s['url']}"
        + _cases_title(result["summary"]),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.0f} ms"


def plot_comparison(rows: list[tuple[str, dict[str, Any]]], path: str | Path, title: str = "") -> None:
    """One panel per question a comparison answers: the onset (P50 and P90) of each variant, and the share of
    facts right and of answers with a gap inside (a client playing them ran dry)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, _ in rows]
    x = list(range(len(rows)))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for k, (q, label) in enumerate((("p50", "P50"), ("p90", "P90"))):
        ms = [1000 * ((sm.get("onset_s") or {}).get(q) or 0.0) for _, sm in rows]
        a.bar([i + (k - 0.5) * 0.38 for i in x], ms, 0.38, label=f"onset {label}")
    a.set_xticks(x, names, rotation=15)
    a.set_ylabel("ms (end of speech -> first answer audio)")
    a.legend()
    a.grid(axis="y", alpha=0.3)
    facts = [100 * ((sm.get("facts") or {}).get("rate") or 0.0) for _, sm in rows]
    gaps = [
        100 * g["answers_with_gaps"] / g["answers"] if (g := sm.get("answer_gaps")) and g["answers"] else 0.0
        for _, sm in rows
    ]
    b.bar([i - 0.19 for i in x], facts, 0.38, label="facts right")
    b.bar([i + 0.19 for i in x], gaps, 0.38, label="answers with a gap inside")
    b.set_xticks(x, names, rotation=15)
    b.set_ylabel("%")
    b.set_ylim(0, 120)
    b.set_yticks(range(0, 101, 20))
    b.legend(loc="upper center", ncol=2)
    b.grid(axis="y", alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
