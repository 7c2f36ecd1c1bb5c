"""The adaptive verifier: a per-cycle verify width from a measured cost model (docs/adaptive.md).

- :mod:`.verifier`: the ``adaptive`` verifier, the engine's hooks and the decision log;
- :mod:`.policy`: the decisions, cycle by cycle; :mod:`.probing`: fallback's probe schedule;
- :mod:`.states`: modes, actions and the small records the policy keeps; :mod:`.options`;
- :mod:`.acceptance`, :mod:`.cost`, :mod:`.drift`, :mod:`.rates`: the models the decisions read.
"""

from speculant.verifiers.adaptive.options import AdaptiveOptions
from speculant.verifiers.adaptive.policy import AdaptivePolicy
from speculant.verifiers.adaptive.states import WARMUP, Action, Mode, ProbeStage
from speculant.verifiers.adaptive.verifier import AdaptiveVerifier, host_confidence

__all__ = ["WARMUP", "Action", "AdaptiveOptions", "AdaptivePolicy", "AdaptiveVerifier", "Mode", "ProbeStage", "host_confidence"]
