"""Registers the PyTorch backend through the public hooks."""

from speculant.plugins.hookspecs import hookimpl


@hookimpl
def register_backends(register):
    from speculant.backends.torch.backend import TorchBackend

    register(TorchBackend)
