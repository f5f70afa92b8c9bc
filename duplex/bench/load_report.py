"""The load bench's outputs: load.json and load.png per level, soak.json and soak.png over time, and
the tables printed at the end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from duplex.bench.report import _json_default


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_load_outputs(result: dict[str, Any], out_dir: str | Path, plot: bool = True) -> Path:
    """OUT/load.json (everything) and OUT/load.png; returns the JSON's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "load.json"
    path.write_text(json.dumps(result, indent=2, default=_json_default))
    if plot:
        plot_load(result, out / "load.png")
    return path


def write_soak_outputs(result: dict[str, Any], out_dir: str | Path, plot: bool = True) -> Path:
    """OUT/soak.json (everything) and OUT/soak.png; returns the JSON's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "soak.json"
    path.write_text(json.dumps(result, indent=2, default=_json_default))
    if plot:
        plot_soak(result, out / "soak.png")
    return path


def _ms(v: float | None) -> float:
    return float("nan") if v is None else v * 1000


def plot_load(result: dict[str, Any], path: str | Path) -> None:
    """Onset P50/P90, barge-in P90 and gaps against the number of callers, targets as lines."""
    plt = _plt()
    levels = result["levels"]
    ns = [lv["sessions"] for lv in levels]
    targets = result["settings"]["targets"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    ax = axes[0]
    ax.plot(ns, [_ms(lv["onset_s"]["p50"]) for lv in levels], "o-", label="P50")
    ax.plot(ns, [_ms(lv["onset_s"]["p90"]) for lv in levels], "s-", label="P90")
    ax.axhline(targets["onset_p90_s"] * 1000, color="red", ls="--", lw=1, label="P90 target")
    ax.set(title="answer onset", xlabel="callers at once", ylabel="ms")
    ax.legend()
    ax = axes[1]
    ax.plot(ns, [_ms(lv["barge_in_reaction_s"]["p90"]) for lv in levels], "s-", color="tab:purple")
    ax.axhline(targets["barge_in_p90_s"] * 1000, color="red", ls="--", lw=1, label="target")
    ax.set(title="barge-in stop P90", xlabel="callers at once", ylabel="ms")
    ax.legend()
    ax = axes[2]
    ax.bar(ns, [lv["gaps"]["count"] for lv in levels], color="tab:orange", label="gaps")
    ax.set(title="gaps inside answers' audio", xlabel="callers at once", ylabel="count")
    worst = ax.twinx()
    worst.plot(ns, [lv["gaps"]["worst_ms"] for lv in levels], "kx--", label="worst gap")
    worst.set_ylabel("worst gap, ms")
    for ax in axes:
        ax.set_xticks(ns)
    fig.suptitle(
        "duplex bench --sessions: refused "
        + ", ".join(f"N={lv['sessions']}: {lv['refused']}" for lv in levels)
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_soak(result: dict[str, Any], path: str | Path) -> None:
    """RSS, threads and asyncio tasks, overruns and gaps over the soak's time."""
    plt = _plt()
    samples = result["samples"]
    t = [s["t_s"] for s in samples]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].plot(t, [s["rss_mb"] for s in samples], "o-")
    axes[0].set(title="server RSS", xlabel="s", ylabel="MB")
    axes[1].plot(t, [s["threads"] for s in samples], "o-", label="server threads")
    if any(s.get("server_tasks") is not None for s in samples):
        axes[1].plot(t, [s.get("server_tasks") for s in samples], "s-", label="server asyncio tasks")
    axes[1].plot(t, [s["client_tasks"] for s in samples], "^-", label="client asyncio tasks")
    axes[1].set(title="threads and tasks", xlabel="s")
    axes[1].legend()
    base_o, base_g = samples[0]["overruns"], samples[0].get("gaps", 0)
    axes[2].plot(t, [s["overruns"] - base_o for s in samples], "o-", label="budget overruns")
    axes[2].plot(t, [s.get("gaps", 0) - base_g for s in samples], "s-", label="gaps in answers")
    axes[2].set(title="cumulative", xlabel="s", ylabel="count")
    axes[2].legend()
    v = result["verdict"]
    fig.suptitle(
        f"duplex bench --soak: {result['settings']['sessions']} callers, RSS growth {v['rss_growth_pct']} %"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _f(v: Any, scale: float = 1000.0) -> str:
    return "-" if v is None else f"{v * scale:.0f}"


def format_load_table(result: dict[str, Any]) -> str:
    """One row per N: latency, gaps, overruns, CPU, memory, refusals; then batch sizes per label."""
    head = (
        f"{'N':>3} {'ok':>3} {'refused':>7} {'onset n':>7} {'P50':>6} {'P90':>6} {'P99':>6} {'barge n':>7} "
        f"{'P50':>5} {'P90':>5} {'stall':>5} {'gaps':>4} {'worst':>6} {'overruns':>8} {'cores':>5} {'RSS MB':>7}  missed"
    )
    lines = [
        "(ms unless named; stall = barge-ins not measurable, the answer's audio had stalled; "
        "cores = server CPU seconds / wall)",
        head,
    ]
    for lv in result["levels"]:
        on, bi, srv = lv["onset_s"], lv["barge_in_reaction_s"], lv["server"]
        cores = "-" if srv["cpu_cores_busy"] is None else f"{srv['cpu_cores_busy']:.2f}"
        rss = "-" if srv["rss_mb"] is None else f"{srv['rss_mb']:.0f}"
        lines.append(
            f"{lv['sessions']:>3} {lv['started']:>3} {lv['refused']:>7} {on['n']:>7} {_f(on['p50']):>6} "
            f"{_f(on['p90']):>6} {_f(on['p99']):>6} {bi['n']:>7} {_f(bi['p50']):>5} {_f(bi['p90']):>5} {lv['barge_ins_stalled']:>5} "
            f"{lv['gaps']['count']:>4} {lv['gaps']['worst_ms']:>6.0f} {lv['overruns']:>8} "
            f"{cores:>5} {rss:>7}  "
            f"{', '.join(lv['targets_missed']) or '-'}"
        )
    lines.append("")
    lines.append("overruns / jobs per stage; batch size P50 / max per label (the executor's recent batches)")
    for lv in result["levels"]:
        stages = "  ".join(f"{k} {v['overruns']}/{v['jobs']}" for k, v in sorted(lv["stages"].items()))
        batches = "  ".join(
            f"{k} {v['batch_p50']}/{v['batch_max']}" for k, v in sorted(lv["batches"].items())
        )
        lines.append(f"N={lv['sessions']}: {stages}")
        lines.append(f"     {batches}")
    note = result.get("llm_tokens_note")
    if note:
        lines.append(f"LLM tokens/s: {note}")
    else:
        lines.append(
            "LLM tokens/s: "
            + ", ".join(f"N={lv['sessions']}: {lv['llm_tokens_per_s']}" for lv in result["levels"])
        )
    opened = ", ".join(
        f"N={lv['sessions']}: {lv['server']['rss_mb_open']:.0f}"
        for lv in result["levels"]
        if lv["server"].get("rss_mb_open") is not None
    )
    per = result.get("memory_per_session_mb")
    lines.append(
        f"memory per extra session: {'-' if per is None else f'{per:g}'} MB "
        f"(server RSS MB with every caller connected: {opened or 'not sampled'})"
    )
    lines.append(f"largest N within every target: {result['max_sessions_within_targets']}")
    return "\n".join(lines)


def format_soak_table(result: dict[str, Any]) -> str:
    """The soak's timeline (one row per sample) and its totals and verdicts."""
    lines = [
        f"{'t s':>6} {'phase':>5} {'sessions':>8} {'RSS MB':>7} {'threads':>7} {'srv tasks':>9} {'overruns':>8} {'gaps':>5}"
    ]
    for s in result["samples"]:
        lines.append(
            f"{s['t_s']:>6.0f} {s['phase']:>5} {s['sessions'] if s['sessions'] is not None else '-':>8} "
            f"{s['rss_mb'] if s['rss_mb'] is not None else '-':>7} {s['threads'] if s['threads'] is not None else '-':>7} "
            f"{s['server_tasks'] if s['server_tasks'] is not None else '-':>9} {s['overruns']:>8} {s.get('gaps', 0):>5}"
        )
    t, v = result["totals"], result["verdict"]
    lines.append(
        f"sessions: {t['sessions_started']} started, {t['sessions_refused']} refused, {t['sessions_failed']} failed; "
        f"answers {t['answers']} ({t['turns_failed']} turns failed); onset P50/P90 {_f(t['onset_s']['p50'])}/"
        f"{_f(t['onset_s']['p90'])} ms"
    )
    lines.append(
        f"gaps {t['gaps']['count']} (worst {t['gaps']['worst_ms']:.0f} ms); leaked frames {t['leaked_frames']}; "
        f"overruns {t['overruns']}; stage failures {t['stage_failures']}"
    )
    lines.append(
        f"RSS growth under load {v['rss_growth_pct']} % (idle to idle {v['rss_growth_from_idle_pct']} %); "
        f"threads grew: {v['threads_grew']} {v['threads_idle']}; server tasks grew: {v['server_tasks_grew']} "
        f"{v['server_tasks_idle']}; client tasks grew: {v['client_tasks_grew']}"
    )
    h = t.get("hangups")
    if h and h["calls"]:
        lines.append(
            f"hang-ups: {h['calls']} calls dropped, {h['at_first_audio']} at the answer's first audio"
            + (f" (others: {'; '.join(h['errors'])})" if h["errors"] else "")
        )
    return "\n".join(lines)
