"""The adaptive policy's modes and per-cycle actions, and the small records it keeps.

``docs/adaptive.md`` draws the modes as a state diagram; the enum values are what
``decisions()`` reports (``mode``, ``actions``, ``events[].mode``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Mode(str, Enum):
    """Where the policy is in its life: what the next cycle's ``wants_draft`` starts from."""

    WARMUP = "warmup"  # a scripted first few cycles that measure both ends of the cost curve
    SPECULATE = "speculate"  # drafting, at the width the cost model and acceptance pick
    FALLBACK = "fallback"  # plain target steps, counting down to the next probe
    PROBE = "probe"  # drafting again, narrow first, to see whether speculation pays now


class Action(str, Enum):
    """What one cycle was: its entry in ``decisions()["actions"]``."""

    PROBE = "probe"  # drafts submitted by a warm-up or fallback probe
    SPECULATE = "speculate"  # drafts submitted at the planned width
    TREE = "tree"  # a draft tree verified (option tree = auto), outside the chain policy
    BATCHED = "batched"  # verified in a batch at the width the scheduler's plan gave (core/batch_plan.py)
    PLAIN_WARMUP = "plain:warmup"  # a plain step the warm-up measures
    PLAIN_COST = "plain:cost"  # fallback: plain decoding is the faster
    PLAIN_SHORT = "plain:short"  # the request's last, narrower cycle would not pay (or no decision was asked)
    PLAIN_MAX_CONTEXT = "plain:max_context"  # past ``max_context``
    PLAIN_REFRESH = "plain:refresh"  # re-measuring the plain-step cost while speculating
    PLAIN_CONFIDENCE = "plain:confidence"  # this cycle's draft confidences make width 0 the best

    @property
    def plain(self) -> bool:
        """A plain target step: no drafts go to the target."""
        return self not in (Action.PROBE, Action.SPECULATE, Action.TREE, Action.BATCHED)

    @property
    def reason(self) -> str | None:
        """Why a plain cycle was plain (its ``fallback_cycles`` key); None when drafts were submitted."""
        return self.name.removeprefix("PLAIN_").lower() if self.plain else None


class ProbeStage(str, Enum):
    NARROW = "narrow"  # the first probe cycles submit as few drafts as cost no more than one
    FULL = "full"  # a narrow probe passed but did not prove speculation pays: one full-width cycle


WARMUP = (Action.PROBE, Action.PLAIN_WARMUP, Action.PROBE, Action.PROBE, Action.PLAIN_WARMUP, Action.PROBE)


@dataclass(frozen=True)
class Estimate:
    plain_rate: float  # tokens per second of plain steps
    spec_rate: float  # best tokens per second when speculating, from history alone
    spec_width: int  # the n giving spec_rate

    def pays(self, band: float = 0.0) -> bool:
        """Whether speculating is no slower than plain steps by more than ``band`` (a share)."""
        return self.spec_rate >= self.plain_rate * (1.0 - band)


@dataclass
class Request:
    """The current request, as far as the policy follows it."""

    k: int = 1  # drafts allowed this cycle
    k_block: int = 1  # drafts a full block allows (the largest k seen in this request)
    context_length: int = 0
    cycle: int = 0  # cycles of the current request
    events: list[dict] = field(default_factory=list)


@dataclass
class CyclePlan:
    """What this cycle's decisions left for ``observe``."""

    action: Action | None = None  # None until wants_draft (or plan) decided
    confidence: list[float | None] | None = None  # the confidences the width was chosen with
    predicted: list[float] = field(default_factory=lambda: [1.0])  # P(t tokens committed), t = 1..n+1


@dataclass
class Schedule:
    """Bookkeeping of the speculating mode: the cached comparison and when to re-check it."""

    last: Estimate | None = None  # the latest speculation-vs-plain comparison
    checks_due: int = 0  # cycles until it is redone (estimates move slowly)
    rate: float = 0.0  # tokens per second to beat: max(plain, best speculative)
    since_plain: int = 0  # cycles since the last plain step
    plain_run: int = 0  # plain steps in a row just before this cycle (the drafter's unread target rows)
    speculated: int = 0  # speculative decisions made (schedules exploration)
