"""When fallback tries drafting again, and what a probe's outcome does to that schedule.

Three schedules bring a probe: the back-off (an interval that doubles while probes fail), a
request start (a request has its own few probes), and output that repeats itself (a loop is the
easiest text to draft). ``docs/adaptive.md`` describes them; this module only keeps their state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from speculant.verifiers.adaptive.drift import RepeatWatch
from speculant.verifiers.adaptive.options import AdaptiveOptions
from speculant.verifiers.adaptive.states import ProbeStage


@dataclass
class RequestProbes:
    """Probes scheduled by request starts while in fallback (``probe_each_request``)."""

    active: bool = False  # the current probe was scheduled by a request start
    left: int = 0  # request probes still to come in this request
    gap: int = 1  # requests between request-start probes while they keep failing
    waited: int = 0  # requests since the last request-start probe


@dataclass
class RepeatProbes:
    """Probes brought forward by output that repeats an earlier span of itself (``probe_on_repeat``)."""

    gap: int  # fewest cycles after a probe before a repeat brings the next one forward
    watch: RepeatWatch = field(default_factory=RepeatWatch)
    active: bool = False  # the current probe was brought forward by repeating output
    resume_countdown: int = 0  # the back-off's remaining cycles, kept while a repeat probe runs


class Prober:
    """The probe schedule of fallback and the progress of the current probe."""

    def __init__(self, options: AdaptiveOptions) -> None:
        self.o = options
        self.interval = options.probe_interval  # the back-off: plain cycles between probes
        self.countdown = 0  # plain cycles left until the next probe
        self.stage = ProbeStage.NARROW
        self.tries = 0  # first drafts rejected in the current probe
        self.since = 0  # cycles since the last probe cycle
        self.request = RequestProbes()
        self.repeat = RepeatProbes(gap=options.probe_interval)

    def start_fallback(self) -> None:
        """Speculation stopped paying: the first re-check comes soon."""
        self.countdown = self.interval = self.o.probe_interval

    def due(self) -> bool:
        """One fallback cycle passes; True when it is time to probe (narrow first)."""
        self.countdown -= 1
        if self.countdown > 0:
            return False
        self.stage, self.tries = ProbeStage.NARROW, 0
        return True

    def cycle_done(self, probed: bool, token_ids: Sequence[int]) -> bool:
        """Count a finished cycle; True when its tokens completed a repeated span (while ``probe_on_repeat``)."""
        self.since = 0 if probed else self.since + 1
        return self.o.probe_on_repeat and self.repeat.watch.add(token_ids)  # no bookkeeping when off

    def bring_forward(self) -> bool:
        """Probe next cycle because the output repeats itself, ``repeat.gap`` cycles after the last
        probe at the earliest. A failed one doubles that gap for the rest of the request and leaves
        the back-off's schedule as it was. True when the probe was brought forward."""
        if self.countdown <= 1 or self.since < self.repeat.gap:
            return False
        self.repeat.active, self.repeat.resume_countdown, self.countdown = True, self.countdown - 1, 1
        return True

    def retry(self, narrow: bool) -> bool:
        """The probe's first draft was rejected: whether to try another anchor before it counts as
        failed (``probe_cycles`` tries; one for request and repeat probes, which come again)."""
        self.tries += 1
        tries = 1 if self.request.active or self.repeat.active else self.o.probe_cycles
        return narrow and self.tries < tries

    def resumed(self) -> None:
        """The probe showed that speculation pays again."""
        self.request.gap, self.request.active, self.repeat.active = 1, False, False

    def failed(self, min_interval: Callable[[], int]) -> None:
        """The probe did not pay: wait for the request's next probe, or back off (twice as long as
        last time, at least ``min_interval()``)."""
        if self.repeat.active:  # a hint that did not pay: the back-off carries on where it was
            self.repeat.active = False
            self.repeat.gap = min(2 * self.repeat.gap, self.o.max_probe_interval)
            self.countdown = self.repeat.resume_countdown
        elif self.request.active and self.request.left > 0:  # this request's own schedule
            self.request.left -= 1
            self.countdown = self.o.probe_interval
        else:
            self.interval = min(max(2 * self.interval, min_interval()), self.o.max_probe_interval)
            self.countdown = self.interval
            if self.request.active:
                self.request.gap, self.request.active = min(2 * self.request.gap, self.o.request_probe_gap), False

    def begin_request(self, in_fallback: bool) -> None:
        """A new request: repeats start over, and in fallback it probes early on its own schedule
        (not at once: a request's first tokens are atypical), every ``request.gap`` requests."""
        self.repeat.watch.reset()
        self.repeat.gap = self.o.probe_interval
        self.request.waited += 1
        if in_fallback and self.o.probe_each_request and self.request.waited >= self.request.gap:
            self.countdown = min(self.countdown, self.o.request_probe_delay + 1)
            self.request.waited = 0
            self.request.active = True
            self.request.left = self.o.request_probes - 1
