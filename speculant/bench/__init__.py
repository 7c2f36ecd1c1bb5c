"""``speculant bench``: reproducible A/B benchmarks of plain vs speculative decoding.

    from speculant.bench import BenchConfig, run_bench
    summary = run_bench(BenchConfig.load("bench.toml"))

See :mod:`speculant.bench.config` for the config file, :mod:`speculant.bench.runner` for the
output folder, :mod:`speculant.bench.stats` for the arithmetic.
"""

from speculant.bench.config import BenchConfig
from speculant.bench.runner import BenchInterrupted, run_bench
from speculant.bench.summary import BenchSummary

__all__ = ["BenchConfig", "BenchInterrupted", "BenchSummary", "run_bench"]
