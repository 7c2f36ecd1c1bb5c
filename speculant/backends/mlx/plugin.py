"""Registers the MLX backend and its pairing checks through the public hooks.

Nothing here imports mlx at module level: the registry and the validator stay importable
on machines without it.
"""

from speculant.plugin_api import hookimpl


@hookimpl
def register_backends(register):
    from speculant.backends.mlx.backend import MLXBackend

    register(MLXBackend)


@hookimpl
def check_pairing(config, target, drafter):
    from speculant.backends.mlx.checks import check_pairing as check

    return check(config, target, drafter)
