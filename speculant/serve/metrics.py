"""Prometheus metrics of one server, in a registry of its own (several apps may share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from speculant.core.metrics import GenerationStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def speculative_stats(stats: GenerationStats | None) -> dict:
    """The extra ``speculant`` field of a final response: what speculation did for this request."""
    if stats is None:
        return {}
    drafted = sum(stats.submitted_per_position)
    accepted = sum(stats.accepted_per_position)
    proposed_steps = stats.submitted_per_position[0] if stats.submitted_per_position else 0
    return {
        "mean_acceptance_length": round(stats.mean_acceptance_length, 4),
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "verify_steps": stats.verify_steps,
        "plain_steps": stats.verify_steps - proposed_steps,  # cycles that verified no proposal
        "lookup_steps": stats.lookup_steps,
        "ttft_s": round(stats.ttft_s, 6),
        "decode_tokens_per_s": round(stats.decode_tokens_per_s, 3),
        "stop_reason": stats.stop_reason,
    }


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("speculant_requests", "Requests by endpoint and outcome", ["endpoint", "status"],
                                registry=r)
        self.queue_depth = Gauge("speculant_queue_depth", "Requests waiting for the engine", registry=r)
        self.prompt_tokens = Counter("speculant_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generated_tokens = Counter("speculant_generated_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("speculant_time_to_first_token_seconds",
                              "Time to first token from the request's arrival (queue wait included)",
                              registry=r, buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.decode_rate = Histogram("speculant_decode_tokens_per_second", "Decode tokens/s per request", registry=r,
                                     buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000))
        self.acceptance = Histogram("speculant_acceptance_length", "Tokens emitted per verify step", registry=r,
                                    buckets=tuple(range(1, 17)))
        self.drafted = Counter("speculant_drafted_tokens", "Proposed tokens verified by the target", registry=r)
        self.accepted = Counter("speculant_accepted_tokens", "Proposed tokens the target accepted", registry=r)
        self.plain_steps = Counter("speculant_plain_steps", "Verify steps with no proposal (plain decoding)",
                                   registry=r)
        self.prefix_hits = Counter("speculant_prefix_cache_hits", "Requests resumed from the prefix cache", registry=r)
        self.cached_tokens = Counter("speculant_prefix_cache_cached_tokens",
                                     "Prompt tokens restored from the prefix cache instead of prefilled", registry=r)
        self.prefix_bytes = Gauge("speculant_prefix_cache_bytes", "Bytes the prefix cache holds", registry=r)
        self.batch_size = Gauge("speculant_batch_size", "Requests in the scheduler (verified together)", registry=r)
        self.batch_size_max = Gauge("speculant_batch_size_max", "Most requests in the scheduler at once so far",
                                    registry=r)
        self.batched_cycles = Counter("speculant_batched_cycles",
                                      "Cycles that verified requests in one batched forward", registry=r)
        self.request_acceptance = Histogram("speculant_request_acceptance_length",
                                            "Each request's mean tokens emitted per verify step", registry=r,
                                            buckets=(1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 8, 10, 12, 16))
        self._cycles_seen = self._max_live = 0
        self.plain_fallbacks = Counter("speculant_plain_fallback_requests",
                                       "Requests of a speculative engine that verified no proposal at all", registry=r)

    def record(self, stats: GenerationStats | None, speculative: bool) -> None:
        if stats is None:
            return
        extra = speculative_stats(stats)
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generated_tokens.inc(stats.new_tokens)
        self.prefix_hits.inc(int(stats.cached_tokens > 0))
        self.cached_tokens.inc(stats.cached_tokens)
        self.prefix_bytes.set(stats.prefix_cache_bytes)
        if stats.new_tokens:
            self.ttft.observe(stats.ttft_s)
        if stats.new_tokens > 1:
            self.decode_rate.observe(stats.decode_tokens_per_s)
        if stats.verify_steps:
            self.request_acceptance.observe(stats.mean_acceptance_length)
        for length in stats.acceptance_lengths:
            self.acceptance.observe(length)
        self.drafted.inc(extra["drafted_tokens"])
        self.accepted.inc(extra["accepted_tokens"])
        self.plain_steps.inc(extra["plain_steps"])
        if speculative and stats.verify_steps and not extra["drafted_tokens"]:
            self.plain_fallbacks.inc()

    def cycle(self, live: int, batched_cycles: int) -> None:
        """The scheduler's state after a chunk (engine thread): its requests, its batched cycles so far."""
        self.batch_size.set(live)
        if live > self._max_live:
            self._max_live = live
            self.batch_size_max.set(live)
        if batched_cycles > self._cycles_seen:
            self.batched_cycles.inc(batched_cycles - self._cycles_seen)
            self._cycles_seen = batched_cycles

    def render(self) -> bytes:
        return generate_latest(self.registry)
