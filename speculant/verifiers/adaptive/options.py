"""``verifier.options`` of the ``adaptive`` verifier, validated by pydantic (``options_model``)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from speculant.core.schema import CONTEXT_MAX, COUNT_MAX, UserModel

COST_MAX = 1e9  # cost_table / draft_cost: any unit, so only their ratios matter; this keeps the sums finite
WIDTHS_MAX = 256  # cost_table entries: one per verify width


class AdaptiveOptions(UserModel):
    """``verifier.options`` of the ``adaptive`` verifier."""

    max_context: int | None = Field(None, ge=1, le=CONTEXT_MAX, description="from this context length on, decode plainly (per request)")
    hysteresis: float = Field(0.05, ge=0.0, lt=1.0, description="fall back only when plain is this much faster")
    acceptance_decay: float = Field(0.95, gt=0.0, lt=1.0, description="per-cycle forgetting of acceptance counts")
    prior_acceptance: float = Field(0.5, gt=0.0, lt=1.0, description="acceptance rate a drafted position is assumed to have before any evidence")
    prior_weight: float = Field(1.0, gt=0.0, le=1e6, description="how many cycles of evidence the prior counts as")
    use_confidence: bool = Field(True, description="let argmax drafts' own confidences shape this cycle's width (sampled drafts never do)")
    probe_budget: float = Field(0.05, gt=0.0, le=1.0, description="share of plain-decoding time re-probes may cost")
    probe_interval: int = Field(8, ge=1, le=COUNT_MAX, description="fewest plain cycles between re-probes")
    max_probe_interval: int = Field(512, ge=1, le=COUNT_MAX, description="most plain cycles between re-probes")
    probe_cycles: int = Field(2, ge=1, le=64, description="narrow probe cycles before a probe counts as failed")
    probe_each_request: bool = Field(True, description="probe at the start of every request while in fallback")
    request_probe_delay: int = Field(7, ge=1, le=COUNT_MAX, description="cycles into a request before its first probe (its first tokens are atypical)")
    request_probes: int = Field(2, ge=1, le=1000, description="single-draft probes a request makes, probe_interval apart, before the global back-off applies")
    request_probe_gap: int = Field(1, ge=1, le=COUNT_MAX, description="while request-start probes fail, at most this many requests between them")
    refresh_interval: int = Field(64, ge=1, le=COUNT_MAX, description="speculative cycles between plain-step re-measurements")
    probe_on_repeat: bool = Field(True, description="probe soon when the output starts repeating itself (failed hints back off per request)")
    request_carryover: float = Field(0.5, ge=0.0, le=1.0, description="share of acceptance evidence a new request keeps")
    warmup: bool = Field(True, description="start with full-width and plain cycles to measure both costs (skipped with cost_table)")
    explore_every: int = Field(16, ge=0, le=COUNT_MAX, description="every n-th speculative cycle decides on optimistic costs (0 = never)")
    cost_alpha: float = Field(0.1, gt=0.0, le=1.0, description="weight of a new timing sample")
    cost_table: list[float] | None = Field(None, min_length=1, max_length=WIDTHS_MAX, description="fixed target cost per width 1, 2, ... (any unit; each > 0, at most 1e9)")
    draft_cost: float | None = Field(None, ge=0.0, le=COST_MAX, description="fixed draft cost, same unit as cost_table")

    tree: Literal["auto", "off"] = Field("off", description="auto: with a drafter that gives per-position "
                                         "distributions (DFlash, DFlash2) and a target that takes trees, each speculative cycle "
                                         "verifies the chain or a tree of one of tree_budgets nodes, whichever has emitted the "
                                         "most tokens per second (each measured first); off (default: on a CPU trees gained nothing beyond the noise, docs/tree-verification.md): chains only")
    tree_budgets: list[Annotated[int, Field(ge=1, le=1024)]] = Field(
        [4, 8, 32], min_length=1, max_length=8, description="the tree sizes (drafted nodes, B) tree = auto measures and chooses from")
    tree_width: int = Field(8, ge=1, le=64, description="most candidates per tree depth (K)")
    tree_explore_every: int = Field(32, ge=2, le=COUNT_MAX, description="with tree = auto, every n-th eligible cycle "
                                    "runs an arm (chain or tree size) measured slower, so its cost stays known")

    @model_validator(mode="after")
    def _consistent(self) -> "AdaptiveOptions":
        if self.max_probe_interval < self.probe_interval:
            raise ValueError("max_probe_interval must be at least probe_interval")
        if self.cost_table is not None and any(not 0 < c <= COST_MAX for c in self.cost_table):
            raise ValueError(f"cost_table entries must be positive and at most {COST_MAX:g}")
        if self.draft_cost is not None and self.cost_table is None:
            raise ValueError("draft_cost needs cost_table (both are in the table's unit)")
        return self
