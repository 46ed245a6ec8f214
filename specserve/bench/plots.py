"""Plots (matplotlib, Agg) and markdown tables for sweep results.

    python -m specserve.bench.plots benchmarks/results/adaptive/sweep.json   # redraw from the JSON
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable

Getter = Callable[[dict[str, Any]], "float | None"]


def accept_length_of(result: dict[str, Any]) -> float | None:
    """Usage sums first (exactly this run's requests), then /metrics deltas, then the server's figure."""
    al = result.get("accept_length") or {}
    for key in ("usage", "metrics", "server_info"):
        if al.get(key) is not None:
            return al[key]
    return None


def mean_k_of(result: dict[str, Any]) -> float | None:
    return (result.get("spec_metrics") or {}).get("mean_k")


PANELS: list[tuple[str, str, Getter]] = [
    ("throughput", "output tok/s", lambda r: r.get("output_throughput")),
    ("tpot", "mean TPOT (ms)", lambda r: r.get("mean_tpot_ms")),
    ("accept_length", "accept length (tokens / verify step)", accept_length_of),
    ("k", "mean k (from /metrics)", mean_k_of),
]


def config_names(sweep: dict[str, Any]) -> list[str]:
    return list(sweep["configs"])


def points(sweep: dict[str, Any], config: str, get: Getter) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for run in sweep["runs"]:
        if run["config"] != config or run["concurrency"] is None:
            continue
        v = get(run["result"])
        if v is not None:
            xs.append(run["concurrency"])
            ys.append(v)
    return xs, ys


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "–" if x is None else format(x, spec)


# ---------------------------------------------------------------------------------------------
# Plots


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _draw_panel(ax: Any, sweep: dict[str, Any], label: str, get: Getter) -> None:
    any_data = False
    for name in config_names(sweep):
        xs, ys = points(sweep, name, get)
        if xs:
            ax.plot(xs, ys, marker="o", label=name)
            any_data = True
    ax.set_xscale("log", base=2)
    cs = sweep.get("concurrency") or []
    if cs:
        ax.set_xticks(cs)
        ax.set_xticklabels([str(c) for c in cs])
    ax.set_xlabel("concurrency")
    ax.set_ylabel(label)
    ax.grid(True, alpha=0.3)
    if any_data:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")


def plot_sweep(sweep: dict[str, Any], out_dir: Path) -> list[Path]:
    """sweep.png (four panels) and one PNG per panel."""
    plt = _plt()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (_, label, get) in zip(axes.flat, PANELS):
        _draw_panel(ax, sweep, label, get)
    fig.suptitle(_title(sweep), fontsize=10)
    fig.tight_layout()
    paths.append(out_dir / "sweep.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    for key, label, get in PANELS:
        fig, ax = plt.subplots(figsize=(6, 4))
        _draw_panel(ax, sweep, label, get)
        ax.set_title(_title(sweep), fontsize=8)
        fig.tight_layout()
        paths.append(out_dir / f"{key}_vs_concurrency.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def _ramp_runs(sweep: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["config"]: r["result"]["ramp"] for r in sweep["runs"] if r["result"].get("ramp")}


def plot_ramp(sweep: dict[str, Any], out_dir: Path) -> list[Path]:
    """ramp.png: output tok/s per window per configuration over the target concurrency; mean k below."""
    ramps = _ramp_runs(sweep)
    if not ramps:
        return []
    plt = _plt()
    fig, (ax, axk) = plt.subplots(2, 1, figsize=(11, 7), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    target_drawn = False
    for name, ramp in ramps.items():
        ws = ramp["windows"]
        mid = [(w["t_start_s"] + w["t_end_s"]) / 2 for w in ws]
        ax.plot(mid, [w["output_throughput"] for w in ws], marker=".", label=name)
        ks = [(m, w["mean_k"]) for m, w in zip(mid, ws) if w["mean_k"] is not None]
        if ks:
            axk.plot([m for m, _ in ks], [k for _, k in ks], marker=".", label=name)
        if not target_drawn:
            tx = ax.twinx()
            tx.step([w["t_start_s"] for w in ws] + [ws[-1]["t_end_s"]],
                    [w["target_concurrency"] for w in ws] + [ws[-1]["target_concurrency"]], where="post",
                    color="gray", alpha=0.4, linestyle="--")
            tx.set_ylabel("target concurrency", color="gray")
            target_drawn = True
    ax.set_ylabel("output tok/s per window")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    axk.set_ylabel("mean k")
    axk.set_xlabel("time (s)")
    axk.grid(True, alpha=0.3)
    if axk.lines:
        axk.legend(fontsize=8)
    fig.suptitle(_title(sweep), fontsize=10)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "ramp.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def plot_all(sweep: dict[str, Any], out_dir: Path) -> list[Path]:
    if sweep.get("kind") == "ramp":
        return plot_ramp(sweep, out_dir)
    return plot_sweep(sweep, out_dir)


def _title(sweep: dict[str, Any]) -> str:
    ds = sweep.get("dataset") or {}
    model = Path(sweep["model"]).name if sweep.get("model") else "default model"
    bits = [model, ds.get("name", "")]
    if ds.get("output_len"):
        bits.append(f"output {ds['output_len']}")
    return " · ".join(b for b in bits if b)


# ---------------------------------------------------------------------------------------------
# Markdown


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|:---|" + "".join("---:|" for _ in header[1:])]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _by_c(sweep: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(r["config"], r["concurrency"]): r["result"] for r in sweep["runs"] if r["concurrency"] is not None}


def _pivot(sweep: dict[str, Any], get: Getter, spec: str, ratio: bool) -> str:
    names = config_names(sweep)
    base = sweep.get("baseline") or names[0]
    by = _by_c(sweep)
    rows = []
    for c in sweep["concurrency"]:
        row = [str(c)]
        b = by.get((base, c))
        bv = get(b) if b else None
        for name in names:
            r = by.get((name, c))
            v = get(r) if r else None
            cell = _fmt(v, spec)
            if ratio and name != base and v is not None and bv:
                cell += f" ({v / bv:.2f}×)"
            row.append(cell)
        rows.append(row)
    return _table(["C", *names], rows)


def sweep_markdown(sweep: dict[str, Any]) -> str:
    out = [f"Command: `{sweep['command']}`", "",
           f"Started {sweep['started_at']}; configurations: " +
           "; ".join(f"**{n}** `{f or '(defaults)'}`" for n, f in sweep["configs"].items()), ""]
    if sweep.get("kind") == "ramp":
        out.append(_ramp_markdown(sweep))
    else:
        base = sweep.get("baseline")
        out += [f"**Output throughput (tok/s)**, ratio to {base}", "",
                _pivot(sweep, lambda r: r.get("output_throughput"), ".1f", True), "",
                "**Mean TPOT (ms)**", "", _pivot(sweep, lambda r: r.get("mean_tpot_ms"), ".1f", False), "",
                "**Median TTFT (ms)**", "", _pivot(sweep, lambda r: r.get("median_ttft_ms"), ".0f", False), "",
                "**Accept length**", "", _pivot(sweep, accept_length_of, ".2f", False), "",
                "**Mean k (server /metrics)**", "", _pivot(sweep, mean_k_of, ".2f", False), "",
                "<details><summary>all runs</summary>", "", _runs_table(sweep), "", "</details>"]
    if sweep.get("errors"):
        out += ["", "**Errors**", ""] + [f"- {n}: {e.splitlines()[0]}" for n, e in sweep["errors"].items()]
    return "\n".join(out) + "\n"


def _runs_table(sweep: dict[str, Any]) -> str:
    header = ["config", "C", "prompts", "ok", "failed", "out tok/s", "req/s", "TTFT p50 ms", "TPOT mean ms",
              "ITL p99 ms", "E2E p50 ms", "accept", "mean k", "k=0 share", "tokens check"]
    rows = []
    for run in sweep["runs"]:
        r = run["result"]
        sm = r.get("spec_metrics") or {}
        rows.append([run["config"], str(run["concurrency"]), str(run["num_prompts"]), str(r["completed"]),
                     str(r["failed"]), _fmt(r["output_throughput"]), _fmt(r["request_throughput"], ".2f"),
                     _fmt(r["median_ttft_ms"], ".0f"), _fmt(r["mean_tpot_ms"]), _fmt(r["p99_itl_ms"]),
                     _fmt(r["median_e2e_latency_ms"], ".0f"), _fmt(accept_length_of(r), ".2f"),
                     _fmt(sm.get("mean_k"), ".2f"), _fmt(sm.get("k0_share"), ".2f"),
                     "ok" if r["token_check"]["consistent"] else "MISMATCH"])
    return _table(header, rows)


def _overall(ramp: dict[str, Any]) -> float | None:
    """Output tok/s over the schedule's windows."""
    span = sum(w["t_end_s"] - w["t_start_s"] for w in ramp["windows"])
    return sum(w["output_tokens"] for w in ramp["windows"]) / span if span else None


def ramp_comparison(sweep: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per configuration against the baseline and against the best of the others (overall: the better
    configuration's tok/s; per window: the best in that window), window by window (one clock)."""
    ramps = _ramp_runs(sweep)
    base = sweep.get("baseline")
    out: dict[str, dict[str, Any]] = {}
    bw = ramps.get(base, {}).get("windows", []) if base else []
    for name, ramp in ramps.items():
        ws = ramp["windows"]
        ratios = [w["output_throughput"] / b["output_throughput"] for w, b in zip(ws, bw)
                  if w["output_throughput"] is not None and b["output_throughput"]]
        others = [r for n, r in ramps.items() if n != name]
        best_windows = [max((o["windows"][i]["output_throughput"] or 0.0 for o in others if i < len(o["windows"])),
                            default=0.0) for i in range(len(ws))]
        to_best = [w["output_throughput"] / b for w, b in zip(ws, best_windows)
                   if w["output_throughput"] is not None and b]
        best_overall = max((_overall(o) or 0.0 for o in others), default=0.0)
        ks = [w["mean_k"] for w in ws if w["mean_k"] is not None]
        switches = sum(1 for a, b in zip(ks, ks[1:]) if (a == 0) != (b == 0))
        overall = _overall(ramp)
        out[name] = {
            "output_throughput": overall,
            "min_window_ratio": min(ratios) if ratios and name != base else None,
            "windows_below_0.97": sum(1 for x in ratios if x < 0.97) if name != base else None,
            "ratio_to_best_other": overall / best_overall if overall is not None and best_overall else None,
            "min_window_ratio_to_best_other": min(to_best) if to_best else None,
            "windows_below_0.9_of_best_other": sum(1 for x in to_best if x < 0.9) if to_best else None,
            "mean_k": sum(ks) / len(ks) if ks else None,
            "on_off_switches": switches if ks else None,
        }
    return out


def _ramp_markdown(sweep: dict[str, Any]) -> str:
    ramps = _ramp_runs(sweep)
    if not ramps:
        return "(no ramp results)"
    names = [n for n in config_names(sweep) if n in ramps]
    base = sweep.get("baseline")
    first = ramps[names[0]]
    rows = []
    for j, step in enumerate(first["steps"]):
        row = [str(j), str(step["concurrency"])]
        for n in names:
            s = ramps[n]["steps"][j]
            row.append(f"{_fmt(s['output_throughput'])} / {_fmt(s['mean_k'], '.2f')}")
        rows.append(row)
    steps_table = _table(["step", "C", *[f"{n} tok/s / k" for n in names]], rows)
    cmp = ramp_comparison(sweep)
    crow = [[n, _fmt(cmp[n]["output_throughput"]), _fmt(cmp[n]["min_window_ratio"], ".3f"),
             _fmt(cmp[n]["windows_below_0.97"], "d"), _fmt(cmp[n]["ratio_to_best_other"], ".3f"),
             _fmt(cmp[n]["min_window_ratio_to_best_other"], ".3f"), _fmt(cmp[n]["windows_below_0.9_of_best_other"], "d"),
             _fmt(cmp[n]["mean_k"], ".2f"), _fmt(cmp[n]["on_off_switches"], "d")] for n in names]
    cmp_table = _table(["config", "out tok/s", f"min window / {base}", "windows < 0.97×", "/ best other",
                        "min window / best other", "windows < 0.9× best other", "mean k",
                        "k on/off switches (windows)"], crow)
    levels = ",".join(map(str, first["levels"]))
    return (f"**Ramp** C = {levels}, {first['step_duration_s']:g} s per level, {first['window_s']:g} s windows\n\n"
            f"{steps_table}\n\n{cmp_table}")


def as_sweep(obj: dict[str, Any]) -> dict[str, Any]:
    """A single `bench serve` result wrapped as a one-configuration sweep (so a ramp run plots too)."""
    if "runs" in obj:
        return obj
    c = None if obj.get("ramp") else obj["config"]["max_concurrency"]
    return {"kind": "ramp" if obj.get("ramp") else "sweep", "command": obj.get("command", ""),
            "started_at": obj.get("started_at", ""), "model": obj.get("model"), "configs": {"run": ""},
            "baseline": "run", "concurrency": [c] if c else [], "dataset": obj.get("dataset") or {},
            "runs": [{"config": "run", "concurrency": c, "num_prompts": obj["num_requests"], "result": obj}],
            "errors": {}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="redraw plots and tables from a sweep.json (or a bench serve JSON)")
    p.add_argument("sweep_json")
    p.add_argument("--out-dir", help="default: next to the JSON")
    a = p.parse_args(argv)
    sweep = as_sweep(json.loads(Path(a.sweep_json).read_text()))
    out_dir = Path(a.out_dir) if a.out_dir else Path(a.sweep_json).parent
    for path in plot_all(sweep, out_dir):
        print(path)
    print(sweep_markdown(sweep))


if __name__ == "__main__":
    main()
