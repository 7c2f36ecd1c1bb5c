"""Third-party chatter kept off the user's terminal: the one place speculant quiets other
libraries' logging and warnings (the CLI calls it unless ``--debug`` or ``-v``).

What it hides on a normal run: transformers' notes at load (``The following layers were not
sharded``, its load report) and at the first forward of a hybrid (``... is falling back to its
reference PyTorch implementation``), torchao's notes about GPU kernels it cannot load, torch's
pytree deprecation notes, Python warnings raised inside those libraries, weight-loading bars.
Errors still show. Nothing here imports those libraries: loggers are configured by name, and
transformers reads ``TRANSFORMERS_VERBOSITY`` when it sets its own logger up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from typing import Iterator

# torch sets its top logger's level when it loads, so its noisy children are named here too
LOGGERS = ("transformers", "torch", "torch.utils._pytree", "torchao", "mlx", "mlx_lm", "huggingface_hub",
           "accelerate")
WARNING_MODULES = r"(transformers|torch|torchao|mlx|mlx_lm|huggingface_hub|accelerate)(\..*)?$"
ENVIRONMENT = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}


@contextlib.contextmanager
def third_party_quiet(enabled: bool = True) -> Iterator[None]:
    """While inside, other libraries log errors only and their Python warnings are dropped; the
    levels, filters and environment are restored on leaving. A variable the user set wins."""
    if not enabled:
        yield
        return
    set_here = [name for name in ENVIRONMENT if name not in os.environ]
    levels = {name: logging.getLogger(name).level for name in LOGGERS}
    for name in set_here:
        os.environ[name] = ENVIRONMENT[name]
    for name in LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=WARNING_MODULES)
            yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        for name in set_here:
            os.environ.pop(name, None)
