"""PyTorch on a CPU: compiled graphs with inductor's C++ wrapper against its Python wrapper
(speculant's current setting), on the shipped pair: load seconds (compiling every width) and
decode tok/s, plain and with the default drafter, interleaved.

    python benchmarks/compile_wrapper.py [--drafter dflash2] [--repeats 3] [--max-new-tokens 128]
                                         [--threads 1] [--keep-cache]

The compiler cache starts empty (a fresh ``TORCHINDUCTOR_CACHE_DIR``) unless ``--keep-cache``, so
the load seconds are what a first load costs; the Python-wrapper arms load first. Each repeat runs
every arm over the same six code prompts; tok/s are medians over prompts and repeats, and the
tokens of the two wrappers are compared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

PROMPTS = ["def parse_args(argv):", "import os\nimport sys\n\n\ndef main():\n", "class Stack:\n    def __init__(self):",
           "def fibonacci(n):", "for i in range(10):", "def read_config(path):"]


def load(cpp_wrapper: bool, drafter: str):
    import speculant
    from speculant import embedded
    from speculant.backends.torch import compiled

    init = compiled.CompiledSteps.__init__

    def with_wrapper(self, step, device):
        init(self, step, device)
        self._options = {"options": {"cpp_wrapper": cpp_wrapper}}

    config = embedded.engine_config(drafter, backend="torch")
    config["backend"] = {**config["backend"], "compile": "on", "dtype": "float32", "device": "cpu"}
    compiled.CompiledSteps.__init__ = with_wrapper
    try:
        started = time.perf_counter()
        return speculant.load_engine(config), time.perf_counter() - started
    finally:
        compiled.CompiledSteps.__init__ = init


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default="dflash2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--keep-cache", action="store_true")
    args = parser.parse_args()
    if not args.keep_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-cold-")
    import torch

    torch.set_num_threads(args.threads)
    engines = {}
    for cpp_wrapper in (False, True):
        for drafter in ("none", args.drafter):
            arm = f"{'cpp' if cpp_wrapper else 'python'} wrapper, {drafter}"
            engines[arm], seconds = load(cpp_wrapper, drafter)
            print(f"{arm}: load {seconds:.1f} s", flush=True)
    tokenizer = next(iter(engines.values())).tokenizer
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    rates, outputs = {arm: [] for arm in engines}, {}
    for _ in range(args.repeats):
        for arm, engine in engines.items():
            for prompt in prompts:
                started = time.perf_counter()
                result = engine.run(prompt_ids=prompt, max_new_tokens=args.max_new_tokens, ignore_eos=True)
                rates[arm].append(len(result.token_ids) / (time.perf_counter() - started))
                outputs.setdefault((arm.split(", ")[1], tuple(prompt)), set()).add(tuple(result.token_ids))
    for arm, values in rates.items():
        print(f"{arm}: {statistics.median(values):.1f} tok/s")
    print("identical tokens across wrappers:", all(len(v) == 1 for v in outputs.values()))


if __name__ == "__main__":
    main()
