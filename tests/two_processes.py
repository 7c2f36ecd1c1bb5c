"""Running a script as two data-parallel CPU processes with torch.distributed.run (gloo)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Sequence

# A child aborting in C++ right after start-up ("terminate called without an active exception",
# SIGABRT) was seen once on a loaded 2-core CI machine; it is not our code's failure mode.
STARTUP_ABORT = ("terminate called without an active exception", "Signal 6 (SIGABRT)")


def run_two_processes(script_args: Sequence[str | Path], clean: Path, env: dict | None = None,
                      timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``python -m torch.distributed.run --nproc_per_node 2 --standalone SCRIPT ARGS``.

    Retried once, after removing ``clean`` (the run's output), only when a child aborted as
    above; every other failure is returned as it is.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", *map(str, script_args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    for attempt in range(2):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0 or attempt or not any(s in proc.stderr for s in STARTUP_ABORT):
            return proc
        shutil.rmtree(clean, ignore_errors=True)
    return proc
