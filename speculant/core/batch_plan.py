"""How many drafts each batched request verifies this cycle (issue #39; docs/batching.md).

A batched forward's cost depends on the tokens of every row together, not on one request: it is
read off the measured (tokens computed, seconds) of recent cycles, interpolated between them (a
fitted ``fixed + per_token * tokens`` line while too few are known), plus the draft call's time
for the rows drafting (one forward for all rows where the drafter can: read off the measured
(rows drafted, seconds) the same way). A request's draft position ``j`` is
worth its chance of being accepted, ``P(drafts 1..j accepted)``, read from the request's own
verified cycles, pooled with every other request's (finished or live) while it has few. A row drafts ``d`` tokens
when what they are expected to add beats what the same seconds give at the batch's present rate
(tokens per second of the cycle without them); otherwise it takes a plain step (no draft). So
where the forward is compute-bound (a CPU, a large batch) speculation turns itself down row by
row, and the engine stays at batched plain decoding's speed rather than below it.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import numpy as np

from speculant.core.cost_curve import curve, interpolated, read
from speculant.core.metrics import GenerationStats

PRIOR_CYCLES = 4.0  # how many cycles the pooled acceptance weighs in a request's own estimate
EXPLORE_EVERY = 64  # every this many cycles one row drafts (and joins, one starts its drafter)
EXPLORE_MOST = 1024  # the explorations' spacing doubles up to this while the plan keeps every row plain
EXPLORE_TOKENS = 32  # an exploration's drafts widen the padded block by at most this many tokens in all
EXPLORE_SHARE = 0.01  # explorations take at most about this share of the cycles' time (spacing them out)
OWN_CYCLES = 2  # a request's first drafting cycles are in full (padded: up to the block's width), to measure it
STEADY = 3  # draft calls over one row count before that count's median is read as its cost
WARM_UP = 4  # cycles measured (plain and full width in turn) before widths are planned
EVIDENCE = 16  # drafted row-cycles verified (pooled) before the plan's acceptance is trusted to turn drafting off
THIN_EVERY = 8  # until then, an exploration this many cycles apart


class BatchPlan:
    """The cost model of one scheduler's batched forwards and the widths planned from it."""

    def __init__(self) -> None:
        self.samples: deque[tuple[int, int, float]] = deque(maxlen=64)  # (rows, tokens, forward seconds)
        self.cycles = 0
        self.computed = 0  # tokens the batched forwards computed, padding included (stats)
        self.explore_every = EXPLORE_EVERY
        self._explore_at = EXPLORE_EVERY  # the cycle of the next exploration
        self._explored = 0
        self._explored_at = 0  # the cycle of the last exploration
        self._spaced_at = 0  # no exploration before this cycle: the last one's cost (EXPLORE_SHARE)
        self._exploring = False  # the cycle being run is an exploration
        self._memo: dict = {}  # seconds read off the samples, until the next observation
        self._drafted_since = True  # the plan gave some row drafts since the last exploration (or none was made)
        self._submitted = np.zeros(0)  # pooled over every request's cycles
        self._accepted = np.zeros(0)
        self.draft_samples: deque[tuple[int, float]] = deque(maxlen=64)  # (rows drafted, seconds of the draft call)
        self.planned_plain = 0  # row-cycles planned as plain steps (stats)
        self.joins = 0  # requests that joined a batch
        self.enabled = True  # False: every row drafts as its verifier plans, whatever the load
        self.padded = True  # the batch pads every row to the widest (BatchedTarget.padded)

    # -- measurements ----------------------------------------------------------------------------
    def observe(self, rows: int, tokens: int, seconds: float, drafted: int = 0, draft_seconds: float = 0.0) -> None:
        """One batched cycle: its rows, the tokens its forward computed (padding included), its
        seconds, and its draft call: the rows it drafted and its seconds (within ``seconds``)."""
        self.cycles += 1
        self.computed += tokens
        if self._exploring:  # priced against the plain cycles measured before it
            self._space_explorations(rows, seconds)
        if drafted:
            self.draft_samples.append((drafted, draft_seconds))
        self.samples.append((rows, tokens, max(seconds - draft_seconds, 1e-9)))
        self._memo.clear()  # after the sample: a curve read above must not outlive it

    def _space_explorations(self, rows: int, seconds: float) -> None:
        """The next exploration no sooner than its extra seconds over a plain cycle's make
        ``EXPLORE_SHARE`` of the cycles' time (a 16-row exploration of SmolLM2 on a CPU cost 1.3
        plain cycles more: one in 64 cycles took 2 % of a run)."""
        self._exploring = False
        plain = self._seconds(rows, rows)
        if not plain > 0:
            return
        extra = seconds / plain - 1.0
        spacing = min(int(extra / EXPLORE_SHARE), EXPLORE_MOST)
        self._spaced_at = self.cycles + spacing
        self._explore_at = max(self._explore_at, self._spaced_at)

    def draft_seconds(self, rows: int) -> float:
        key = ("draft", rows)
        if key not in self._memo:
            self._memo[key] = self._draft_seconds(rows)
        return self._memo[key]

    def _draft_seconds(self, rows: int) -> float:
        """The draft call's seconds for ``rows`` drafting rows (0 for none), as measured: read off
        the row counts seen at least ``STEADY`` times (one slow call must not price a count), a
        fitted line (never falling) while fewer than two are, one call's median while only one
        count was seen (one forward for every row: no cheaper for fewer)."""
        if rows <= 0 or not self.draft_samples:
            return 0.0
        counts = {k: sum(1 for n, _ in self.draft_samples if n == k) for k, _ in self.draft_samples}
        steady = [(k, s) for k, s in self.draft_samples if counts[k] >= STEADY]
        if len({k for k, _ in steady}) >= 2:
            return interpolated(steady, rows)
        ks, seconds = np.array([k for k, _ in self.draft_samples], float), np.array([s for _, s in self.draft_samples])
        if np.ptp(ks) > 0:
            per_row, fixed = np.polyfit(ks, seconds, 1)
            per_row = max(per_row, 0.0)
            return float(max(fixed, 0.0) + per_row * rows) if fixed > 0 else float(np.median(seconds / ks) * rows)
        return float(np.median(seconds))

    def pool(self, stats: GenerationStats) -> None:
        """Add a finished request's per-position acceptance to the pooled estimate."""
        sub, acc = np.asarray(stats.submitted_per_position, float), np.asarray(stats.accepted_per_position, float)
        n = max(sub.size, self._submitted.size)
        self._submitted = _padded(self._submitted, n) + _padded(sub, n)
        self._accepted = _padded(self._accepted, n) + _padded(acc, n)

    def cost(self, rows: int) -> tuple[float, float]:
        """``(fixed, per_token)`` seconds of a forward over ``rows`` rows."""
        same = [(t, s) for r, t, s in self.samples if r == rows]
        data = same if len(same) >= 4 else [(t, s) for _, t, s in self.samples]
        tokens, seconds = np.array([t for t, _ in data], float), np.array([s for _, s in data], float)
        if tokens.size >= 3 and np.ptp(tokens) > 0:
            per_token, fixed = np.polyfit(tokens, seconds, 1)
            if per_token > 0 and fixed >= 0:
                return float(fixed), float(per_token)
        # no spread of widths to tell them apart: all cost per token, the cautious reading
        return 0.0, float(np.median(seconds / np.maximum(tokens, 1)))

    def seconds(self, rows: int, tokens: float) -> float:
        key = ("forward", rows, tokens)
        if key not in self._memo:
            self._memo[key] = self._seconds(rows, tokens)
        return self._memo[key]

    def _seconds(self, rows: int, tokens: float) -> float:
        """A forward's seconds over ``tokens`` computed tokens, read off the curve of the measured
        ones of ``rows`` rows (``cost_curve.read``; rarely a straight line: wider matrix products
        run faster per token; one point: in proportion to it); of any row count while none of
        ``rows`` is known, the fitted line while fewer than two are. (A curve mixing row counts
        read flat: after 4-row cycles of 4 and 32 tokens, 16 rows of 8 tokens were priced like 16
        rows of one, and a 16-request batch on the shipped pair drafted at a loss.)"""
        key = ("curve", rows)  # one curve a cycle: the plan reads it at every width it tries
        if key not in self._memo:
            same = [(t, s) for r, t, s in self.samples if r == rows]
            data = same or [(t, s) for _, t, s in self.samples]
            self._memo[key] = curve(data) if same or len({t for t, _ in data}) >= 2 else None
        if self._memo[key] is None:
            fixed, per_token = self.cost(rows)
            return fixed + per_token * tokens
        return read(*self._memo[key], tokens)

    # -- the plan ----------------------------------------------------------------------------------
    def limits(self, rooms: Sequence[int], stats: Sequence[GenerationStats],
               left: Sequence[int] | None = None) -> list[int]:
        """Drafts each row may verify this cycle (0: a plain step), at most its ``rooms[i]``;
        ``stats`` are the live requests' (their counts join the pooled ones as the prior);
        ``left``, each row's tokens still to make where the batch ends with its last request
        (:meth:`_toward_the_end`)."""
        if not self.enabled:
            return list(rooms)
        if self.cycles < WARM_UP:  # full widths and plain steps in turn: two points of the cost line
            return list(rooms) if self.cycles % 2 else [0] * len(rooms)
        if not any(rooms):
            return list(rooms)
        thin = not self.settled(stats)
        counts = _counts(stats, max(rooms))
        chances = self._chances(*counts, self._prior(max(rooms), counts=counts))
        chances[np.arange(chances.shape[1]) >= np.asarray(rooms)[:, None]] = 0.0  # past each row's room
        values = np.cumsum(chances, axis=1)
        values = values if left is None else self._toward_the_end(chances, values, rooms, left, stats)
        gains = [v[:room] for v, room in zip(values, rooms)]
        if self.cycles >= self._explore_at or (thin and self.cycles >= max(self._explored_at + THIN_EVERY,
                                                                             self._spaced_at)):
            return self._explore(rooms, gains, thin)  # a point off the plan's line; while thin, acceptance to pool
        limits = self._widths(gains)
        self._drafted_since = self._drafted_since or any(limits)
        limits = [self._own_width(limits, room) if _verified(s) < OWN_CYCLES else most
                  for room, most, s in zip(rooms, limits, stats)]
        self.planned_plain += limits.count(0)
        return limits

    def _toward_the_end(self, chances: np.ndarray, values: np.ndarray, rooms: Sequence[int],
                        left: Sequence[int], stats: Sequence[GenerationStats]) -> np.ndarray:
        """Where the caller wants every result together (``generate_many``) and no request waits,
        the batch lasts as long as its last request: a token is worth the seconds it takes off
        that end. Each row's own tokens save its own seconds (the forward's cost of one more
        token) by ending sooner; the forward's fixed seconds are shared by the rows that may yet
        be last (:func:`_may_be_last`). Where which of them ends last is open by a cycle or more,
        each one's gains count; where it is settled, the batch ends a cycle sooner only where all
        of them gain one, so only the drafts they all accept count (position ``j``: the product
        of their chances). Gains are rescaled to the rate reading's value of a token, ``plain /
        rows``. (The default pair at 4 requests: copies accepted on rows tied for last beside
        rows with none made the batch no shorter, 0.95x plain; docs/history/batching-history.md.)"""
        rows = len(rooms)
        plain = self.seconds(rows, rows)
        if rows < 2 or not plain > 0:
            return values
        own = min(max(self.seconds(rows, rows + 1) - plain, 0.0), plain / rows)
        near, spread = _may_be_last(left, stats, chances)  # chances[i, j]: P(at least j + 1 accepted)
        sizes = np.asarray(rooms)
        # a row whose room holds all it has left ends once its drafts are accepted
        last = chances[np.arange(rows), np.maximum(sizes - 1, 0)]
        after = np.where((sizes > 0) & (sizes + 1 >= np.asarray(left)), last, 0.0)
        filled = np.where(np.arange(chances.shape[1]) < sizes[:, None], chances, after[:, None])
        together = filled[near].prod(axis=0)  # P(every row that may be last accepts drafts 1..j)
        mix = min(1.0, float(spread[near].min()))  # 1: open, 0: settled (a row that will surely end last)
        share = (plain - rows * own) / int(near.sum())
        all_gain = share * (1 - mix) * np.cumsum(together)
        return (own * values + np.where(near[:, None], all_gain + share * mix * values, 0.0)) * rows / plain

    def _own_width(self, limits: Sequence[int], room: int) -> int:
        """A young request's drafts: in full, so its own acceptance is known early; but where blocks
        are padded only as wide as the plan made the block anyway, since widening it would widen
        every row's (16 rows of 8 tokens for one row's sake cost 4x a plain cycle of SmolLM2 on a
        CPU, and young requests joining one by one kept most cycles wide)."""
        return min(room, max(limits)) if self.padded else room

    def _explore(self, rooms: Sequence[int], gains: list[np.ndarray], thin: bool = False) -> list[int]:
        """One row (in turn) drafts its full width, padded only as far as ``EXPLORE_TOKENS`` more
        tokens in all (32 rows of 8 for one row's sake cost 4x a plain cycle of SmolLM2 on a CPU;
        of 2, 2x). While the plan keeps every row plain between explorations, each costs a padded
        block for one row's sake: they come half as often. While the pooled acceptance is
        ``thin`` (fewer than ``EVIDENCE`` drafted row-cycles: a request's first cycles, which
        accept least, would otherwise decide for good), every row drafts as wide, in padded
        columns the one row's widening pays for anyway. Where no cycle of this many rows was
        measured wide and fewer rows' wide cycles say it might pay, every row drafts its room
        instead: explorations one token wider never measure what a wide block costs (the plan
        reads it in proportion; 32 rows of the mid pair, 8 tokens each on a CPU, cost half that)."""
        if not thin:
            self.explore_every = EXPLORE_EVERY if self._drafted_since else min(2 * self.explore_every, EXPLORE_MOST)
            self._explore_at, self._drafted_since = self.cycles + self.explore_every, False
        self._exploring, self._explored_at = True, self.cycles
        able = [i for i, room in enumerate(rooms) if room]  # rows with something to draft
        row, self._explored = able[self._explored % len(able)], self._explored + 1
        if self.padded and not thin and not self._wide_measured(len(rooms), max(rooms)) and \
                self._wide_might_pay(rooms, gains):
            return list(rooms)
        most = max(1, EXPLORE_TOKENS // len(rooms)) if self.padded else rooms[row]
        return [min(room, most) if i == row or (thin and self.padded) else 0 for i, room in enumerate(rooms)]

    def _wide_measured(self, rows: int, room: int) -> bool:
        """Whether a cycle of ``rows`` rows at least half as wide as a ``room``-draft block is measured."""
        return any(r == rows and t * 2 >= rows * (room + 1) for r, t, _ in self.samples)

    def _wide_might_pay(self, rooms: Sequence[int], gains: list[np.ndarray]) -> bool:
        """Whether every row drafting its room (``gains``: the plan's, per row) would beat a plain
        cycle if the block cost, against a plain one, what it costs at the most rows measured that
        wide (a guess from fewer rows, whose forwards are cheaper per row: worth measuring, not
        planning on)."""
        rows, room = len(rooms), max(rooms)
        fewer = [r for r in {r for r, _, _ in self.samples} if r < rows and self._wide_measured(r, room)]
        if not fewer:
            return False
        most, tokens = max(fewer), room + 1
        ratio = self.seconds(most, most * tokens) / self.seconds(most, most)
        plain = self.seconds(rows, rows)
        gained = sum(float(g[-1]) for g in gains if g.size)
        drafting = self.draft_seconds(sum(1 for k in rooms if k))
        return (rows + gained) / (plain * ratio + drafting) > rows / plain

    def settled(self, live: Sequence[GenerationStats] = ()) -> bool:
        """Whether the pooled acceptance (finished requests and the ``live`` ones) rests on
        ``EVIDENCE`` drafted row-cycles, so that the plan may turn drafting off for good (a request
        joining plain, rows that stop speculating)."""
        pooled = float(self._submitted[0]) if self._submitted.size else 0.0
        return not self.enabled or pooled + sum(_verified(s) for s in live) >= EVIDENCE

    def drafting_pays(self, rows: int, room: int, live: Sequence[GenerationStats] = ()) -> bool:
        """Whether a request joining ``rows`` others (``live``: their stats), with the pooled
        acceptance, would draft at all (False: it joins plain, its drafter never started). True
        until the cost is measured."""
        if not self.enabled or self.cycles < WARM_UP or room <= 0 or not self.settled(live):
            return True
        gains = np.cumsum(np.minimum.accumulate(self._prior(room, live)))
        return any(self._widths([gains] * (rows + 1)))

    def _widths(self, gains: list[np.ndarray]) -> list[int]:
        """Each row's drafts, given ``gains[i][d - 1]``: its expected accepted tokens from ``d`` drafts."""
        return self._padded_widths(gains) if self.padded else self._ragged_widths(gains, *self.cost(len(gains)))

    def _padded_widths(self, gains: list[np.ndarray]) -> list[int]:
        """A block padded to its widest row costs ``rows x widest`` tokens: one row's drafts widen
        every row's, and the others may then draft that wide for their share of the draft call. So
        each widest block is tried, with the rows worth most drafting in it, one more at a time."""
        rows = len(gains)
        best, best_rate = [0] * rows, rows / self.seconds(rows, rows)
        sizes = np.array([g.size for g in gains], dtype=int)
        table = np.zeros((rows, int(sizes.max(initial=0))))  # gains[i][d - 1] at [i, d - 1]
        for i, g in enumerate(gains):
            table[i, :g.size] = g
        drafting = np.array([self.draft_seconds(k) for k in range(1, int(np.count_nonzero(sizes)) + 1)])
        for width in range(2, int(sizes.max(initial=0)) + 2):
            depth = np.minimum(sizes, width - 1)
            able = np.flatnonzero(depth)
            gain = table[able, depth[able] - 1]
            order = np.lexsort((-able, -gain))  # worth most first (ties: the later row first)
            rates = (rows + np.cumsum(gain[order])) / (self.seconds(rows, rows * width) + drafting[:able.size])
            k = int(np.argmax(rates))
            if rates[k] > best_rate * (1 + 1e-9):  # a gain beyond rounding: a tie stays plain
                best, best_rate = [0] * rows, float(rates[k])
                for i in able[order[:k + 1]]:
                    best[i] = int(depth[i])
        return best

    def _ragged_widths(self, gains: list[np.ndarray], fixed: float, per_token: float) -> list[int]:
        """Flattened rows cost their own tokens: rows are taken in order of what their drafts are
        worth, each drafting as far as it gains more than the same seconds give at the present rate."""
        tokens, seconds = float(len(gains)), fixed + per_token * len(gains)  # every row's anchor
        limits, drafting = [0] * len(gains), 0
        for i in sorted(range(len(gains)), key=lambda i: -(gains[i][-1] if gains[i].size else 0.0)):
            if gains[i].size == 0:
                continue
            rate = tokens / seconds
            extra_draft = self.draft_seconds(drafting + 1) - self.draft_seconds(drafting)
            cost = extra_draft + per_token * np.arange(1, gains[i].size + 1)
            net = gains[i] - rate * cost  # tokens gained beyond what the same seconds give now
            d = int(np.argmax(net))
            if net[d] > 0:
                limits[i], drafting = d + 1, drafting + 1
                tokens += float(gains[i][d])
                seconds += float(cost[d])
        return limits

    def _chances(self, submitted: np.ndarray, accepted: np.ndarray, prior: np.ndarray) -> np.ndarray:
        """``P(drafts 1..j accepted)`` per row (one per row of the ``submitted`` and ``accepted``
        counts, j = 1..their width): each request's own counts with ``prior`` (the pooled
        chances) weighing as ``PRIOR_CYCLES`` cycles."""
        chances = np.minimum.accumulate((accepted + PRIOR_CYCLES * prior) / (submitted + PRIOR_CYCLES), axis=1)
        known = np.count_nonzero(submitted, axis=1)  # positions each request verified (widths are prefixes)
        rows = np.flatnonzero((known > 0) & (known < chances.shape[1]))
        if rows.size:  # deeper ones: a row's last measured per-position rate goes on
            k, some = known[rows], chances[rows]
            last = some[np.arange(rows.size), k - 1]
            before = np.where(k > 1, some[np.arange(rows.size), np.maximum(k - 2, 0)], 1.0)
            ratio = np.where(before > 0, last / np.where(before > 0, before, 1.0), 0.0)
            steps = np.arange(chances.shape[1]) - k[:, None] + 1
            deeper = last[:, None] * ratio[:, None] ** np.maximum(steps, 0)
            chances[rows] = np.where(steps > 0, np.maximum(some, deeper), some)
        return chances

    def _prior(self, room: int, live: Sequence[GenerationStats] = (), counts: tuple | None = None) -> np.ndarray:
        """The chances pooled over finished requests and the ``live`` ones (or their ``counts``:
        :func:`_counts`), halving per position where nothing is known yet."""
        live_sub, live_acc = counts if counts is not None else _counts(live, room)
        sub = _padded(self._submitted, room) + live_sub.sum(axis=0)
        acc = _padded(self._accepted, room) + live_acc.sum(axis=0)
        return np.where(sub > 0, acc / np.maximum(sub, 1), 0.5 ** np.arange(1, room + 1))


def _may_be_last(left: Sequence[int], stats: Sequence[GenerationStats], chances: np.ndarray) -> tuple:
    """Which rows may end last, and by how many cycles each one's end is uncertain: ``n`` tokens
    left at its pace so far ``m`` take ``n / m`` cycles, give or take ``sqrt(n v / M^3)`` for the
    variance ``v`` and mean ``M`` of what a cycle drafting its room now would give (``chances``: a
    row with nothing to draft, as prompt lookup without a copy, or whose drafts are never
    accepted, surely gives one). A row is in if within one standard deviation of the most."""
    paces = np.array([max(s.mean_acceptance_length, 1.0) for s in stats])
    mean = chances.sum(axis=1)
    variance = chances @ (2 * np.arange(1, chances.shape[1] + 1) - 1) - mean ** 2
    cycles, spread = np.asarray(left) / paces, np.sqrt(np.asarray(left) * np.maximum(variance, 0.0) / (1 + mean) ** 3)
    last = int(np.argmax(cycles))
    return cycles + np.sqrt(spread ** 2 + spread[last] ** 2) >= cycles[last] - 1e-9, spread


def _verified(stats: GenerationStats) -> int:
    return stats.submitted_per_position[0] if stats.submitted_per_position else 0


def _counts(stats: Sequence[GenerationStats], n: int) -> tuple[np.ndarray, np.ndarray]:
    """Each request's submitted and accepted drafts per position, the first ``n``, as two
    ``rows x n`` arrays."""
    submitted, accepted = np.zeros((len(stats), n)), np.zeros((len(stats), n))
    for i, s in enumerate(stats):
        k = min(n, len(s.submitted_per_position))
        submitted[i, :k], accepted[i, :k] = s.submitted_per_position[:k], s.accepted_per_position[:k]
    return submitted, accepted


def _padded(values, n: int) -> np.ndarray:
    """The first ``n`` of ``values`` (a sequence of numbers), zeros after its end."""
    out = np.zeros(n)
    kept = min(n, len(values))
    out[:kept] = values[:kept]
    return out
