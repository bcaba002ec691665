"""The server's Prometheus metrics (one registry per server, so several servers in one process stay apart).

Requests by outcome (``ok``, ``error``, ``cancelled``, ``bad_request``, ``rejected``), queue length and active
rows (sampled from the scheduler when scraped), block calls and the rows they decoded (their ratio: how full
the running batch ran), completion tokens, forwards, tokens per forward (non-EOS
tokens / forwards, as ``bench.run`` counts TPF), and histograms of the time to the first finished block and
of request latency (submission to the last block).
"""
from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: Histogram buckets (seconds): from a block on a fast accelerator to a long queue.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    """The metrics of one server; :meth:`record` is the scheduler's ``metrics`` callback (thread-safe)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("polestar_requests", "Requests by outcome", ["outcome"], registry=r)
        self.queue = Gauge("polestar_queue_length", "Requests waiting for a row", registry=r)
        self.active = Gauge("polestar_active_rows", "Rows decoding", registry=r)
        self.tokens = Counter("polestar_completion_tokens", "Completion tokens returned", registry=r)
        self.non_eos = Counter("polestar_non_eos_tokens", "Generated non-EOS tokens (TPF's numerator)", registry=r)
        self.forwards = Counter("polestar_forwards", "Forwards (NFE) of the finished requests", registry=r)
        self.blocks = Counter("polestar_block_calls", "Block calls of the running batch", registry=r)
        self.row_blocks = Counter("polestar_row_blocks", "Rows decoded, summed over the block calls (their mean "
                                  "over polestar_block_calls_total: the batch's occupancy)", registry=r)
        self.tpf = Gauge("polestar_tokens_per_forward", "Non-EOS tokens / forwards since start", registry=r)
        self.first_block = Histogram("polestar_time_to_first_block_seconds", "Submission to the first finished "
                                     "block", buckets=BUCKETS, registry=r)
        self.latency = Histogram("polestar_request_latency_seconds", "Submission to the response",
                                 buckets=BUCKETS, registry=r)
        self._tok = self._fwd = 0

    def record(self, name: str, value: Any) -> None:
        if name == "outcome":
            self.requests.labels(outcome=str(value)).inc()
        elif name == "queue":
            self.queue.set(value)
        elif name == "active":
            self.active.set(value)
        elif name == "tokens":
            self.tokens.inc(value)
        elif name == "non_eos":
            self._tok += value
            self.non_eos.inc(value)
        elif name == "forwards":
            self._fwd += max(0, int(value))
            self.forwards.inc(max(0, int(value)))
        elif name == "block":
            self.blocks.inc()
            self.row_blocks.inc(value)
        elif name == "first_block":
            self.first_block.observe(value)
        elif name == "latency":
            self.latency.observe(value)
        if name in ("non_eos", "forwards") and self._fwd:
            self.tpf.set(self._tok / self._fwd)

    def render(self, scheduler=None) -> bytes:
        if scheduler is not None:
            self.queue.set(scheduler.queue_length)
            self.active.set(scheduler.active_rows)
        return generate_latest(self.registry)
