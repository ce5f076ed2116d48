"""Prometheus metrics of one app, and its ``GET /metrics`` route.

:class:`ServerMetrics` is an :class:`~kvexport.serving.engine.EngineListener`: the engine
thread tells it each request's time to first token, the time between tokens and each
finish; the engine's own gauges and counters (:meth:`Engine.stats
<kvexport.serving.engine.Engine.stats>`) are read when scraped. ``/metrics`` shows counts
and latencies, no request text, so it stays open when an API key guards the rest.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvexport.serving.engine import Engine

_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

router = APIRouter()


class ServerMetrics:
    """Prometheus metrics of one app: the engine's gauges and counters, TTFT and inter-token histograms.

    It is an :class:`~kvexport.serving.engine.EngineListener` of the engine it serves.
    """

    def __init__(self, engine: Engine, model: str) -> None:
        self.registry = CollectorRegistry()
        self.engine = engine
        self.model = model
        self.ttft = Histogram(
            "kvexport_time_to_first_token_seconds", "Time from a request's arrival to its first token.",
            ["model"], buckets=_BUCKETS, registry=self.registry,
        )
        self.itl = Histogram(
            "kvexport_inter_token_latency_seconds", "Time between two tokens of one request.",
            ["model"], buckets=_BUCKETS, registry=self.registry,
        )
        self.requests = Counter(
            "kvexport_requests", "Requests ended, by finish reason.", ["model", "finish_reason"], registry=self.registry
        )
        self.registry.register(self)  # collect(): the engine's own numbers, read when scraped

    def on_first_token(self, seconds: float) -> None:
        """A request's time to first token."""
        self.ttft.labels(self.model).observe(seconds)

    def on_token(self, seconds: float) -> None:
        """The time between two tokens of one request."""
        self.itl.labels(self.model).observe(seconds)

    def on_finish(self, reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        """A request ended."""
        self.requests.labels(self.model, reason).inc()

    def collect(self) -> Any:
        """The engine's gauges and token counters, as they are now."""
        stats = self.engine.stats()
        for name, help_text, value in (
            ("kvexport_requests_running", "Requests generating (prompt done).", stats.running),
            ("kvexport_requests_waiting", "Requests waiting for a slot.", stats.waiting),
            ("kvexport_requests_prefilling", "Requests whose prompt is being prefilled.", stats.prefilling),
            ("kvexport_slots_in_use", "Cache slots held by requests.", stats.slots_in_use),
            ("kvexport_slots_pinned", "Cache slots kept for registered prefixes.", stats.pinned),
            ("kvexport_slots", "Cache slots.", stats.slots),
            ("kvexport_kv_blocks_used", "Blocks of the paged cache held by slots (cached prefixes too; 0 over slots).", stats.kv_blocks_used),
            ("kvexport_kv_blocks_free", "Blocks of the paged cache no slot holds (0 over slots).", stats.kv_blocks - stats.kv_blocks_used),
        ):
            gauge = GaugeMetricFamily(name, help_text, labels=["model"])
            gauge.add_metric([self.model], value)
            yield gauge
        for name, help_text, value in (
            ("kvexport_prompt_tokens", "Prompt tokens prefilled.", stats.prompt_tokens),
            ("kvexport_prefix_cache_hits", "Requests that reused a cached prompt prefix.", stats.prefix_hits),
            ("kvexport_prefix_cache_tokens", "Prompt tokens reused from the prefix cache, not prefilled.", stats.cached_tokens),
            ("kvexport_generation_tokens", "Tokens generated.", stats.generated_tokens),
            ("kvexport_decode_steps", "Batched decode calls.", stats.steps),
            ("kvexport_mixed_steps", "Decode steps run in one call with a prompt chunk (--mixed-step).", stats.mixed_steps),
            ("kvexport_batched_prompts", "Prompts whose first piece ran in one call with other prompts'.", stats.batched_prompts),
            ("kvexport_batched_pieces", "Later prompt pieces (after a past) that ran in one call with other prompts'.", stats.batched_pieces),
            ("kvexport_spec_draft_tokens", "Speculative tokens proposed by the drafter.", stats.drafted_tokens),
            ("kvexport_spec_accepted_tokens", "Speculative tokens the model kept.", stats.accepted_tokens),
            ("kvexport_preemptions", "Requests whose cache blocks were given up for others' (recomputed later).", stats.preemptions),
        ):
            counter = CounterMetricFamily(name, help_text, labels=["model"])
            counter.add_metric([self.model], value)
            yield counter


@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    """The app's metrics in Prometheus' text format."""
    metrics: ServerMetrics = request.app.state.metrics
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
