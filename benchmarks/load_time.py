"""Seconds to load a pair's engine on a CPU: the first load on a machine (the weight layouts timed,
core/timing.py) and the loads after it (the timings read back from the file the first one wrote),
per backend, each in a fresh process so no import or allocation is shared.

    python benchmarks/load_time.py [--pair smollm2] [--backend torch mlx] [--loads 3]

The timings file starts empty (a temporary ``SPECULANT_TIMINGS``); the pair is pulled first if
it is not cached. Prints one line per load and, per backend, the first load over the median of
the later ones.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

LOAD = """
import json, sys, time
import speculant
from speculant import pairs
config = pairs.engine_config(sys.argv[1], backend=sys.argv[2])
config["backend"] = {**config["backend"], "device": "cpu", "dtype": "float32"}
started = time.perf_counter()
engine = speculant.load_engine(config)
print(json.dumps({"seconds": time.perf_counter() - started, "fast_path": engine.target.fast_path}))
"""


def load_once(pair: str, backend: str, timings: str) -> dict:
    env = {**os.environ, "SPECULANT_TIMINGS": timings}
    done = subprocess.run([sys.executable, "-c", LOAD, pair, backend], env=env, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", default="smollm2")
    parser.add_argument("--backend", nargs="+", default=["torch", "mlx"])
    parser.add_argument("--loads", type=int, default=3, help="loads per backend, the first one timing")
    args = parser.parse_args()
    from speculant import pairs

    pairs.engine_config(args.pair)  # pulled (and converted) before any load is timed
    for backend in args.backend:
        with tempfile.TemporaryDirectory() as scratch:
            timings = os.path.join(scratch, "timings.json")
            seconds = []
            for index in range(args.loads):
                out = load_once(args.pair, backend, timings)
                seconds.append(out["seconds"])
                print(f"{backend} load {index + 1}: {out['seconds']:.1f} s  ({out['fast_path']})", flush=True)
        later = statistics.median(seconds[1:]) if len(seconds) > 1 else float("nan")
        print(f"{backend}: first load {seconds[0]:.1f} s, later loads {later:.1f} s (median), "
              f"{seconds[0] / later:.1f}x")


if __name__ == "__main__":
    main()
