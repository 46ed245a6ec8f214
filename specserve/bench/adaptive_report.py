"""The adaptive sweep's summary table, markdown and plots (adaptive.py measures)."""

from __future__ import annotations

import os
from typing import Any

import torch


def device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"



def summarise(points: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    rows = []
    static = [n for n in names if n.startswith("chain") or n == "tree"]
    for p in points:
        cf = p["configs"]
        base = cf["none"]["tok_s"]
        best_static = max(static, key=lambda n: cf[n]["tok_s"] or 0) if static else None
        ref = max(base, cf[best_static]["tok_s"]) if best_static else base
        halves = []
        for i in range(2):  # the same comparison within each half of the window: the spread
            fixed = [cf[n]["tok_s_halves"][i] for n in ["none", *static] if cf[n].get("tok_s_halves")]
            fixed = [x for x in fixed if x]
            a = (cf["adaptive"].get("tok_s_halves") or [None, None])[i]
            halves.append(a / max(fixed) if a and fixed else None)
        row = {"concurrency": p["concurrency"], "other_cpu_cores": p["other_cpu_cores"], "best_static": best_static,
               "best_fixed_tok_s": ref,
               "adaptive_vs_best_fixed": cf["adaptive"]["tok_s"] / ref if ref else None,
               "adaptive_vs_best_static": (cf["adaptive"]["tok_s"] / cf[best_static]["tok_s"]) if best_static else None,
               "adaptive_vs_best_fixed_halves": halves}
        for n in names:
            if n.startswith("adaptive_"):  # a --variant
                row[f"{n}_vs_best_fixed"] = cf[n]["tok_s"] / ref if ref and cf[n]["tok_s"] else None
        for n in names:
            row[n] = {k: cf[n].get(k) for k in ("tok_s", "tpot_ms_mean", "mean_k", "k0_share", "accept_length",
                                               "switches")}
            row[n]["vs_none"] = cf[n]["tok_s"] / base if base else None
        rows.append(row)
    return rows


def markdown(result: dict[str, Any]) -> str:
    names = result["configs"]
    s = result["summary"]
    f = lambda x, spec=".1f": "-" if x is None else format(x, spec)  # noqa: E731
    lines = ["Output tok/s (x none) per concurrency; last columns: adaptive / max(none, best static) over the "
             "window and its two halves, adaptive mean k.", "",
             "| C | " + " | ".join(names) + " | adaptive / best fixed (halves) | adaptive mean k | other CPU |",
             "|--:|" + "--:|" * len(names) + "--:|--:|--:|"]
    for r in s:
        cells = [f"{f(r[n]['tok_s'])} ({f(r[n]['vs_none'], '.2f')}x)" for n in names]
        h = r["adaptive_vs_best_fixed_halves"]
        lines.append(f"| {r['concurrency']} | " + " | ".join(cells) +
                     f" | {f(r['adaptive_vs_best_fixed'], '.3f')} ({f(h[0], '.2f')}, {f(h[1], '.2f')}) | "
                     f"{f(r['adaptive']['mean_k'], '.2f')} | {f(r['other_cpu_cores'], '.2f')} |")
    lines += ["", "TPOT ms (mean over requests completed in the window):", "",
              "| C | " + " | ".join(names) + " |", "|--:|" + "--:|" * len(names)]
    for r in s:
        lines.append(f"| {r['concurrency']} | " + " | ".join(f(r[n]["tpot_ms_mean"]) for n in names) + " |")
    thr = [n for n in names if n.startswith("threshold")]
    if thr:
        lines += ["", f"{thr[0]}: share of decisions with k > 0 per C: " + ", ".join(
            f"C={r['concurrency']}: {f(1 - r[thr[0]]['k0_share'] if r[thr[0]]['k0_share'] is not None else None, '.2f')}"
            for r in s)]
    for key, title in (("off_cost", "Off costs nothing"),
                       ("off_cost_random_head", "Off costs nothing, random head (adaptive on a never-accepted head)")):
        off = result.get(key)
        if off:
            lines += ["", f"{title} (C={off['concurrency']}, {off['seconds']:.0f} s each, none vs adaptive): "
                      f"TPOT adaptive/none {f(off['tpot_ratio'], '.3f')}, tok/s ratio {f(off['tok_s_ratio'], '.3f')}, "
                      f"adaptive k=0 share {f(off['adaptive_k0_share'], '.3f')}"
                      + (f"; adaptive held at k = 0: TPOT {f(off['floor']['tpot_ratio'], '.3f')}, tok/s "
                         f"{f(off['floor']['tok_s_ratio'], '.3f')}" if off.get("floor") else "")]
    ramp = result.get("ramp")
    if ramp and "adaptive_vs_none" in ramp:
        rv = ramp["adaptive_vs_none"]
        ad = ramp["configs"]["adaptive"]
        lines += ["", f"Ramp (C {ramp['levels']}, {ramp['level_s']:.0f} s per level on each engine's clock, "
                  f"{ramp['window_s']:.0f} s windows): none {f(ramp['configs']['none']['tok_s'])} tok/s, adaptive "
                  f"{f(ad['tok_s'])} tok/s (x{f(rv['overall_ratio'], '.3f')}); worst window x{f(rv['min_ratio'], '.3f')}; "
                  f"on/off switches {ad.get('switches')}, decisions with a k change {ad.get('k_changes')} "
                  f"of {ad.get('decisions')}, explorations {ad.get('explorations')}",
                  "", "window ratios (adaptive / none, C): " + ", ".join(
                      f"{f(x, '.2f')}@{c}" for x, c in zip(rv["window_ratios"], rv["window_levels"]))]
        if ad.get("windows_k0_share"):
            lines += ["", "adaptive k = 0 share per window: " + ", ".join(f(x, '.2f') for x in ad["windows_k0_share"])]
    return "\n".join(lines) + "\n"


def plots(result: dict[str, Any], out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = result["configs"]
    s = result["summary"]
    paths: list[str] = []
    if s:
        paths.append(_sweep_plot(plt, names, s, out_dir))
    ramp = result.get("ramp")
    if ramp:
        paths.append(_ramp_plot(plt, ramp, out_dir))
    return paths


def _sweep_plot(plt, names: list[str], s: list[dict[str, Any]], out_dir: str) -> str:
    cs = [r["concurrency"] for r in s]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for n in names:
        style = dict(lw=2.5, color="black") if n == "adaptive" else dict(lw=1.2)
        axes[0].plot(cs, [r[n]["tok_s"] for r in s], marker="o", label=n, **style)
        axes[1].plot(cs, [r[n]["tpot_ms_mean"] for r in s], marker="o", label=n, **style)
    for ax, title in zip(axes, ("output tok/s", "TPOT ms (mean)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M + EAGLE-3 head, {device_name()}: adaptive vs. fixed speculation", fontsize=10)
    fig.tight_layout()
    path = os.path.join(out_dir, "adaptive_sweep.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ramp_plot(plt, ramp: dict[str, Any], out_dir: str) -> str:
    fig, ax = plt.subplots(figsize=(11, 3.8))
    w = ramp["window_s"]
    for n, cfg in ramp["configs"].items():
        wins = cfg["windows_tok_s"]
        ax.plot([(i + 0.5) * w for i in range(len(wins))], wins, marker=".", label=n)
    ax2 = ax.twinx()
    lv = ramp["levels"]
    ax2.step([i * ramp["level_s"] for i in range(len(lv) + 1)], lv + lv[-1:], where="post", color="gray", alpha=0.5)
    ax2.set_ylabel("concurrency", color="gray")
    ax.set_xlabel("engine seconds")
    ax.set_ylabel("output tok/s")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = os.path.join(out_dir, "adaptive_ramp.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- main --------------------------------------------------------------------------------------
