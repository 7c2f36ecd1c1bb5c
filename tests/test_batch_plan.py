"""The batch plan (core/batch_plan.py): each batched row's drafts from its own acceptance and the
batched forward's measured cost. Fed synthetic cycles of a known cost line, it must recover the
line, keep rows plain where the forward is compute-bound (what each extra token costs is what it
gives), draft where a fixed cost dominates (a GPU's memory-bound forward), and draft only for rows
whose drafts are accepted."""

from __future__ import annotations

import pytest

from speculant.core.batch_plan import (EVIDENCE, EXPLORE_EVERY, EXPLORE_SHARE, EXPLORE_TOKENS, OWN_CYCLES, THIN_EVERY,
                                      WARM_UP, BatchPlan)
from speculant.core.metrics import GenerationStats

ROOM = 7


def history(accepted_per_cycle: int, cycles: int = 20, width: int = ROOM) -> GenerationStats:
    """A request whose drafts were accepted ``accepted_per_cycle`` deep every cycle."""
    stats = GenerationStats()
    for _ in range(cycles):
        stats.record_cycle(width, accepted_per_cycle, accepted_per_cycle + 1)
    return stats


def measured(fixed: float, per_token: float, draft: float, rows: int = 4) -> BatchPlan:
    plan = BatchPlan()
    for tokens in (rows, rows * 8, rows * 3, rows * 5, rows, rows * 8):
        drafting = 1 if tokens == rows * 3 else rows if tokens > rows else 0  # each row's draft its own forward
        plan.observe(rows, tokens, fixed + per_token * tokens + draft * drafting, drafting, draft * drafting)
    plan.cycles = WARM_UP + 1  # past the warm-up, not at an exploring cycle
    return plan


def test_the_cost_line_is_recovered():
    plan = measured(fixed=0.020, per_token=0.0005, draft=0.001)
    fixed, per_token = plan.cost(4)
    assert fixed == pytest.approx(0.020, rel=1e-6) and per_token == pytest.approx(0.0005, rel=1e-6)
    assert plan.draft_seconds(4) == pytest.approx(0.004)


def test_a_compute_bound_forward_keeps_every_row_plain():
    plan = measured(fixed=0.0, per_token=0.001, draft=0.0005)
    assert plan.limits([ROOM] * 4, [history(ROOM)] * 4) == [0, 0, 0, 0]  # even drafts always accepted
    assert not plan.drafting_pays(3, ROOM, [history(ROOM)] * 3)
    assert plan.drafting_pays(3, ROOM)  # nothing measured yet of what drafts are accepted: it drafts


def test_thin_acceptance_is_explored_by_every_row_before_it_turns_drafting_off():
    """A request's first cycles accept least (the shipped pair: rejected at once, then whole
    blocks from its tenth cycle on), so two of them per request must not turn drafting off for
    good: until ``EVIDENCE`` drafted row-cycles are pooled, every ``THIN_EVERY`` cycles every row
    drafts (in the padded columns one row's widening pays for), and only then is it settled."""
    plan = measured(fixed=0.0, per_token=0.001, draft=0.0005)
    young = [history(0, cycles=2)] * 4  # 8 row-cycles, all rejected at once
    assert not plan.settled(young) and plan.drafting_pays(3, ROOM, young)
    explored = [plan.cycles for plan.cycles in range(WARM_UP, WARM_UP + 40) if any(plan.limits([ROOM] * 4, young))]
    assert explored == list(range(THIN_EVERY, WARM_UP + 40, THIN_EVERY))
    plan.cycles = plan._explored_at + THIN_EVERY
    assert plan.limits([ROOM] * 4, young) == [min(ROOM, EXPLORE_TOKENS // 4)] * 4  # every row, as wide as the one's widening
    settled = [history(0, cycles=EVIDENCE // 4)] * 4
    assert plan.settled(settled) and not plan.drafting_pays(3, ROOM, settled)
    plan.cycles = plan._explored_at + THIN_EVERY
    assert plan.limits([ROOM] * 4, settled) == [0] * 4  # the next exploration waits for EXPLORE_EVERY


def test_a_fixed_cost_forward_drafts_for_rows_whose_drafts_are_accepted():
    plan = measured(fixed=0.030, per_token=0.0001, draft=0.005)
    limits = plan.limits([ROOM] * 4, [history(ROOM), history(0), history(3), history(ROOM)])
    assert limits[0] == ROOM and limits[3] == ROOM
    assert limits[1] == 0  # never accepted: a plain step
    assert 0 < limits[2] <= ROOM
    assert plan.planned_plain == 1


def test_pooled_acceptance_decides_for_a_request_joining():
    plan = measured(fixed=0.030, per_token=0.0001, draft=0.005)
    plan.pool(history(0, cycles=200))  # every request so far was rejected at once
    assert not plan.drafting_pays(3, ROOM)
    plan.pool(history(ROOM, cycles=2000))
    assert plan.drafting_pays(3, ROOM)


def test_warm_up_exploration_and_a_new_requests_first_cycles():
    plan = BatchPlan()
    seen = [plan.limits([ROOM] * 2, [history(0)] * 2) for plan.cycles in range(WARM_UP)]
    assert [ROOM, ROOM] in seen and [0, 0] in seen  # full and plain in turn: two points of the line
    plan = measured(fixed=0.0, per_token=0.001, draft=0.0005, rows=3)
    plan.cycles = EXPLORE_EVERY
    assert sorted(plan.limits([ROOM] * 3, [history(ROOM)] * 3)) == [0, 0, ROOM]  # one row explores
    plan.cycles = EXPLORE_EVERY + 1
    new = history(0, cycles=OWN_CYCLES - 1)
    # padded: a young request drafts in full only inside a block the plan widened anyway, since
    # widening it would widen every row's
    assert plan.limits([ROOM, ROOM], [history(ROOM), new]) == [0, 0]
    plan.padded = False  # flattened: its drafts cost only its own tokens
    assert plan.limits([ROOM, ROOM], [history(ROOM), new]) == [0, ROOM]
    wide = measured(fixed=0.030, per_token=0.0001, draft=0.005)
    assert wide.limits([ROOM, ROOM], [history(ROOM), new]) == [ROOM, ROOM]


def test_a_padded_block_lets_every_row_draft_as_wide_as_the_widest():
    """Padded to the widest row, a block costs rows x widest whoever drafts: once one row's drafts
    pay for the widening, the others draft that wide for their draft time alone; a ragged
    (flattened) batch charges each row its own tokens instead."""
    plan = measured(fixed=0.010, per_token=0.0001, draft=0.0001)
    stats = [history(ROOM), history(1), history(1), history(1)]
    padded = plan.limits([ROOM] * 4, stats)
    assert padded == [ROOM] * 4
    plan.padded = False
    ragged = plan.limits([ROOM] * 4, stats)
    assert ragged[0] == ROOM and max(ragged[1:]) < ROOM


def test_a_forward_cheaper_per_token_when_wider_is_read_as_measured():
    """Seconds grow like tokens ** 0.6 (wide products run faster per token): the plan reads the
    measured points, and rows whose drafts were accepted as deep as they went draft in full."""
    plan = BatchPlan()
    for tokens in (16, 64, 256, 16, 64, 256):
        plan.observe(16, tokens, 0.002 * tokens ** 0.6)
    plan.cycles = WARM_UP + 1
    assert plan.seconds(16, 256) == pytest.approx(0.002 * 256 ** 0.6)
    assert plan.seconds(16, 128) < 0.002 * 128 ** 0.6 * 1.2
    narrow = [history(3, width=3)] * 16  # always accepted, never tried deeper than 3
    assert plan.limits([15] * 16, narrow) == [15] * 16


def test_switched_off_it_leaves_every_row_its_width():
    plan = measured(fixed=0.0, per_token=0.001, draft=0.0005)
    plan.enabled = False
    assert plan.limits([ROOM, 3], [history(0)] * 2) == [ROOM, 3]
    assert plan.drafting_pays(15, ROOM)


def test_one_draft_call_for_every_row_is_charged_once():
    """A drafter that drafts every row in one forward costs about the same for 1 row or 4: the
    plan reads the call's measured seconds by rows drafted, so all four rows draft where one
    call pays for them, which 4 x one row's draft time would not."""
    plan = BatchPlan()
    for tokens, drafting in ((4, 0), (32, 4), (12, 1), (32, 4), (4, 0), (20, 4)):
        plan.observe(4, tokens, 0.010 + 0.0001 * tokens + 0.012 * bool(drafting), drafting, 0.012 * bool(drafting))
    plan.cycles = WARM_UP + 1
    assert plan.draft_seconds(4) == pytest.approx(0.012) and plan.draft_seconds(2) == pytest.approx(0.012)
    stats = [history(2)] * 4  # 3 tokens a cycle each for 2 drafts
    assert plan.limits([ROOM] * 4, stats) == [2] * 4  # as deep as they are accepted
    per_row = BatchPlan()  # the same forward, each row's draft a forward of its own
    for tokens, drafting in ((4, 0), (32, 4), (12, 1), (32, 4), (4, 0), (20, 4)):
        per_row.observe(4, tokens, 0.010 + 0.0001 * tokens + 0.012 * drafting, drafting, 0.012 * drafting)
    per_row.cycles = WARM_UP + 1
    assert per_row.limits([ROOM] * 4, stats) == [0] * 4


def test_the_live_requests_acceptance_is_the_prior_of_each_other():
    """Requests only two cycles old, whose drafts were all accepted: pooled with each other (live,
    nothing finished yet) they draft; read against the halving prior alone they would not."""
    plan = measured(fixed=0.002, per_token=0.001, draft=0.00025)
    young = [history(ROOM, cycles=OWN_CYCLES)] * 4
    assert plan.limits([ROOM] * 4, young) == [ROOM] * 4


def test_explorations_thin_out_while_every_row_stays_plain():
    """A compute-bound forward keeps every row plain; each exploration widens every row's padded
    block for one row, so they come at 64, 128, 256 ... cycles apart, back to 64 once a row drafts."""
    plan = measured(fixed=0.0, per_token=0.001, draft=0.0005)
    explored = []
    for plan.cycles in range(EXPLORE_EVERY, EXPLORE_EVERY + 1000):
        if any(plan.limits([ROOM] * 3, [history(ROOM)] * 3)):
            explored.append(plan.cycles)
    assert explored == [64, 128, 256, 512, 1024]
    cheap = measured(fixed=0.030, per_token=0.0001, draft=0.005)
    cheap.explore_every, cheap._explore_at, cheap.cycles = 512, 600, 599
    assert any(cheap.limits([ROOM] * 2, [history(ROOM)] * 2))  # the plan drafts
    cheap.cycles = 600
    cheap.limits([ROOM] * 2, [history(ROOM)] * 2)
    assert cheap.explore_every == EXPLORE_EVERY


def test_measured_points_close_together_are_not_extrapolated_flat():
    """Cycles of 15 and 16 rows of one token each cost about the same: the line between them is
    flat, yet 16 rows of 8 tokens cost 4x as much (SmolLM2 on a CPU). Past a narrow range the plan
    prices tokens in proportion, and so keeps rows plain until a wide cycle is measured."""
    plan = BatchPlan()
    for _ in range(8):
        plan.observe(15, 15, 0.147)
        plan.observe(16, 16, 0.142)
    plan.cycles = WARM_UP + 1
    assert plan.seconds(16, 128) == pytest.approx(0.142 * 8)  # 16 rows' own point, in proportion
    assert plan.limits([ROOM] * 16, [history(ROOM)] * 16) == [0] * 16
    plan.observe(16, 128, 0.6)  # a wide cycle measured: read as measured
    assert plan.seconds(16, 128) == pytest.approx(0.6)


def test_an_exploration_drafts_on_a_row_with_something_to_draft_and_widens_little():
    plan = measured(fixed=0.0, per_token=0.001, draft=0.0005)
    for plan.cycles in (EXPLORE_EVERY, 2 * EXPLORE_EVERY):
        assert plan.limits([0, 0, ROOM], [history(ROOM)] * 3) == [0, 0, ROOM]
    plan = measured(fixed=0.0, per_token=0.001, draft=0.0005, rows=32)
    plan.cycles = EXPLORE_EVERY  # 32 padded rows: one draft widens the block by 32 tokens
    assert sorted(plan.limits([ROOM] * 32, [history(ROOM)] * 32)) == [0] * 31 + [1]


def test_an_exploration_measures_a_wide_block_where_the_plan_knows_only_narrow_ones():
    """32 rows measured plain and one token wider only (what explorations at 32 rows widen) read a
    block of 8 in proportion (a CPU's wide forward costs less per token), so every row stays plain
    for good. Where 16 rows' wide cycles say width might pay, an exploration drafts every row's
    room once; measured cheap, rows then draft. Where they do not, explorations stay narrow."""
    def plan_after(sixteen_wide: float) -> BatchPlan:
        plan = BatchPlan()
        for _ in range(4):
            plan.observe(16, 16, 0.010)
            plan.observe(16, 16 * (ROOM + 1), sixteen_wide)
        for _ in range(16):
            plan.observe(32, 32, 0.020)
        plan.observe(32, 64, 0.040)
        plan.cycles = WARM_UP + 1
        return plan

    costly = plan_after(sixteen_wide=0.080)  # 16 rows of 8 cost 8 plain cycles: no hint that width pays
    costly.cycles = costly._explore_at
    assert sorted(costly.limits([ROOM] * 32, [history(ROOM)] * 32)) == [0] * 31 + [1]
    plan = plan_after(sixteen_wide=0.025)
    assert plan.limits([ROOM] * 32, [history(ROOM)] * 32) == [0] * 32
    plan.cycles = plan._explore_at
    assert plan.limits([ROOM] * 32, [history(ROOM)] * 32) == [ROOM] * 32
    plan.observe(32, 32 * (ROOM + 1), 0.060)
    assert plan._explore_at >= plan.cycles + int(2.0 / EXPLORE_SHARE)  # it cost 2 plain cycles more
    assert plan.limits([ROOM] * 32, [history(ROOM)] * 32) == [ROOM] * 32  # 8x the tokens for 3x the time


def test_a_costly_exploration_spaces_out_the_next_so_explorations_stay_a_small_share():
    plan = measured(fixed=0.0, per_token=0.001, draft=0.0)  # a plain cycle of 4 rows: 4 ms
    plan.cycles = EXPLORE_EVERY
    assert plan.limits([ROOM] * 4, [history(ROOM)] * 4) != [0] * 4  # an exploration
    plan.observe(4, 4 * 9, 0.012)  # it cost 2 plain cycles more
    assert plan.seconds(4, 4 * 9) == pytest.approx(0.032)  # the curve read after it has its point (never below 32 tokens')
    nearest = plan.cycles + int(2.0 / EXPLORE_SHARE)
    assert plan._explore_at >= nearest
    plan.cycles = nearest - 1
    assert plan.limits([ROOM] * 4, [history(0)] * 4) == [0] * 4  # not yet (and plain pays)
    plan.cycles = plan._explore_at
    assert plan.limits([ROOM] * 4, [history(0)] * 4) != [0] * 4  # now


def test_a_costly_exploration_spaces_out_the_explorations_of_thin_acceptance_too():
    """While the pooled acceptance is thin, explorations come every ``THIN_EVERY`` cycles, but not
    sooner than the last one's cost allows: on the default pair at 4 requests (prompt lookup, few
    drafted rows, so thin for a whole run) one 8-wide block every 8 cycles cost 2.5 plain cycles
    each, and the batch ran at 0.94x plain."""
    plan = measured(fixed=0.0, per_token=0.001, draft=0.0)
    young = [history(0, cycles=2)] * 4
    plan.cycles = THIN_EVERY
    assert any(plan.limits([ROOM] * 4, young))  # a thin exploration
    plan.observe(4, 4 * 9, 0.012)  # 2 plain cycles more
    nearest = plan.cycles + int(2.0 / EXPLORE_SHARE)
    plan.cycles = plan._explored_at + THIN_EVERY
    assert plan.limits([ROOM] * 4, young) == [0] * 4  # not yet
    plan.cycles = nearest
    assert any(plan.limits([ROOM] * 4, young))  # now


def test_a_row_count_is_priced_from_its_own_cycles_not_a_curve_of_others():
    """4-row cycles of 4 and 32 tokens, then 16-row plain cycles (16 tokens, dearer than the
    4-row wide ones: more rows' attention and bookkeeping): a curve over all of them reads flat
    past 16 tokens, pricing 16 rows of 8 like 16 of one. The 16 rows' own point is read in
    proportion until a wider 16-row cycle is measured."""
    plan = BatchPlan()
    for _ in range(8):
        plan.observe(4, 4, 0.004)
        plan.observe(4, 32, 0.008)
    for _ in range(4):
        plan.observe(16, 16, 0.012)
    plan.cycles = WARM_UP + 1
    assert plan.seconds(16, 128) == pytest.approx(0.012 * 8)
    assert plan.limits([ROOM] * 16, [history(ROOM)] * 16) == [0] * 16  # 8x the tokens for 8x the time: plain
    assert plan.seconds(4, 32) == pytest.approx(0.008)  # the 4 rows' own curve, as measured


def test_a_whole_batch_values_tokens_by_how_much_sooner_its_last_request_ends():
    """Given each row's tokens left (``generate_many``, none waiting), the batch ends with its last
    request: a row far ahead saves only its own row's seconds by ending sooner; the rows that may
    yet be last share the forward's fixed seconds, each by its own gains while which of them ends
    last is open, but once that is settled only as far as all of them accept (the default pair at
    4 requests: copies accepted on rows tied for last beside rows with none made the batch no
    shorter, 0.95x plain). The rate reading (every token worth the average) decides otherwise."""
    rows = [history(ROOM), history(0), history(0), history(0)]
    latency_bound = measured(fixed=0.030, per_token=0.0001, draft=0.005)
    assert latency_bound.limits([ROOM] * 4, rows)[0] == ROOM
    assert latency_bound.limits([ROOM] * 4, rows, left=[8, 64, 64, 64]) == [0] * 4  # done long before the rest
    assert latency_bound.limits([ROOM, 0, 0, 0], rows, left=[56, 8, 8, 8]) == [0] * 4  # the rest, nothing to draft, end it
    assert latency_bound.limits([ROOM] * 4, [history(ROOM)] * 4, left=[64] * 4) == [ROOM] * 4  # all accept
    varied = GenerationStats()  # whole blocks accepted every other cycle, none in between
    for cycle in range(20):
        varied.record_cycle(ROOM, ROOM * (cycle % 2), ROOM * (cycle % 2) + 1)
    balanced = measured(fixed=0.005, per_token=0.001, draft=0.0001)
    assert balanced.limits([ROOM] * 4, [varied] * 4) == [ROOM] * 4
    # far from the end any of them may end last: each one's own gains count, as in the rate reading
    assert balanced.limits([ROOM] * 4, [varied] * 4, left=[60] * 4) == [ROOM] * 4
    assert balanced.limits([2] * 4, [varied] * 4) == [2] * 4
    assert balanced.limits([2] * 4, [varied] * 4, left=[3] * 4) == [0] * 4  # at the end, only what all gain
    compute_bound = measured(fixed=0.004, per_token=0.001, draft=0.0001)
    assert compute_bound.limits([ROOM] * 4, rows) == [0] * 4
    assert compute_bound.limits([ROOM] * 4, rows, left=[64, 2, 2, 2])[0] > 0  # the last: its drafts shorten the batch
    assert compute_bound.limits([ROOM] * 4, rows, left=[64, 50, 50, 50]) == [0] * 4  # 8 cycles to the others' 50
