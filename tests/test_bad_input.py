"""Property-based bad input against a running `duplex-gateway` (real embedded models,
started through the CLI): for any sequence of well-formed and malformed client events,
the server stays up, answers every bad event with exactly one `error` event (naming the
event's `event_id` when it had one), answers no good event with an error, and a normal
text turn works afterwards on the same connection. Sessions left after bad input, with
or without a close frame, are released.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import ClientConnection, connect

from tests.helpers import GatewayProcess, running_gateway, wait_until

pytestmark = pytest.mark.models

SYNC = json.dumps({"type": "input_audio_buffer.clear"})


@dataclass(frozen=True)
class Sent:
    """One client frame and whether the server must refuse it."""

    frame: str | bytes
    bad: bool
    event_id: str | None = None


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayProcess]:
    """`duplex-gateway` in a subprocess."""
    with running_gateway() as gw:
        yield gw


# -- strategies ------------------------------------------------------------------------

KNOWN_TYPES = {
    "session.update",
    "transcription_session.update",
    "input_audio_buffer.append",
    "input_audio_buffer.commit",
    "input_audio_buffer.clear",
    "output_audio_buffer.clear",
    "conversation.item.create",
    "conversation.item.retrieve",
    "conversation.item.delete",
    "conversation.item.truncate",
    "response.create",
    "response.cancel",
}

ids = st.from_regex(r"[a-z]{3}_[A-Za-z0-9]{1,20}", fullmatch=True)
texts = st.text(max_size=40)
quiet_pcm = st.integers(1, 48).map(lambda n: bytes(n * 20))
# Text around lone surrogates: JSON spells them `\ud800`; they have no UTF-8 form. A run
# of high surrogates or of low ones only, since JSON joins `\ud800\udc00` into one
# character (U+10000), which is valid text.
high_surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDBFF)
low_surrogates = st.characters(min_codepoint=0xDC00, max_codepoint=0xDFFF)
lone_surrogates = st.text(high_surrogates, min_size=1) | st.text(low_surrogates, min_size=1)
broken_texts = st.tuples(texts, lone_surrogates, texts).map("".join)


def _event(kind: str, **fields: Any) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({"type": st.just(kind), **fields})


good_events = st.one_of(
    _event(
        "input_audio_buffer.append", audio=quiet_pcm.map(lambda b: base64.b64encode(b).decode())
    ),
    _event("input_audio_buffer.clear"),
    _event(
        "session.update",
        session=st.fixed_dictionaries(
            {"type": st.just("realtime"), "instructions": texts},
            optional={"output_modalities": st.sampled_from([["text"], ["audio"]])},
        ),
    ),
    _event(
        "conversation.item.create",
        item=texts.map(
            lambda t: {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": t}],
            }
        ),
    ),
)

bad_objects = st.one_of(
    st.fixed_dictionaries({}, optional={"type": st.none() | st.integers() | st.lists(texts)}),
    _event("response.explode"),
    st.builds(lambda t: {"type": t}, texts.filter(lambda t: t not in KNOWN_TYPES)),
    _event("input_audio_buffer.append", audio=st.integers() | st.none() | st.just("@@not b64@@")),
    _event("input_audio_buffer.append"),
    _event("session.update", session=st.just({"type": "realtime", "bogus": 1})),
    _event("session.update", session=st.just({"type": "realtime", "output_modalities": ["video"]})),
    _event("session.update", session=texts | st.integers()),
    _event("conversation.item.create", item=st.just({"type": "message", "role": "robot"})),
    _event("conversation.item.create", item=st.just({"type": "sandwich"})),
    _event("conversation.item.retrieve", item_id=ids),
    _event("conversation.item.delete", item_id=ids),
    _event(
        "conversation.item.truncate",
        item_id=ids,
        content_index=st.integers(0, 3),
        audio_end_ms=st.integers(-5, 5000),
    ),
    _event("response.cancel"),
    _event("response.create", response=st.just({"output_modalities": ["smell"]})),
    _event("input_audio_buffer.clear", extra=st.integers()),
    # Booleans are never integers (nor numbers), wherever a number is expected.
    _event(
        "session.update",
        session=st.builds(
            lambda field, flag: {
                "type": "realtime",
                "audio": {"input": {"turn_detection": {field: flag}}},
            },
            st.sampled_from(
                ["threshold", "prefix_padding_ms", "silence_duration_ms", "idle_timeout_ms"]
            ),
            st.booleans(),
        ),
    ),
    _event(
        "conversation.item.truncate",
        item_id=ids,
        content_index=st.booleans() | st.integers(),
        audio_end_ms=st.booleans(),
    ),
    _event(
        "response.create", response=st.builds(lambda b: {"max_output_tokens": b}, st.booleans())
    ),
    # Text with lone surrogates, wherever text goes.
    _event(
        "session.update",
        session=broken_texts.map(lambda t: {"type": "realtime", "instructions": t}),
    ),
    _event(
        "conversation.item.create",
        item=broken_texts.map(
            lambda t: {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": t}],
            }
        ),
    ),
    _event("response.create", response=broken_texts.map(lambda t: {"metadata": {"k": t}})),
    _event("input_audio_buffer.clear", event_id=broken_texts),
)


# -- numbers of any size, in fields with a range -----------------------------------------

# JSON number literals of any size: Python's json reads more than 4,300 digits as an
# error, 1e400 as infinity, and NaN/Infinity as themselves.
number_literals = st.one_of(
    st.integers().map(str),
    st.builds(lambda sign, n: sign + "9" * n, st.sampled_from(["", "-"]), st.integers(1, 6000)),
    st.floats().map(json.dumps),
    st.sampled_from(["1e400", "-1e400", "1e-400", "0.0", "-0", "4096.0", "true", "false"]),
)


def _integer_in(low: int, high: int) -> Callable[[object], bool]:
    def rule(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high

    return rule


def _number_in(low: float, high: float) -> Callable[[object], bool]:
    def rule(value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        finite = isinstance(value, int) or math.isfinite(value)
        return finite and low <= value <= high

    return rule


# A session.update setting one ranged field, and whether a value is within its rule.
RANGED_FIELDS: dict[str, tuple[dict[str, Any], Callable[[object], bool]]] = {
    "max_output_tokens": ({"type": "realtime", "max_output_tokens": "N"}, _integer_in(1, 4096)),
    "speed": ({"type": "realtime", "audio": {"output": {"speed": "N"}}}, _number_in(0.25, 1.5)),
}


def _within_rule(literal: str, rule: Callable[[object], bool]) -> bool:
    try:
        return rule(json.loads(literal))
    except ValueError:  # more digits than Python's json reads: the frame is not JSON
        return False


@st.composite
def ranged_updates(draw: st.DrawFn) -> Sent:
    template, rule = RANGED_FIELDS[draw(st.sampled_from(sorted(RANGED_FIELDS)))]
    literal = draw(number_literals)
    event = json.dumps({"type": "session.update", "session": template})
    return Sent(event.replace('"N"', literal), bad=not _within_rule(literal, rule))


def _not_an_object(text: str) -> bool:
    try:
        return not isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return True


@st.composite
def frames(draw: st.DrawFn) -> Sent:
    kinds = ["good", "bad", "bad", "ranged", "raw", "json", "binary", "deep"]
    kind = draw(st.sampled_from(kinds))
    if kind == "good":
        return Sent(json.dumps(draw(good_events)), False)
    if kind == "ranged":
        return draw(ranged_updates())
    if kind == "bad":
        event = draw(bad_objects)
        if "event_id" not in event:  # an event about a bad event_id brings its own
            event_id = draw(st.none() | ids)
            if event_id is not None:
                event["event_id"] = event_id
        return Sent(json.dumps(event), True, event.get("event_id"))
    if kind == "raw":
        return Sent(draw(texts.filter(_not_an_object)), True)
    if kind == "json":
        value = draw(st.none() | st.integers() | st.lists(st.integers()) | texts)
        return Sent(json.dumps(value), True)
    if kind == "binary":
        return Sent(draw(st.binary(max_size=64)), True)
    depth = draw(st.integers(2000, 20000))
    return Sent("[" * depth + "]" * depth, True)


# -- the client ------------------------------------------------------------------------


def is_clear(sent: Sent) -> bool:
    return not sent.bad and json.loads(sent.frame).get("type") == "input_audio_buffer.clear"


async def text_turn(ws: ClientConnection) -> dict[str, Any]:
    await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime"}}))
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi!"}]}
    await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
    response = {"output_modalities": ["text"], "max_output_tokens": 2}
    await ws.send(json.dumps({"type": "response.create", "response": response}))
    deltas = []
    async with asyncio.timeout(120):
        while True:
            event = json.loads(await ws.recv())
            assert event["type"] != "error", event
            if event["type"] == "response.output_text.delta":
                deltas.append(event["delta"])
            if event["type"] == "response.done":
                assert deltas, "the turn produced text"
                return event["response"]


async def open_session(port: int) -> ClientConnection:
    """A session with server VAD off, so only the client's events cause events."""
    ws = await connect(f"ws://127.0.0.1:{port}/v1/realtime", max_size=None)
    assert json.loads(await ws.recv())["type"] == "session.created"
    update = {"type": "realtime", "audio": {"input": {"turn_detection": None}}}
    await ws.send(json.dumps({"type": "session.update", "session": update}))
    return ws


async def run_sequence(port: int, sequence: list[Sent]) -> None:
    async with await open_session(port) as ws:
        for sent in sequence:
            caused = await exchange_one(ws, sent)
            errors = [e for e in caused if e["type"] == "error"]
            if sent.bad:
                assert len(errors) == 1, (sent, caused)
                if sent.event_id is not None:
                    assert errors[0]["error"]["event_id"] == sent.event_id
            else:
                assert errors == [], (sent, caused)
        response = await text_turn(ws)
        assert response["status"] in ("completed", "incomplete")


async def exchange_one(ws: ClientConnection, sent: Sent) -> list[dict[str, Any]]:
    """Events caused by `sent`: everything before the sync event's `cleared`."""
    await ws.send(sent.frame)
    await ws.send(SYNC)
    caused: list[dict[str, Any]] = []
    skip = 1 if is_clear(sent) else 0  # a good clear answers with its own `cleared` first
    async with asyncio.timeout(30):
        while True:
            event = json.loads(await ws.recv())
            if event["type"] == "input_audio_buffer.cleared":
                if skip:
                    skip -= 1
                    continue
                return caused
            caused.append(event)


def open_sessions(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=30) as response:
        return json.loads(response.read())["sessions"]


@settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(sequence=st.lists(frames(), min_size=1, max_size=10))
def test_any_event_sequence_is_answered_and_survived(
    gateway: GatewayProcess, sequence: list[Sent]
) -> None:
    asyncio.run(run_sequence(gateway.port, sequence))
    assert gateway.proc.poll() is None, "the gateway is still running"


BAD_FRAMES: list[str | bytes] = [b"\x00\xff", "not json", "[" * 5000 + "]" * 5000, "{}"]


def test_sessions_left_after_bad_input_are_released(gateway: GatewayProcess) -> None:
    """Sessions that got bad input are counted while open, then released whether the
    client closes or just vanishes. It opens its own sessions, so it tests alone too."""
    port = gateway.port

    async def scenario() -> None:
        # Sessions of earlier tests may still be closing.
        await wait_until(lambda: open_sessions(port) == 0, 30, "earlier sessions to close")
        clients = [await open_session(port) for _ in range(3)]
        for ws in clients:
            for frame in BAD_FRAMES:
                caused = await exchange_one(ws, Sent(frame, True))
                errors = [e for e in caused if e["type"] == "error"]
                assert len(errors) == 1, (frame, caused)
        assert open_sessions(port) == 3
        await clients[0].close()
        await clients[1].close()
        clients[2].transport.abort()  # no close frame: the peer just vanishes
        await wait_until(lambda: open_sessions(port) == 0, 30, "every session released")

    asyncio.run(scenario())
    assert gateway.proc.poll() is None, "the gateway is still running"
