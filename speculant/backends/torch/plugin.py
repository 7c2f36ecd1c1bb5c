"""Registers the PyTorch backend through the public hooks."""

from speculant.plugin_api import hookimpl


@hookimpl
def register_backends(register):
    from speculant.backends.torch.backend import TorchBackend

    register(TorchBackend)
