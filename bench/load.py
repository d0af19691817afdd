"""Load: many realtime sessions on loopback, each streaming 24 kHz PCM16 in real time
(one 20 ms `input_audio_buffer.append` per 20 ms), most silent and some speaking.

    python bench/load.py [--json] [--levels 10,50,100] [--max-speaking 16] [--plot-dir DIR]
                         [--config PROFILE.yaml] [--through]

The gateway runs as `duplex-gateway` in a child process with the real embedded models (of
`--config`, if given) and server VAD on (the session default), so every silent stream
still costs decode, resampling and a VAD pass. Speaking sessions send an alsa-utils
recording of real speech.

Per level (N sessions, N/10 of them speaking one utterance at once):
- `event_loop_lag_ms_p50/p99`: a separate probe process pings the gateway over its own
  WebSocket every 50 ms; lag is the round trip minus the idle round trip (the gateway
  answers pings on its event loop, so a busy loop shows up here).
- `cpu_percent`: the gateway process (every thread) over the window; 100 = one core.
- `loop_cpu_us_per_frame`: the CPU the gateway's event-loop thread spent over the
  window, per appended frame (N sessions x 50 frames a second): the loop's own cost.
- `gateway_lag_over_20ms`: the share of the gateway's own loop-lag samples
  (`duplex_gateway_event_loop_lag_seconds`, a 100 ms timer) that ran 20 ms or more late.
- `rss_mb_per_session`: gateway RSS growth from just before the N sessions open to all of
  them streaming (before any turn, so model activations are not counted), divided by N.
- `error_events`: error events the sessions received; `error_messages`, the five most
  common of their messages with their counts.

Knee: the speaking count is stepped up (1, 2, 3, 4, 6, 8, ...) among `KNEE_POOL` (20) open
sessions until a step fails. A speaking session is served in real time when its reply
finishes (completed, or cut at max tokens) and its audio, played from the first delta
with a `JITTER_MS` buffer, never runs dry.
`active_sessions_realtime` is the largest step where every speaker was;
`first_audio_ms_p50_at_knee` is that step's median first-audio latency, beside
`first_audio_ms_p50_single` (the step with one speaker).

The limit: before the gateway starts, the same stages are loaded in this process and
timed (`stage_costs`): the TTS stage's real-time factor speaking one reply and
`LIMIT_BATCH` replies at once, the LLM stage's tokens per second answering one turn and
`LIMIT_BATCH` turns at once, one utterance through ASR, and VAD per second of one stream.
A speaking session needs, per second of speech, one second of audio, the tokens of that
second (output tokens per second of reply audio, measured on this run's replies) and its
share of one utterance's ASR (one utterance per reply). The stages share one engine
thread, so `limit_sessions` = (1 - VAD's share for the pool) / (those costs at
`LIMIT_BATCH`), and `knee_fraction` = active_sessions_realtime / limit_sessions.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import soundfile as sf
import soxr
from websockets.asyncio.client import ClientConnection, connect

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gateway import RATE, append_event, gateway_process, send_paced  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RECORDINGS = sorted(Path("/usr/share/sounds/alsa").glob("[FRS]*_*.wav"))
FRAME_MS = 20
FRAME_BYTES = RATE * 2 * FRAME_MS // 1000
# A client plays from the first delta; this much buffered audio absorbs network jitter.
JITTER_MS = 200
PROBE_INTERVAL_S = 0.05
TURN_TIMEOUT_S = 120.0
KNEE_POOL = 20
KNEE_STEPS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
# Stage costs for the limit are measured at this many requests at once (the target knee).
LIMIT_BATCH = 6
# A reply of natural length, as the default system prompt asks for (two short sentences).
REPLY_TEXT = (
    "The weather should stay mild and sunny for most of the afternoon. "
    "If you head out later, a light jacket will keep you comfortable."
)
COST_QUESTION = "What should I wear for a walk this afternoon?"

SILENT_FRAME = append_event(bytes(FRAME_BYTES))


def utterance_frames(path: Path) -> list[str]:
    """A recording as 20 ms append events (silence frames follow it on the stream)."""
    data, rate = sf.read(path, dtype="float32", always_2d=True)
    pcm = soxr.resample(data.mean(axis=1), rate, RATE)
    raw = (np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes()
    raw += bytes(-len(raw) % FRAME_BYTES)
    return [append_event(raw[i : i + FRAME_BYTES]) for i in range(0, len(raw), FRAME_BYTES)]


# -- clients ---------------------------------------------------------------------------


@dataclass
class Turn:
    """What one speaking session saw of its reply."""

    spoke_at: float
    deltas: list[tuple[float, float]] = field(default_factory=list)  # (arrival, audio ms)
    status: str | None = None
    done_at: float | None = None
    output_tokens: int = 0

    def stall_ms(self) -> float | None:
        """How far delivery fell behind playback that began at the first delta."""
        if not self.deltas:
            return None
        first = self.deltas[0][0]
        played, worst = 0.0, 0.0
        for arrival, ms in self.deltas:
            worst = max(worst, (arrival - first) * 1000 - played)
            played += ms
        return worst

    def finished(self) -> bool:
        # "incomplete" is a reply cut at max_output_tokens: finished, not failed.
        return self.status in ("completed", "incomplete")

    def realtime(self) -> bool:
        stall = self.stall_ms()
        return self.finished() and stall is not None and stall <= JITTER_MS

    def first_audio_ms(self) -> float | None:
        return (self.deltas[0][0] - self.spoke_at) * 1000 if self.deltas else None

    def audio_s(self) -> float:
        return sum(ms for _, ms in self.deltas) / 1000


class Client:
    """One session: streams a 20 ms frame every 20 ms and reads every server event."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.pending: list[str] = []
        self.turn: Turn | None = None
        self.done = asyncio.Event()
        self.errors: list[str] = []
        self._tasks = [asyncio.create_task(self._stream()), asyncio.create_task(self._read())]

    def speak(self, frames: list[str]) -> None:
        self.pending = list(reversed(frames))
        self.done.clear()
        self.turn = Turn(spoke_at=time.monotonic() + len(frames) * FRAME_MS / 1000)

    def _frames(self) -> Iterator[str]:
        """The microphone: the utterance being spoken, else silence, without end."""
        while True:
            yield self.pending.pop() if self.pending else SILENT_FRAME

    async def _stream(self) -> None:
        await send_paced(self.ws, self._frames(), FRAME_MS)

    async def _read(self) -> None:
        async for message in self.ws:
            event = json.loads(message)
            kind, turn = event["type"], self.turn
            if kind == "error":
                self.errors.append(event["error"]["message"])
            elif turn is None:
                continue
            elif kind == "response.output_audio.delta":
                ms = len(base64.b64decode(event["delta"])) / 2 / RATE * 1000
                turn.deltas.append((time.monotonic(), ms))
            elif kind == "response.done":
                turn.status = event["response"]["status"]
                turn.done_at = time.monotonic()
                usage = event["response"].get("usage") or {}
                turn.output_tokens = int(usage.get("output_tokens", 0))
                self.done.set()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.ws.close()


async def open_clients(url: str, n: int) -> list[Client]:
    async def one() -> Client:
        ws = await connect(url, max_size=None, open_timeout=60)
        first = json.loads(await ws.recv())
        assert first["type"] == "session.created", first
        return Client(ws)

    clients: list[Client] = []
    for start in range(0, n, 10):  # a few at a time: the handshake is not what we measure
        clients += await asyncio.gather(*(one() for _ in range(min(10, n - start))))
    return clients


async def drained(url: str, timeout: float = 120) -> None:
    """Wait until the gateway has released every session (its /healthz count is 0)."""
    health = url.replace("ws://", "http://").replace("/v1/realtime", "/healthz")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(health, timeout=30).read())
        if json.loads(body)["sessions"] == 0:
            return
        await asyncio.sleep(0.5)
    raise RuntimeError(f"the gateway still holds sessions after {timeout:g} s")


async def run_turns(
    clients: list[Client], speakers: int, utterances: list[list[str]]
) -> list[Turn]:
    talking = clients[:speakers]
    for i, client in enumerate(talking):
        client.speak(utterances[i % len(utterances)])
    # asyncio.TimeoutError: on Python 3.10 it is not yet the builtin TimeoutError.
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.gather(*(c.done.wait() for c in talking)), TURN_TIMEOUT_S)
    return [c.turn for c in talking if c.turn is not None]


# -- event-loop probe ------------------------------------------------------------------


async def probe(url: str, out: Path) -> None:
    """Child process: ping the gateway every 50 ms; append round trips (ms) to `out`."""
    async with connect(url, max_size=None) as ws:
        with out.open("w") as f:
            while True:
                sent = time.perf_counter()
                await (await ws.ping())
                f.write(f"{(time.perf_counter() - sent) * 1000:.3f}\n")
                f.flush()
                await asyncio.sleep(PROBE_INTERVAL_S)


@contextlib.contextmanager
def probing(url: str) -> Iterator[list[float]]:
    """Round trips (ms) measured while the block runs."""
    samples: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rtt.txt"
        cmd = [sys.executable, __file__, "--probe", url, "--probe-out", str(out)]
        proc = subprocess.Popen(cmd, cwd=ROOT)
        try:
            yield samples
        finally:
            proc.terminate()
            proc.wait()
            samples += [float(x) for x in out.read_text().split()] if out.exists() else []


# -- measurement -----------------------------------------------------------------------


def lag_share_over(before: dict[str, float], after: dict[str, float], bound: str) -> float | None:
    """The share of the loop-lag samples taken between two scrapes that were over `bound`."""
    total = after["+Inf"] - before.get("+Inf", 0.0)
    within = after[bound] - before.get(bound, 0.0)
    return round((total - within) / total, 4) if total else None


def percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 1) if values else None


def summarize_turns(turns: list[Turn]) -> dict[str, Any]:
    first = [t.first_audio_ms() for t in turns]
    stalls = [t.stall_ms() for t in turns]
    return {
        "speaking_realtime": bool(turns) and all(t.realtime() for t in turns),
        "speaking_finished": sum(t.finished() for t in turns),
        "speaking_with_audio": sum(s is not None for s in stalls),
        "worst_stall_ms": round(max(s for s in stalls if s is not None), 1)
        if any(s is not None for s in stalls)
        else None,
        "first_audio_ms_p50": percentile([f for f in first if f is not None], 50),
    }


def loop_cpu_s(server: psutil.Process) -> float:
    """CPU seconds of the gateway's event-loop thread (its main thread) so far."""
    (main,) = (t for t in server.threads() if t.id == server.pid)
    return main.user_time + main.system_time


def loop_lag_counts(url: str) -> dict[str, float]:
    """The gateway's loop-lag histogram: cumulative sample counts by upper bound."""
    metrics = url.replace("ws://", "http://").replace("/v1/realtime", "/metrics")
    body = urllib.request.urlopen(metrics, timeout=30).read().decode()
    prefix = "duplex_gateway_event_loop_lag_seconds_bucket{"
    return {
        line.split('le="')[1].split('"')[0]: float(line.split()[-1])
        for line in body.splitlines()
        if line.startswith(prefix)
    }


async def measure_level(
    url: str, pid: int, n: int, utterances: list[list[str]], idle: dict[str, float]
) -> dict[str, Any]:
    server = psutil.Process(pid)
    # Earlier levels' turns leave model buffers allocated; measure growth from here.
    before_rss = server.memory_info().rss / 2**20
    clients = await open_clients(url, n)
    try:
        await asyncio.sleep(2.0)  # every stream running before the window opens
        # Per-session memory before any turn, so model activations do not count.
        streaming_rss = server.memory_info().rss / 2**20
        speakers = max(1, n // 10)
        server.cpu_percent(None)
        loop_before, lag_before = loop_cpu_s(server), await asyncio.to_thread(loop_lag_counts, url)
        started = time.monotonic()
        with probing(url) as rtts:
            turns = await run_turns(clients, speakers, utterances)
            await asyncio.sleep(max(0.0, 5.0 - (time.monotonic() - started)))
            cpu = server.cpu_percent(None)
            loop_cpu = loop_cpu_s(server) - loop_before
            frames = n * 1000 / FRAME_MS * (time.monotonic() - started)
            lag_after = await asyncio.to_thread(loop_lag_counts, url)
            rss = server.memory_info().rss / 2**20
        lags = [max(0.0, r - idle["rtt_ms"]) for r in rtts]
        errors = collections.Counter(message for c in clients for message in c.errors)
    finally:
        await asyncio.gather(*(c.close() for c in clients))
    await drained(url)
    return {
        "sessions": n,
        "speaking": speakers,
        "window_s": round(time.monotonic() - started, 1),
        "event_loop_lag_ms_p50": percentile(lags, 50),
        "event_loop_lag_ms_p99": percentile(lags, 99),
        "cpu_percent": round(cpu, 1),
        "loop_cpu_us_per_frame": round(loop_cpu / frames * 1e6, 1),
        "gateway_lag_over_20ms": lag_share_over(lag_before, lag_after, "0.02"),
        "rss_mb_streaming": round(streaming_rss, 1),
        "rss_mb_after_turns": round(rss, 1),
        "rss_mb_per_session": round((streaming_rss - before_rss) / n, 2),
        "error_events": sum(errors.values()),
        "error_messages": dict(errors.most_common(5)),
        **summarize_turns(turns),
    }


async def find_knee(
    url: str, utterances: list[list[str]], max_speaking: int, through: bool = False
) -> tuple[list[dict], list[Turn]]:
    """The knee steps, and every turn they ran (their replies measure speech's needs).
    With `through`, every step up to `max_speaking` runs even after one fails (for the
    stall curve on a busy machine)."""
    steps, seen = [], []
    for speaking in (s for s in KNEE_STEPS if s <= max_speaking):
        clients = await open_clients(url, max(KNEE_POOL, speaking))
        try:
            await asyncio.sleep(1.0)
            turns = await run_turns(clients, speaking, utterances)
        finally:
            await asyncio.gather(*(c.close() for c in clients))
        await drained(url)
        seen += turns
        steps.append({"speaking": speaking, **summarize_turns(turns)})
        if not steps[-1]["speaking_realtime"] and not through:
            break
        await asyncio.sleep(1.0)
    return steps, seen


async def idle_baseline(url: str, pid: int) -> dict[str, float]:
    await asyncio.sleep(1.0)
    with probing(url) as rtts:
        await asyncio.sleep(3.0)
    return {
        "rtt_ms": float(np.median(rtts)) if rtts else 0.0,
        "rss_mb": psutil.Process(pid).memory_info().rss / 2**20,
    }


async def run(
    levels: list[int], max_speaking: int, config: Path | None, through: bool = False
) -> dict[str, Any]:
    utterances = [utterance_frames(p) for p in RECORDINGS]
    costs = await asyncio.to_thread(stage_costs, config)
    extra = ["--max-sessions", str(max(levels + [KNEE_POOL, max_speaking]) + 8)]
    extra += ["--config", str(config)] if config is not None else []
    with gateway_process(*extra) as gateway:
        url, pid = gateway.realtime_url, gateway.pid
        idle = await idle_baseline(url, pid)
        results = [await measure_level(url, pid, n, utterances, idle) for n in levels]
        knee, turns = await find_knee(url, utterances, max_speaking, through)
    passing = list(itertools.takewhile(lambda s: s["speaking_realtime"], knee))
    at_knee = passing[-1] if passing else None
    single = knee[0]["first_audio_ms_p50"] if knee else None
    limit = capacity(costs, turns)
    active = at_knee["speaking"] if at_knee else 0
    top = results[-1] if results else {}
    return {
        "cpu_count": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "idle_rtt_ms": round(idle["rtt_ms"], 2),
        "idle_rss_mb": round(idle["rss_mb"], 1),
        "jitter_buffer_ms": JITTER_MS,
        "levels": results,
        "knee": knee,
        "knee_pool": KNEE_POOL,
        "active_sessions_realtime": active,
        "first_audio_ms_p50_single": single,
        "first_audio_ms_p50_at_knee": at_knee["first_audio_ms_p50"] if at_knee else None,
        "stage_costs": costs,
        **limit,
        "knee_fraction": round(active / limit["limit_sessions"], 2),
        "sessions": top.get("sessions"),
        "event_loop_lag_ms_p99": top.get("event_loop_lag_ms_p99"),
        "cpu_percent": top.get("cpu_percent"),
        "rss_mb_per_session": top.get("rss_mb_per_session"),
    }


# -- the computed limit ----------------------------------------------------------------


def stage_costs(config: Path | None) -> dict[str, float]:
    """Time each stage in this process, as the gateway builds it (module docstring)."""
    import mlx.core as mx

    from engine.build import cache_system_prompt, load_stages, warm_up
    from engine.config import load_config

    profile = load_config(config or ROOT / "configs" / "default.yaml")
    stages = load_stages(profile, progress=False)
    try:
        warm_up(stages)
        cache_system_prompt(stages, profile.system_prompt)
        utterance = sf.read(RECORDINGS[0], dtype="float32", always_2d=True)
        speech = soxr.resample(utterance[0].mean(axis=1), utterance[1], 16000)
        return {
            "tts_rtf_1": round(tts_rtf(stages["tts"], 1), 4),
            f"tts_rtf_{LIMIT_BATCH}": round(tts_rtf(stages["tts"], LIMIT_BATCH), 4),
            "llm_tok_s_1": round(llm_tokens_per_s(stages["llm"], 1, profile.system_prompt), 1),
            f"llm_tok_s_{LIMIT_BATCH}": round(
                llm_tokens_per_s(stages["llm"], LIMIT_BATCH, profile.system_prompt), 1
            ),
            "asr_ms_per_utterance": round(asr_ms(stages["asr"], speech), 1),
            "vad_ms_per_stream_s": round(vad_ms_per_stream_s(stages["vad"], KNEE_POOL), 3),
        }
    finally:
        mx.synchronize()


def _drain(stage: Any) -> list[Any]:
    outputs = []
    while stage.has_work():
        outputs += stage.step()
    return outputs


def tts_rtf(stage: Any, n: int) -> float:
    """Seconds of TTS stage time per second of audio, speaking `n` replies at once."""
    from engine.stages.tts import TtsRequest

    start = time.perf_counter()
    for i in range(n):
        stage.add(f"cost{i}", TtsRequest())
        stage.feed(f"cost{i}", REPLY_TEXT, final=True)
    audio_ms = sum(o.payload.duration_ms for o in _drain(stage) if o.payload is not None)
    return (time.perf_counter() - start) / (audio_ms / 1000)


def llm_tokens_per_s(stage: Any, n: int, system: str) -> float:
    """Output tokens per second of LLM stage time, answering `n` turns at once."""
    from engine.llm.stage import LlmInput
    from engine.runtime.request import SamplingParams

    messages = [{"role": "system", "content": system}, {"role": "user", "content": COST_QUESTION}]
    params = SamplingParams(max_tokens=48, temperature=0.0)
    start = time.perf_counter()
    for i in range(n):
        stage.add(f"cost{i}", LlmInput(messages=messages, sampling_params=params))
    tokens = sum(len(o.payload.new_token_ids) for o in _drain(stage) if o.payload is not None)
    return tokens / (time.perf_counter() - start)


def asr_ms(stage: Any, speech: np.ndarray) -> float:
    start = time.perf_counter()
    stage.add("cost", speech)
    _drain(stage)
    return (time.perf_counter() - start) * 1000


def vad_ms_per_stream_s(stage: Any, streams: int) -> float:
    """VAD stage milliseconds per second of one stream's audio, `streams` at once."""
    seconds = 2
    for i in range(streams):
        stage.add(f"cost{i}", None)
        stage.feed(f"cost{i}", np.zeros(16000 * seconds, np.float32))
    start = time.perf_counter()
    _drain(stage)
    elapsed = time.perf_counter() - start
    for i in range(streams):
        stage.abort(f"cost{i}")
    return elapsed * 1000 / (streams * seconds)


def capacity(costs: dict[str, float], turns: list[Turn]) -> dict[str, float]:
    """Speaking sessions the stages can serve at once (module docstring)."""
    spoken = [t for t in turns if t.audio_s() > 0 and t.output_tokens > 0]
    audio_s = sum(t.audio_s() for t in spoken)
    # Without measured replies, the estimate: 3.5 tokens per second of speech.
    tokens_per_s = sum(t.output_tokens for t in spoken) / audio_s if spoken else 3.5
    reply_s = audio_s / len(spoken) if spoken else 5.0
    per_speech_s = (
        costs[f"tts_rtf_{LIMIT_BATCH}"]
        + tokens_per_s / costs[f"llm_tok_s_{LIMIT_BATCH}"]
        + costs["asr_ms_per_utterance"] / 1000 / reply_s
    )
    vad_share = costs["vad_ms_per_stream_s"] / 1000 * KNEE_POOL
    return {
        "speech_tokens_per_s": round(tokens_per_s, 2),
        "reply_audio_s": round(reply_s, 2),
        "engine_s_per_speech_s": round(per_speech_s, 4),
        "limit_sessions": round((1 - vad_share) / per_speech_s, 1),
    }


# -- plots -----------------------------------------------------------------------------


def plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Lag, CPU and memory against sessions; the realtime knee. Returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [plot_knee(result, out_dir)]
    if result["levels"]:
        paths.insert(0, plot_levels(result, out_dir))
    return paths


def plot_levels(result: dict[str, Any], out_dir: Path) -> Path:
    import matplotlib.pyplot as plt

    levels = result["levels"]
    n = [lv["sessions"] for lv in levels]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    series = [
        ("event_loop_lag_ms_p99", "event-loop lag p99 (ms)"),
        ("cpu_percent", "gateway CPU (%, 100 = 1 core)"),
        ("rss_mb_per_session", "RSS per session (MB)"),
    ]
    for ax, (key, label) in zip(axes, series, strict=True):
        ax.plot(n, [lv[key] or 0 for lv in levels], marker="o")
        ax.set_xlabel("concurrent sessions")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    scale = out_dir / "load_scale.png"
    fig.savefig(scale, dpi=80)
    plt.close(fig)
    return scale


def plot_knee(result: dict[str, Any], out_dir: Path) -> Path:
    """Worst stall and first-audio latency against the number of speaking sessions."""
    import matplotlib.pyplot as plt

    knee = result["knee"]
    fig, (ax, lat) = plt.subplots(1, 2, figsize=(10, 3.6))
    speaking = [s["speaking"] for s in knee]
    stalls = [s["worst_stall_ms"] or 0 for s in knee]
    colors = ["tab:green" if s["speaking_realtime"] else "tab:red" for s in knee]
    ax.bar([str(s) for s in speaking], stalls, color=colors)
    ax.axhline(JITTER_MS, color="gray", linestyle="--", label=f"jitter buffer {JITTER_MS} ms")
    ax.set_xlabel(f"sessions speaking at once (of {result['knee_pool']} open)")
    ax.set_ylabel("worst playback stall (ms)")
    ax.set_yscale("symlog")
    ax.set_title(
        f"realtime knee: {result['active_sessions_realtime']} speaking, "
        f"computed limit {result['limit_sessions']}",
        fontsize=10,
    )
    ax.legend()
    lat.plot(speaking, [s["first_audio_ms_p50"] or 0 for s in knee], marker="o")
    single = result["first_audio_ms_p50_single"]
    if single:
        lat.axhline(1.5 * single, color="gray", linestyle="--", label="1.5 x one speaker")
        lat.legend()
    lat.set_xlabel("sessions speaking at once")
    lat.set_ylabel("first audio p50 (ms)")
    lat.grid(alpha=0.3)
    fig.tight_layout()
    knee_png = out_dir / "load_knee.png"
    fig.savefig(knee_png, dpi=80)
    plt.close(fig)
    return knee_png


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--levels", default="10,50,100", help='comma-separated session counts ("": none)'
    )
    parser.add_argument("--max-speaking", type=int, default=16, help="last knee step to try")
    parser.add_argument("--plot-dir", type=Path, help="write PNG plots here")
    parser.add_argument(
        "--through", action="store_true", help="run every knee step, even after one fails"
    )
    parser.add_argument("--config", type=Path, help="gateway profile YAML")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--probe-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        with contextlib.suppress(KeyboardInterrupt):
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
            asyncio.run(probe(args.probe, args.probe_out))
        return
    levels = [int(x) for x in args.levels.split(",") if x]  # "": the knee only
    if min(levels, default=1) < 1 or args.max_speaking < 1:
        parser.error("--levels and --max-speaking must be positive")
    result = asyncio.run(run(levels, args.max_speaking, args.config, args.through))
    if args.plot_dir is not None:
        result["plots"] = [os.path.relpath(p, ROOT) for p in plot(result, args.plot_dir)]
    if args.json:
        print(json.dumps(result))
        return
    for level in result["levels"]:
        print(json.dumps(level))
    for step in result["knee"]:
        print(json.dumps(step))
    for key in ("active_sessions_realtime", "limit_sessions", "knee_fraction"):
        print(f"{key}: {result[key]}")
    print(
        f"first audio p50: single {result['first_audio_ms_p50_single']} ms, at the knee "
        f"{result['first_audio_ms_p50_at_knee']} ms"
    )


if __name__ == "__main__":
    # `stage_costs` runs MLX on a worker thread: skip its C++ teardown, which can abort,
    # whether the run ends well or with an error.
    import engine

    engine.setup()  # before engine.runtime.core imports mlx: stage_costs on the optimised BLAS
    from engine.runtime.core import exit_after

    exit_after(main)
