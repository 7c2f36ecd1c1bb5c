"""Moved to :mod:`speculant.core.sampling` (drafters sample drafts with the same math)."""

from speculant.core.sampling import inverse_cdf, sample_token, target_probs, tempered_logits  # noqa: F401
