"""Prometheus metrics of one gateway server, in a registry of its own (not the global one,
so several servers in one process, as in tests, do not collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["GatewayMetrics"]

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.sessions = Gauge("duplex_gateway_open_sessions", "Open realtime sessions", registry=r)
        self.sessions_total = Counter(
            "duplex_gateway_sessions", "Realtime sessions opened", registry=r
        )
        self.rejected = Counter(
            "duplex_gateway_rejected_connections_total",
            "Connections refused at the handshake",
            ["reason"],
            registry=r,
        )
        self.turns = Counter(
            "duplex_gateway_responses_total", "Responses finished", ["status"], registry=r
        )
        self.barge_ins = Counter(
            "duplex_gateway_barge_ins_total", "Responses cancelled by detected speech", registry=r
        )
        self.errors = Counter(
            "duplex_gateway_errors_total", "Error events sent to clients", ["code"], registry=r
        )
        self.events_sent = Counter(
            "duplex_gateway_events_sent_total", "Server events sent", registry=r
        )
        self.send_overflows = Counter(
            "duplex_gateway_send_queue_overflows_total",
            "Sessions closed because the client stopped reading",
            registry=r,
        )
        self.first_audio = Histogram(
            "duplex_gateway_first_audio_seconds",
            "From speech_stopped to the first output audio delta",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.first_text = Histogram(
            "duplex_gateway_first_output_seconds",
            "From response.created to the first output delta (text or audio)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
