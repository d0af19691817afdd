"""Soak: hours of mixed traffic in minutes, and whether memory and latency come back.

    python bench/soak.py [--json] [--duration 600] [--voice-users 3] [--text-users 1]
                         [--idle 20] [--idle-every 30] [--config PROFILE.yaml]

The gateway runs as `duplex-gateway` through its CLI with the real models. The load,
for `--duration` seconds:
- voice users streaming 40 ms frames at a microphone's pace (espeak-ng questions, server
  VAD). Each turn is, by chance, answered in full, interrupted by a barge-in once its
  audio plays, or cut by an abrupt disconnect (the socket dropped without a close) in
  mid-answer, after which the user reconnects as a new session;
- text users asking by `conversation.item.create` + `response.create`, cancelling some
  answers after their first delta, and reconnecting every few turns;
- `--idle` connections opened every `--idle-every` seconds that send nothing, held for
  most of the period, then half closed and half dropped.

Around it, a lone voice user's 10-turn session runs before and after the load, on its own:
per turn, `speech_stopped` -> first audio delta, and the LLM prefill tokens the turn cost
(the `duplex_gateway_llm_tokens{phase="prefill"}` counter, read before and after), beside
its prompt and cached tokens from `response.done` usage.

Reported: stale deltas (output of a response after its `response.done`) and stuck turns
(no `response.done` within STUCK_S), both targets 0; gateway RSS at the warm baseline
(idle after the first lone session), when the last load client left, and IDLE_AFTER_S
later; its slope over the second half of the load; refused connections and spoken
responses refused for capacity (not stuck: their error and `response.done` came); the engine
cache gauges at the end. Timing figures depend on what else runs on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gateway import gateway_process  # noqa: E402
from turns import Events, Microphone, of, speak  # noqa: E402

STUCK_S = 120.0
IDLE_AFTER_S = 10.0
SAMPLE_EVERY_S = 1.0
LONE_TURNS = 10
# Answers of a few sentences keep turns coming; a rambling one would be spoken for minutes.
MAX_OUTPUT_TOKENS = 30
QUESTIONS = (
    "What is a good name for a small grey cat?",
    "How many legs does a spider have?",
    "What colour is the sky on a clear day?",
    "Can you suggest a fruit for breakfast?",
    "What is the capital city of France?",
    "How do I boil an egg?",
    "Which season comes after winter?",
    "What sound does a cow make?",
    "Name a planet close to the sun.",
    "What should I pack for a picnic?",
)
OUTPUT_EVENTS = (
    "response.output_audio.delta",
    "response.output_audio_transcript.delta",
    "response.output_text.delta",
    "response.audio.delta",
    "response.audio_transcript.delta",
    "response.text.delta",
)


class Closed(Exception):
    """The gateway closed the session (or the connection dropped) while a client waited."""


@dataclass
class Tally:
    turns: int = 0
    barge_ins: int = 0
    disconnects: int = 0
    cancels: int = 0
    stuck: int = 0
    stale: int = 0
    refused: int = 0
    busy: int = 0  # spoken responses refused for capacity (an error, then response.done)
    closed_by_gateway: int = 0
    errors: list[str] = field(default_factory=list)
    sessions: int = 0
    # For each stuck wait, the event types the client saw while it waited.
    stuck_seen: list[list[str]] = field(default_factory=list)


def stale_deltas(log: list[tuple[float, dict[str, Any]]]) -> int:
    """Output deltas of a response that arrived after its `response.done`."""
    done: set[str] = set()
    stale = 0
    for _, event in log:
        kind = event["type"]
        if kind == "response.done":
            done.add(event["response"]["id"])
        elif kind in OUTPUT_EVENTS and event.get("response_id") in done:
            stale += 1
    return stale


def count_errors(log: list[tuple[float, dict[str, Any]]], tally: Tally) -> None:
    for _, event in log:
        if event["type"] == "error":
            tally.errors.append(str(event["error"].get("message", ""))[:200])


class Client:
    """One realtime session: its event log, and a microphone when it speaks."""

    def __init__(self, ws: ClientConnection, *, microphone: bool) -> None:
        self.ws = ws
        self.events = Events(ws)
        self.mic = Microphone(ws) if microphone else None
        self._tasks = [asyncio.create_task(self._read())]
        if self.mic is not None:
            self._tasks.append(asyncio.create_task(self.mic.run()))
        self.stuck_seen: list[list[str]] = []

    async def _read(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            await self.events.run()

    async def next(
        self, since: int, match: Callable[[dict[str, Any]], bool], timeout: float = STUCK_S
    ) -> tuple[int, float, dict[str, Any]]:
        """The first matching event from `since` on; Closed if the connection ends first."""
        waiter = asyncio.ensure_future(self.events.next(since, match, timeout))
        reader = self._tasks[0]
        await asyncio.wait({waiter, reader}, return_when=asyncio.FIRST_COMPLETED)
        if waiter.done():
            if isinstance(waiter.exception(), TimeoutError):
                seen = [event["type"] for _, event in self.events.log[since:]][-12:]
                self.stuck_seen.append(seen)
                log(f"stuck: no match within {timeout:g} s; saw {seen}")
            return waiter.result()
        waiter.cancel()
        raise Closed(f"closed with {self.ws.close_code} {self.ws.close_reason!r}")

    def mark(self) -> int:
        return len(self.events.log)

    async def close(self, *, abrupt: bool = False) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if abrupt:
            self.ws.transport.abort()  # no close frame: as a client whose network died
        else:
            with contextlib.suppress(Exception):
                await self.ws.close()

    def settle(self, tally: Tally) -> None:
        tally.stale += stale_deltas(self.events.log)
        tally.stuck_seen += self.stuck_seen
        count_errors(self.events.log, tally)


async def open_client(url: str, tally: Tally, *, microphone: bool) -> Client | None:
    try:
        # No keepalive from this side: a starved client must not close what it measures.
        ws = await connect(url, max_size=None, open_timeout=60, ping_interval=None)
    except InvalidStatus:
        tally.refused += 1
        return None
    client = Client(ws, microphone=microphone)
    session: dict[str, Any] = {"type": "realtime", "max_output_tokens": MAX_OUTPUT_TOKENS}
    if not microphone:  # a text user: text answers, turns by response.create
        session.update(output_modalities=["text"], audio={"input": {"turn_detection": None}})
    try:
        await client.next(0, of("session.created"), 60)
        await ws.send(json.dumps({"type": "session.update", "session": session}))
    except (Closed, ConnectionClosed, TimeoutError):
        tally.closed_by_gateway += 1
        await client.close()
        return None
    tally.sessions += 1
    return client


# --- the lone user ---------------------------------------------------------------------


def metrics_text(base: str) -> str:
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
        return str(response.read().decode())


def metric(text: str, name: str, labels: str = "") -> float | None:
    """The value of `name{labels}` (or `name_total{labels}`) in Prometheus text."""
    for line in text.splitlines():
        for prefix in (f"{name}{labels} ", f"{name}_total{labels} "):
            if line.startswith(prefix):
                return float(line[len(prefix) :])
    return None


def prefill_tokens(base: str) -> int:
    value = metric(metrics_text(base), "duplex_gateway_llm_tokens", '{phase="prefill"}')
    return int(value or 0)


async def lone_session(url: str, base: str, clips: list[bytes], tally: Tally) -> dict[str, Any]:
    """One voice user's `LONE_TURNS`-turn conversation, measured turn by turn."""
    client = await open_client(url, tally, microphone=True)
    assert client is not None and client.mic is not None, "the lone user was refused"
    turns = []
    try:
        await asyncio.sleep(1.0)
        for n in range(LONE_TURNS):
            try:
                turns.append(await lone_turn(client, base, clips[n % len(clips)]))
            except TimeoutError:
                tally.stuck += 1
                turns.append({"stuck": True})
            except Closed as exc:
                tally.closed_by_gateway += 1
                log(f"lone session {exc}")
                break
            log(f"lone turn {n}: {turns[-1]}")
    finally:
        client.settle(tally)
        await client.close()
    measured = [t for t in turns if t.get("first_audio_ms") is not None]
    first = [t["first_audio_ms"] for t in measured]
    return {
        "turns": turns,
        "first_audio_ms": first,
        "first_audio_ms_p50": float(np.median(first)) if first else None,
        # Turn-to-turn trend (ms per turn): a rise beyond noise shows up here.
        "first_audio_ms_slope_per_turn": round(float(np.polyfit(range(len(first)), first, 1)[0]), 1)
        if len(first) > 1
        else None,
        "prefill_tokens": [t.get("prefill_tokens") for t in turns],
        # Every turn after the first prefills at most what its prompt added to the last.
        "new_tokens_only_after_first": all(
            "stuck" not in t
            and "stuck" not in prev
            and t["prefill_tokens"] <= t["prompt_tokens"] - prev["prompt_tokens"]
            for prev, t in zip(turns, turns[1:], strict=False)
        ),
    }


async def lone_turn(client: Client, base: str, clip: bytes) -> dict[str, Any]:
    assert client.mic is not None
    before = await asyncio.to_thread(prefill_tokens, base)
    mark = client.mark()
    client.mic.play(clip)
    i, stopped_at, _ = await client.next(mark, of("input_audio_buffer.speech_stopped"))
    kinds = ("response.output_audio.delta", "response.done")
    _, first_at, first = await client.next(i, lambda e: e["type"] in kinds)
    _, _, done = await client.next(i, of("response.done"))
    usage = done["response"].get("usage") or {}
    details = usage.get("input_token_details") or {}
    # Let the gateway finish the turn's bookkeeping before reading the counter (the
    # microphone streams silence meanwhile).
    await asyncio.sleep(1.0)
    after = await asyncio.to_thread(prefill_tokens, base)
    audio = first["type"] != "response.done"
    return {
        "first_audio_ms": round((first_at - stopped_at) * 1000) if audio else None,
        "prefill_tokens": after - before,
        "prompt_tokens": int(usage.get("input_tokens", 0)),
        "cached_tokens": int(details.get("cached_tokens", 0)),
        "status": done["response"]["status"],
    }


def log(line: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


# --- the load ----------------------------------------------------------------------------


async def voice_user(url: str, clips: list[bytes], end: float, tally: Tally, seed: int) -> None:
    rng = random.Random(seed)
    while time.monotonic() < end:
        client = await open_client(url, tally, microphone=True)
        if client is None:
            await asyncio.sleep(2.0)
            continue
        assert client.mic is not None
        abrupt = False
        try:
            await asyncio.sleep(0.5)
            for _ in range(rng.randint(2, 5)):
                if time.monotonic() >= end:
                    break
                mark = client.mark()
                client.mic.play(rng.choice(clips))
                try:
                    i, _, created = await client.next(mark, of("response.created"))
                    rid = created["response"]["id"]
                    done = _done_of(rid)
                    roll = rng.random()
                    if roll < 0.45:
                        _, _, first = await client.next(i, _audio_or_done(rid))
                        if first["type"] == "response.done":
                            # Refused for capacity (its error came first): no audio to cut.
                            tally.busy += 1
                            continue
                    if roll < 0.25:  # barge-in once its audio plays
                        await asyncio.sleep(rng.uniform(0.2, 1.0))
                        client.mic.play(rng.choice(clips))
                        tally.barge_ins += 1
                        await client.next(i, done)
                        j, _, _ = await client.next(i, _created_other(rid))
                        await client.next(j, of("response.done"))
                    elif roll < 0.45:  # the network drops in mid-answer
                        await asyncio.sleep(rng.uniform(0.1, 1.0))
                        abrupt = True
                        tally.disconnects += 1
                        break
                    else:
                        await client.next(i, done)
                    tally.turns += 1
                except TimeoutError:
                    tally.stuck += 1
                except Closed as exc:
                    tally.closed_by_gateway += 1
                    log(f"voice session {exc}")
                    break
                await asyncio.sleep(rng.uniform(0.3, 1.5))
        finally:
            client.settle(tally)
            await client.close(abrupt=abrupt)


def _done_of(response_id: str) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e["type"] == "response.done" and e["response"]["id"] == response_id


def _audio_or_done(response_id: str) -> Callable[[dict[str, Any]], bool]:
    """The response's first audio, or its end if it has none (it was refused)."""
    return lambda e: (
        (e["type"] == "response.output_audio.delta" and e.get("response_id") == response_id)
        or (e["type"] == "response.done" and e["response"]["id"] == response_id)
    )


def _created_other(response_id: str) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e["type"] == "response.created" and e["response"]["id"] != response_id


async def text_user(url: str, end: float, tally: Tally, seed: int) -> None:
    rng = random.Random(seed)
    while time.monotonic() < end:
        client = await open_client(url, tally, microphone=False)
        if client is None:
            await asyncio.sleep(2.0)
            continue
        try:
            for _ in range(rng.randint(3, 6)):
                if time.monotonic() >= end:
                    break
                mark = client.mark()
                await client.ws.send(json.dumps(_ask(rng.choice(QUESTIONS))))
                await client.ws.send(json.dumps({"type": "response.create"}))
                try:
                    i, _, created = await client.next(mark, of("response.created"))
                    rid = created["response"]["id"]
                    if rng.random() < 0.4:
                        await client.next(i, lambda e: e["type"] in OUTPUT_EVENTS)
                        await client.ws.send(json.dumps({"type": "response.cancel"}))
                        tally.cancels += 1
                    await client.next(i, _done_of(rid))
                    tally.turns += 1
                except TimeoutError:
                    tally.stuck += 1
                except (Closed, ConnectionClosed) as exc:
                    tally.closed_by_gateway += 1
                    log(f"text session {exc}")
                    break
                await asyncio.sleep(rng.uniform(0.5, 3.0))
        finally:
            client.settle(tally)
            await client.close()


def _ask(text: str) -> dict[str, Any]:
    content = [{"type": "input_text", "text": text}]
    return {
        "type": "conversation.item.create",
        "item": {"type": "message", "role": "user", "content": content},
    }


async def idle_waves(url: str, count: int, every: float, end: float, tally: Tally) -> None:
    """`count` silent connections every `every` s, held, then half closed, half dropped."""
    while time.monotonic() < end and count > 0:
        started = time.monotonic()
        clients = await asyncio.gather(
            *(open_client(url, tally, microphone=False) for _ in range(count))
        )
        held = [c for c in clients if c is not None]
        await asyncio.sleep(max(0.0, min(end, started + every * 0.8) - time.monotonic()))
        await asyncio.gather(*(c.close(abrupt=bool(n % 2)) for n, c in enumerate(held)))
        for c in held:
            count_errors(c.events.log, tally)
        await asyncio.sleep(max(0.0, min(end, started + every) - time.monotonic()))


# --- memory -------------------------------------------------------------------------------


class RssSampler:
    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.samples: list[tuple[float, float]] = []  # (monotonic s, MiB)

    def now(self) -> float:
        return float(self.proc.memory_info().rss / 2**20)

    async def run(self) -> None:
        while True:
            self.samples.append((time.monotonic(), self.now()))
            await asyncio.sleep(SAMPLE_EVERY_S)

    def slope_mib_per_h(self, start: float, stop: float) -> float | None:
        window = [(t, m) for t, m in self.samples if start <= t <= stop]
        if len(window) < 3:
            return None
        t, m = np.array(window).T
        return round(float(np.polyfit(t, m, 1)[0]) * 3600, 1)

    def peak(self) -> float:
        return max(m for _, m in self.samples)


async def bounded(user: Awaitable[None], timeout: float, tally: Tally) -> None:
    try:
        await asyncio.wait_for(user, timeout)
    except TimeoutError:
        tally.stuck += 1
        log("a client was still waiting long after the end: counted as stuck")


async def report_progress(rss: RssSampler, tally: Tally, every: float = 60.0) -> None:
    while True:
        await asyncio.sleep(every)
        log(
            f"rss {rss.now():.0f} MiB, sessions {tally.sessions}, turns {tally.turns}, "
            f"stuck {tally.stuck}, stale {tally.stale}, refused {tally.refused}, "
            f"busy {tally.busy}, "
            f"closed by the gateway {tally.closed_by_gateway}"
        )


async def no_sessions(base: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{base}/healthz", timeout=30) as response:
            if json.loads(response.read())["sessions"] == 0:
                return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"sessions still open {timeout:g} s after the last client left")


def cache_gauges(base: str) -> dict[str, float]:
    """Every `duplex_gateway_engine_cache_*` sample, by its label set."""
    out = {}
    for line in metrics_text(base).splitlines():
        if line.startswith("duplex_gateway_engine_cache_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    clips = [await asyncio.to_thread(speak, q, "en-us") for q in QUESTIONS]
    extra = ["--config", str(args.config)] if args.config else []
    extra += args.gateway_args
    with gateway_process(*extra) as gateway:
        url = gateway.realtime_url
        base = f"http://127.0.0.1:{gateway.port}"
        rss = RssSampler(gateway.pid)
        sampler = asyncio.create_task(rss.run())
        tally = Tally()
        started_rss = rss.now()
        before = await lone_session(url, base, clips, tally)
        await no_sessions(base)
        await asyncio.sleep(IDLE_AFTER_S)
        baseline = rss.now()
        log(f"warm baseline rss {baseline:.1f} MiB")
        load_start = time.monotonic()
        end = load_start + args.duration
        users: list[Awaitable[None]] = [
            voice_user(url, clips, end, tally, seed) for seed in range(args.voice_users)
        ]
        users += [text_user(url, end, tally, 100 + seed) for seed in range(args.text_users)]
        users.append(idle_waves(url, args.idle, args.idle_every, end, tally))
        progress = asyncio.create_task(report_progress(rss, tally))
        # A client the gateway failed would hang the run: each gets its stuck time past the end.
        await asyncio.gather(*(bounded(u, args.duration + 2 * STUCK_S, tally) for u in users))
        progress.cancel()
        load_end = time.monotonic()
        await no_sessions(base)
        left_at = rss.now()
        await asyncio.sleep(IDLE_AFTER_S)
        idle = rss.now()
        log(f"rss when the last client left {left_at:.1f} MiB, {IDLE_AFTER_S:g} s later {idle:.1f}")
        caches_idle = await asyncio.to_thread(cache_gauges, base)
        after = await lone_session(url, base, clips, tally)
        sampler.cancel()
        slope = rss.slope_mib_per_h(load_start + (load_end - load_start) / 2, load_end)
        ratio = (
            after["first_audio_ms_p50"] / before["first_audio_ms_p50"]
            if after["first_audio_ms_p50"] and before["first_audio_ms_p50"]
            else None
        )
        return {
            "duration_s": round(load_end - load_start, 1),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "voice_users": args.voice_users,
            "text_users": args.text_users,
            "idle_per_wave": args.idle,
            "sessions_opened": tally.sessions,
            "turns": tally.turns,
            "barge_ins": tally.barge_ins,
            "abrupt_disconnects": tally.disconnects,
            "text_cancels": tally.cancels,
            "refused_connections": tally.refused,
            "responses_refused_for_capacity": tally.busy,
            "sessions_closed_by_gateway": tally.closed_by_gateway,
            "error_events": len(tally.errors),
            "error_samples": sorted(set(tally.errors))[:5],
            "stale_deltas": tally.stale,
            "stuck_turns": tally.stuck,
            "stuck_saw": tally.stuck_seen[:5],
            "rss_mib_start": round(started_rss, 1),
            "rss_mib_warm_baseline": round(baseline, 1),
            "rss_mib_peak": round(rss.peak(), 1),
            "rss_mib_end": round(left_at, 1),
            "rss_mib_idle_10s": round(idle, 1),
            "rss_idle_over_baseline_mib": round(idle - baseline, 1),
            "rss_slope_second_half_mib_per_h": slope,
            "engine_caches_idle": caches_idle,
            "lone_before": before,
            "lone_after": after,
            "first_audio_p50_after_over_before": round(ratio, 3) if ratio else None,
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--voice-users", type=int, default=3)
    parser.add_argument("--text-users", type=int, default=1)
    parser.add_argument("--idle", type=int, default=20, help="idle connections per wave")
    parser.add_argument("--idle-every", type=float, default=30.0, help="seconds between waves")
    parser.add_argument("--config", type=Path, help="gateway profile YAML")
    parser.add_argument(
        "gateway_args", nargs="*", help="more `duplex-gateway` arguments (after --)"
    )
    args = parser.parse_args()
    if args.duration <= 0:
        parser.error("--duration must be positive")
    result = asyncio.run(run(args))
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
