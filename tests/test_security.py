"""Security of a running `duplex-gateway` (real embedded models, started through the CLI):
API key, origin allow-list, loopback bind, no path traversal out of web/, and every
per-session and per-server limit of the `gateway:` profile section.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psutil
import pytest
import yaml
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from gateway.config import GatewayConfig
from tests.helpers import ROOT, running_gateway, wait_until

pytestmark = pytest.mark.models

KEY = "sk-test-7f3a91"
GOOD_ORIGIN = "https://app.example"
MAX_SESSIONS = 3
LIMITS = {
    "max_event_bytes": 64 * 1024,
    "max_frame_bytes": 256 * 1024,
    "max_input_buffer_ms": 2000,
    "max_items": 4,
    "max_session_s": 12.0,
    "max_pending_handshakes": 12,
    "max_pending_handshakes_per_address": 8,
}
RATE = 24000


@dataclass
class Gateway:
    port: int
    pid: int
    lines: list[str]

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """The CLI with a key, one allowed origin, tight limits and no --host."""
    profile = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    profile["gateway"] = {"limits": LIMITS}
    path = tmp_path_factory.mktemp("profile") / "secure.yaml"
    path.write_text(yaml.safe_dump(profile))
    args = ["--config", str(path), "--api-key", KEY, "--allowed-origin", GOOD_ORIGIN]
    with running_gateway(*args, "--max-sessions", str(MAX_SESSIONS)) as gw:
        yield Gateway(gw.port, gw.proc.pid, gw.lines)


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def raw_get(port: int, target: str) -> tuple[int, bytes]:
    """A GET with the request target sent byte for byte (no client-side normalising)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(
            f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {KEY}\r\nConnection: close\r\n\r\n".encode()
        )
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


AUTH = {"Authorization": f"Bearer {KEY}"}


async def open_session(gw: Gateway, **kwargs: Any) -> ClientConnection:
    headers = kwargs.pop("additional_headers", AUTH)
    ws = await connect(gw.ws, additional_headers=headers, max_size=None, **kwargs)
    first = json.loads(await ws.recv())
    assert first["type"] == "session.created"
    return ws


async def next_of(ws: ClientConnection, *kinds: str, timeout: float = 30) -> dict[str, Any]:
    async with asyncio.timeout(timeout):
        while True:
            event = json.loads(await ws.recv())
            if event["type"] in kinds:
                return event


async def manual_turns(ws: ClientConnection) -> None:
    update = {"type": "realtime", "audio": {"input": {"turn_detection": None}}}
    await ws.send(json.dumps({"type": "session.update", "session": update}))
    await next_of(ws, "session.updated")


# -- API key -------------------------------------------------------------------------


async def test_realtime_refuses_a_missing_or_wrong_key(gateway: Gateway) -> None:
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": KEY}):
        with pytest.raises(InvalidStatus) as caught:
            await connect(gateway.ws, additional_headers=headers)
        assert caught.value.response.status_code == 401
        assert json.loads(caught.value.response.body)["error"]["code"] == "invalid_api_key"
    with pytest.raises(InvalidStatus):
        await connect(gateway.ws, subprotocols=["realtime", "openai-insecure-api-key.nope"])


async def test_realtime_accepts_the_key_as_bearer_or_subprotocol(gateway: Gateway) -> None:
    ws = await open_session(gateway)
    await ws.close()
    protocols = ["realtime", f"openai-insecure-api-key.{KEY}"]
    ws = await open_session(gateway, additional_headers={}, subprotocols=protocols)
    assert ws.subprotocol == "realtime"
    await ws.close()


@pytest.mark.parametrize("path", ["/metrics", "/web/", "/web/index.html", "/web/app.js"])
def test_metrics_and_web_refuse_a_missing_or_wrong_key(gateway: Gateway, path: str) -> None:
    assert get(gateway.http + path)[0] == 401
    assert get(gateway.http + path, {"Authorization": "Bearer sk-wrong"})[0] == 401
    assert get(gateway.http + path, AUTH)[0] == 200


def test_browser_opens_the_page_with_the_key_in_its_address(gateway: Gateway) -> None:
    """`/web/?api_key=KEY` sets an HttpOnly cookie that lets the page's scripts load."""
    assert get(gateway.http + "/web/?api_key=sk-wrong")[0] == 401
    request = urllib.request.Request(gateway.http + f"/web/?api_key={KEY}")
    with urllib.request.urlopen(request, timeout=30) as response:
        cookie = response.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    assert get(gateway.http + "/web/app.js", {"Cookie": cookie.split(";")[0]})[0] == 200
    assert get(gateway.http + "/web/app.js", {"Cookie": "duplex_gateway_key=nope"})[0] == 401


def test_healthz_stays_open(gateway: Gateway) -> None:
    status, body = get(gateway.http + "/healthz")
    assert status == 200
    assert json.loads(body)["status"] == "ok"


# -- origin and bind ----------------------------------------------------------------


async def test_origin_allow_list(gateway: Gateway) -> None:
    for origin in ("https://evil.example", "http://app.example", "https://app.example.evil"):
        with pytest.raises(InvalidStatus) as caught:
            await connect(gateway.ws, additional_headers={**AUTH, "Origin": origin})
        assert caught.value.response.status_code == 403
    ws = await open_session(gateway, additional_headers={**AUTH, "Origin": GOOD_ORIGIN})
    await ws.close()


def test_default_bind_is_loopback(gateway: Gateway) -> None:
    assert GatewayConfig().host == "127.0.0.1"
    listening = [
        c.laddr
        for c in psutil.Process(gateway.pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]
    assert listening, "the gateway listens"
    assert {addr.ip for addr in listening} == {"127.0.0.1"}
    assert any(f"ws://127.0.0.1:{gateway.port}/" in line for line in gateway.lines)


# -- path traversal -----------------------------------------------------------------

TRAVERSALS = [
    "/web/../pyproject.toml",
    "/web/../../etc/passwd",
    "/web/%2e%2e/pyproject.toml",
    "/web/%2E%2E/%2E%2E/etc/passwd",
    "/web/..%2fpyproject.toml",
    "/web/..%2F..%2Fetc%2Fpasswd",
    "/web/%252e%252e/pyproject.toml",
    "/web/..%5cpyproject.toml",
    "/web/..\\pyproject.toml",
    "/web/%c0%ae%c0%ae/pyproject.toml",
    "/web//etc/passwd",
    "/web/./../gateway/config.py",
    "/web/%2e%2e%2f%2e%2e%2fgateway%2fconfig.py",
    "/web/....//pyproject.toml",
]


@pytest.mark.parametrize("target", TRAVERSALS)
def test_no_path_traversal_out_of_web(gateway: Gateway, target: str) -> None:
    status, body = raw_get(gateway.port, target)
    assert status in (400, 403, 404)
    for secret in (b"root:", b"[project]", b"class GatewayConfig"):
        assert secret not in body


def test_web_still_serves_its_own_files(gateway: Gateway) -> None:
    status, body = raw_get(gateway.port, "/web/index.html")
    assert status == 200
    assert body == (ROOT / "web" / "index.html").read_bytes()


# -- HTTP surface -------------------------------------------------------------------


def raw_answer(port: int, request: bytes, source: str = "127.0.0.1") -> tuple[int, str, bytes]:
    """Status, header block and body of the answer to `request` sent byte for byte."""
    with socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0)) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data, "the server closed without an answer"
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), head.decode().lower(), body


def test_http_mistakes_are_answered_without_tracebacks(gateway: Gateway) -> None:
    auth = f"Authorization: Bearer {KEY}\r\n"
    status, head, body = raw_answer(gateway.port, b"HEAD /healthz HTTP/1.1\r\n\r\n")
    assert status == 200 and body == b"" and "content-length: " in head
    status, _, body = raw_answer(gateway.port, f"HEAD /web/ HTTP/1.1\r\n{auth}\r\n".encode())
    assert status == 200 and body == b""
    status, head, _ = raw_answer(
        gateway.port, b"POST /healthz HTTP/1.1\r\nContent-Length: 0\r\n\r\n"
    )
    assert status == 405 and "allow: get, head" in head
    long_name = f"GET /web/{'x' * 300} HTTP/1.1\r\n{auth}\r\n"
    assert raw_answer(gateway.port, long_name.encode())[0] == 404
    long_url = f"GET /web/{'x' * 9000} HTTP/1.1\r\n\r\n"
    assert raw_answer(gateway.port, long_url.encode())[0] == 414
    long_header = f"GET /healthz HTTP/1.1\r\nX-Big: {'y' * 9000}\r\n\r\n"
    assert raw_answer(gateway.port, long_header.encode())[0] == 431
    assert not [line for line in gateway.lines if "Traceback" in line or "ERROR" in line]


def open_pending(port: int, source: str) -> socket.socket:
    """A connection that has sent only part of its request, as a slow or hostile client."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0))
    s.sendall(b"GET /v1/realtime HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    return s


def answer_without_asking(port: int, source: str) -> int:
    """The status the server sends a new connection before it has sent anything."""
    with socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0)) as s:
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return int(data.split()[1])


async def test_pending_handshakes_are_bounded(gateway: Gateway) -> None:
    per_address = LIMITS["max_pending_handshakes_per_address"]
    held = [open_pending(gateway.port, "127.0.0.1") for _ in range(int(per_address))]
    try:
        assert answer_without_asking(gateway.port, "127.0.0.1") == 503
        # Another address still gets in, up to the bound for the whole process.
        assert raw_answer(gateway.port, b"GET /healthz HTTP/1.1\r\n\r\n", "127.0.0.2")[0] == 200
        rest = int(LIMITS["max_pending_handshakes"] - per_address)
        held += [open_pending(gateway.port, "127.0.0.2") for _ in range(rest)]
        assert answer_without_asking(gateway.port, "127.0.0.3") == 503
    finally:
        for s in held:
            s.close()

    def healthy() -> bool:
        try:
            return get(gateway.http + "/healthz")[0] == 200
        except OSError:  # refused at the bound, which the server may not have left yet
            return False

    await wait_until(healthy, 10, "the closed connections to leave the bound")
    assert not [line for line in gateway.lines if "Traceback" in line or "ERROR" in line]


# -- limits -------------------------------------------------------------------------


async def test_event_size_limit(gateway: Gateway) -> None:
    ws = await open_session(gateway)
    big = json.dumps({"type": "conversation.item.retrieve", "item_id": "x" * 70_000})
    await ws.send(big)
    error = await next_of(ws, "error")
    assert error["error"]["code"] == "event_too_large"
    await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
    assert (await next_of(ws, "input_audio_buffer.cleared", "error"))["type"].endswith("cleared")
    await ws.close()


async def test_frame_size_limit_closes_with_1009(gateway: Gateway) -> None:
    ws = await open_session(gateway)
    await ws.send("x" * (LIMITS["max_frame_bytes"] + 1))
    with pytest.raises(ConnectionClosed):
        async with asyncio.timeout(30):
            while True:
                await ws.recv()
    assert ws.close_code == 1009


async def test_buffered_audio_limit(gateway: Gateway) -> None:
    ws = await open_session(gateway)
    await manual_turns(ws)
    second = base64.b64encode(bytes(RATE * 2)).decode()
    for _ in range(2):
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": second}))
    await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": second}))
    error = await next_of(ws, "error")
    assert error["error"]["code"] == "input_audio_buffer_full"
    await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
    await next_of(ws, "input_audio_buffer.cleared")
    await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": second}))
    await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
    event = await next_of(ws, "input_audio_buffer.cleared", "error")
    assert event["type"] == "input_audio_buffer.cleared", "room again after a clear"
    await ws.close()


async def test_conversation_length_limit(gateway: Gateway) -> None:
    ws = await open_session(gateway)
    await manual_turns(ws)
    for i in range(LIMITS["max_items"] + 1):
        item = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": f"note {i}"}],
        }
        await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
        event = await next_of(ws, "conversation.item.added", "error")
        if i < LIMITS["max_items"]:
            assert event["type"] == "conversation.item.added"
        else:
            assert event["type"] == "error", "one item past the limit is refused"
    await ws.close()


async def test_max_sessions(gateway: Gateway) -> None:
    open_ = [await open_session(gateway) for _ in range(MAX_SESSIONS)]
    try:
        with pytest.raises(InvalidStatus) as caught:
            await connect(gateway.ws, additional_headers=AUTH)
        assert caught.value.response.status_code == 503
    finally:
        for ws in open_:
            await ws.close()

    def released() -> bool:
        return json.loads(get(gateway.http + "/healthz")[1])["sessions"] == 0

    await wait_until(released, 10, "the closed sessions to be released")
    ws = await open_session(gateway)
    await ws.close()


async def test_session_duration_limit(gateway: Gateway) -> None:
    ws = await open_session(gateway)
    started = time.monotonic()
    with pytest.raises(ConnectionClosed):
        async with asyncio.timeout(LIMITS["max_session_s"] + 20):
            while True:
                await ws.recv()
    assert ws.close_code == 1001
    assert time.monotonic() - started >= LIMITS["max_session_s"] - 1
