"""Prometheus metrics of one gateway server, in a registry of its own (not the global one,
so several servers in one process, as in tests, do not collide)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["GatewayMetrics", "LOOP_LAG_INTERVAL_S"]

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
# One 20 ms audio frame late is already audible, so the fine buckets sit below that.
_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LOOP_LAG_INTERVAL_S = 0.1
# Audio a client has left to play when the next piece arrives; 0 when it ran dry (the
# stall counters say for how long). The fine buckets sit around the admission floor
# (0.5 s) and a client's jitter buffer (~0.2 s).
_RUNWAY_BUCKETS = (0.0, 0.1, 0.2, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0)

CountSource = Callable[[], Mapping[str, int]]


class _Counts:
    """One labelled family whose values are read from `source` at each scrape, so they
    are never stale: a gauge of engine requests per stage, a counter of prepared
    responses per outcome."""

    def __init__(
        self,
        name: str,
        documentation: str,
        label: str,
        source: CountSource,
        family: type[GaugeMetricFamily] | type[CounterMetricFamily],
    ) -> None:
        self._name, self._documentation, self._label = name, documentation, label
        self._source, self._family = source, family

    def describe(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield self._family(self._name, self._documentation, labels=[self._label])

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        family = self._family(self._name, self._documentation, labels=[self._label])
        for value, count in sorted(self._source().items()):
            family.add_metric([value], count)
        yield family


class _Caches:
    """The engine's caches: bytes and entries per cache, read at each scrape."""

    def __init__(self, source: Callable[[], Mapping[str, tuple[int | None, int]]]) -> None:
        self._source = source

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield from self._families()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield from self._families(self._source())

    @staticmethod
    def _families(
        caches: Mapping[str, tuple[int | None, int]] | None = None,
    ) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        size = GaugeMetricFamily(
            "duplex_gateway_engine_cache_bytes",
            "Bytes each engine cache holds (docs/deploy.md, Memory)",
            labels=["cache"],
        )
        entries = GaugeMetricFamily(
            "duplex_gateway_engine_cache_entries",
            "Entries each engine cache holds (sessions' cached prompts, live requests, "
            "listeners); absent for a cache that cannot count them",
            labels=["cache"],
        )
        for name, (count, nbytes) in sorted((caches or {}).items()):
            size.add_metric([name], nbytes)
            if count is not None:
                entries.add_metric([name], count)
        return size, entries


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.sessions = Gauge("duplex_gateway_open_sessions", "Open realtime sessions", registry=r)
        self.sessions_total = Counter(
            "duplex_gateway_sessions", "Realtime sessions opened", registry=r
        )
        self.idle_closed = Counter(
            "duplex_gateway_idle_sessions_closed",
            "Idle sessions closed to make room for a new connection (idle_session_s)",
            registry=r,
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

        # A histogram rather than the latest sample: a stall between two scrapes still
        # counts, and histogram_quantile() aggregates it across gateways.
        self.loop_lag = Histogram(
            "duplex_gateway_event_loop_lag_seconds",
            f"How late the event loop ran a timer due every {LOOP_LAG_INTERVAL_S:g} s; "
            "every session's audio waits that long",
            buckets=_LAG_BUCKETS,
            registry=r,
        )

        self.playback_runway = Histogram(
            "duplex_gateway_playback_runway_seconds",
            "Audio a speaking response's client still had to play (audio sent minus the "
            "wall time since the first delta) when the next piece of audio went out; 0: "
            "it had run dry (a stall)",
            buckets=_RUNWAY_BUCKETS,
            registry=r,
        )
        self.playback_stalls = Counter(
            "duplex_gateway_playback_stalls",
            "Times a speaking response's client ran out of audio before the next piece",
            registry=r,
        )
        self.playback_stalled_seconds = Counter(
            "duplex_gateway_playback_stalled_seconds",
            "Silence clients heard in the middle of responses, waiting for audio",
            registry=r,
        )
        self.admissions = Counter(
            "duplex_gateway_admissions_total",
            "Spoken responses by admission outcome: started at once, queued, refused "
            "(queue full) or expired (waited capacity.max_wait_s)",
            ["outcome"],
            registry=r,
        )

    def watch_capacity(
        self,
        speaking: Callable[[], int],
        queued: Callable[[], int],
        saturated: Callable[[], bool],
    ) -> None:
        """Export admission's state as gauges read at each scrape."""
        r = self.registry
        Gauge(
            "duplex_gateway_speaking_responses", "Spoken responses running", registry=r
        ).set_function(speaking)
        Gauge(
            "duplex_gateway_queued_responses", "Spoken responses waiting to start", registry=r
        ).set_function(queued)
        Gauge(
            "duplex_gateway_saturated",
            "1 while new spoken responses wait or are refused (docs/protocol.md, Capacity)",
            registry=r,
        ).set_function(lambda: float(saturated()))

    def watch_engine(self, pending: CountSource) -> None:
        """Export `pending()` (requests per stage) as a gauge read at each scrape."""
        self.registry.register(
            _Counts(
                "duplex_gateway_engine_pending_requests",
                "Engine requests accepted by a stage and not yet finished, per stage",
                "stage",
                pending,
                GaugeMetricFamily,
            )
        )

    def watch_prepared(self, counts: CountSource) -> None:
        """Export `counts()` (prepared responses by outcome) as a counter."""
        self.registry.register(
            _Counts(
                "duplex_gateway_prepared_responses",
                "Responses started during a pause in speech, by outcome: adopted (the "
                "pause became the end of the turn) or discarded (speech went on)",
                "outcome",
                counts,
                CounterMetricFamily,
            )
        )

    def watch_llm_tokens(self, counts: CountSource) -> None:
        """Export `counts()` (LLM tokens computed, by phase) as a counter: prefill tokens
        per second is the load a new session adds, the figure to scale instances on."""
        self.registry.register(
            _Counts(
                "duplex_gateway_llm_tokens",
                "Tokens the local LLM computed, by phase: prefill (prompt tokens, cached "
                "prefixes excluded) or decode (one per running sequence per step)",
                "phase",
                counts,
                CounterMetricFamily,
            )
        )

    def watch_engine_caches(
        self, caches: Callable[[], Mapping[str, tuple[int | None, int]]]
    ) -> None:
        """Export `caches()` ((entries, bytes) by cache name) as two gauges read at each
        scrape: what the engine keeps between requests, to check it against its budget."""
        self.registry.register(_Caches(caches))

    async def sample_loop_lag(self, interval: float = LOOP_LAG_INTERVAL_S) -> None:
        """Observe the running loop's lag every `interval` seconds until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + interval
            await asyncio.sleep(interval)
            # The loop may run a timer up to its clock resolution early.
            self.loop_lag.observe(max(0.0, loop.time() - due))

    def render(self) -> bytes:
        return generate_latest(self.registry)
