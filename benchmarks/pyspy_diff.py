"""Where each engine's host time goes, from a sampling profiler run over host_overhead.py: per function, the
microseconds per engine step it was on the stack (inclusive) and at its top (own), against the first engine.

cProfile (host_overhead's own table) slows every Python call by a fixed amount, so it overstates code that
makes many small calls; torch.profiler's CUPTI hooks slow CUDA graph launches. A sampler does neither. Run:

    py-spy record --idle -r 1000 -f raw -o spy.txt -- python benchmarks/host_overhead.py --device cuda \\
        --dummy-smollm2 --concurrency 64 --configs nospec,spec_off,adaptive_at_0 --output-file ho.json
    python benchmarks/pyspy_diff.py spy.txt ho.json --rate 1000

Each engine's timed rounds run under ``timed[<config>]`` (host_overhead.serve_as); its steps per round come
from host_overhead's JSON. ``--idle`` keeps the samples where the host waits (a CUDA sync), which are part of
a step's wall time.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from typing import Any

TIMED = re.compile(r"^timed\[(?P<name>[^\]]+)\]")
LINE = re.compile(r":\d+$")


def frame_key(frame: str) -> str:
    """``func (path:line)`` -> ``func (file)``: a function, whichever of its lines ran."""
    name, _, where = frame.partition(" (")
    if not where:
        return name
    path = LINE.sub("", where.rstrip(")"))
    return f"{name} ({path.rsplit('/', 1)[-1]})"


def parse(path: str) -> dict[str, dict[str, collections.Counter]]:
    """Per engine: samples per function on the stack (``inclusive``, each function once per sample), at its
    top (``own``), and ``total`` samples, counting only the stacks inside that engine's timed rounds."""
    out: dict[str, dict[str, collections.Counter]] = {}
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            at = next((i for i, fr in enumerate(frames) if TIMED.match(fr)), None)
            if at is None:
                continue
            name = TIMED.match(frames[at]).group("name")  # type: ignore[union-attr]
            d = out.setdefault(name, {"inclusive": collections.Counter(), "own": collections.Counter(),
                                      "total": collections.Counter()})
            n = int(count)
            d["total"]["samples"] += n
            inner = [frame_key(fr) for fr in frames[at + 1:]]
            for key in set(inner):
                d["inclusive"][key] += n
            d["own"][inner[-1] if inner else "(serve loop)"] += n
    return out


def per_step(samples: float, rate: float, steps: int) -> float:
    return 1e6 * samples / rate / steps


def diff(parsed: dict[str, dict[str, collections.Counter]], steps: dict[str, int], rate: float,
         first: str, top: int) -> dict[str, Any]:
    """Per engine: its microseconds per step in all, and per function (inclusive and own) against ``first``."""
    res: dict[str, Any] = {}
    base = parsed[first]
    for name, d in parsed.items():
        row: dict[str, Any] = {"us_per_step": round(per_step(d["total"]["samples"], rate, steps[name]), 1),
                               "samples": d["total"]["samples"]}
        if name != first:
            for kind in ("inclusive", "own"):
                keys = set(d[kind]) | set(base[kind])
                rows = [(per_step(d[kind][k], rate, steps[name]) - per_step(base[kind][k], rate, steps[first]), k)
                        for k in keys]
                rows.sort(key=lambda r: -abs(r[0]))
                row[kind] = [{"function": k, "us": round(v, 1)} for v, k in rows[:top]]
        res[name] = row
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("raw", help="py-spy record -f raw output")
    ap.add_argument("host_overhead_json", help="the same run's host_overhead.py --output-file")
    ap.add_argument("--rate", type=float, default=100.0, help="py-spy's -r (samples per second)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--output-file", default=None)
    args = ap.parse_args(argv)
    ho = json.load(open(args.host_overhead_json))
    rounds = ho["settings"]["rounds"]
    names = list(ho["configs"])
    steps = {n: c["engine_steps"] * rounds for n, c in ho["configs"].items()}
    parsed = parse(args.raw)
    missing = [n for n in names if n not in parsed]
    if missing:
        sys.exit(f"no samples inside timed[...] for {missing}: was host_overhead.py run under the sampler?")
    res = diff(parsed, steps, args.rate, names[0], args.top)
    for n in names:
        r = res[n]
        print(f"{n}: {r['us_per_step']:.0f} us/step sampled ({r['samples']} samples), "
              f"host_overhead {ho['configs'][n]['ms_per_step']} ms/step (best round)")
        for kind in ("inclusive", "own"):
            for row in r.get(kind, []):
                print(f"  {kind:9s} {row['us']:+8.1f}  {row['function'][:110]}")
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump({"benchmark": "pyspy_diff", "command": "python benchmarks/pyspy_diff.py " + " ".join(
                argv if argv is not None else sys.argv[1:]), "engines": res}, f, indent=1)
    return res


if __name__ == "__main__":
    main()
