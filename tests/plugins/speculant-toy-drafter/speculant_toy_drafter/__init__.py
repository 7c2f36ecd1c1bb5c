"""speculant-toy-drafter: a prompt-lookup (n-gram) drafter, shipped as a separate plugin package.

It exists to prove that a third-party distribution, installed with pip and discovered through
the ``speculant`` entry-point group, can add a drafter an engine config then uses
(``drafter.kind = "toy"``).
"""

from speculant.plugin_api import hookimpl
from speculant_toy_drafter.drafter import ToyDrafter, ToyDrafterFactory, ToyOptions

__all__ = ["ToyDrafter", "ToyDrafterFactory", "ToyOptions", "register_drafters"]


@hookimpl
def register_drafters(register):
    register(ToyDrafterFactory())
