"""docs/deploy.md for real: Debian's nginx, run with deploy/nginx.conf (only its port
numbers changed), in front of two `duplex-gateway` instances started through the CLI.

Official `openai` SDK sessions go through nginx and are spread over both instances; each
stays whole on its instance (its later turns see its earlier items). SIGTERM drains one
instance: its idle session is closed at once, its busy one once its response is done,
both with code 1001 and the drain reason; new sessions go to the other instance, whose
sessions never notice; the drained process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
import signal
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from openai import AsyncOpenAI
from websockets.exceptions import ConnectionClosed

from gateway.server.server import DRAIN_REASON
from tests.helpers import ROOT, GatewayProcess, free_port, running_gateway, wait_until_blocking

pytestmark = pytest.mark.models

DEPLOY_MD = ROOT / "docs" / "deploy.md"
NGINX_CONF = ROOT / "deploy" / "nginx.conf"
# The directives in deploy/nginx.conf that name a port: nginx's own, the two instances'.
PORTED = ("listen 127.0.0.1:{};", "server 127.0.0.1:{} ", "server 127.0.0.1:{} ")
DOC_PORTS = (8080, 8765, 8766)


def nginx_conf(listen: int, upstreams: tuple[int, int]) -> str:
    """deploy/nginx.conf with free ports in place of the documented ones."""
    text = NGINX_CONF.read_text()
    for directive, documented, port in zip(PORTED, DOC_PORTS, (listen, *upstreams), strict=True):
        assert text.count(directive.format(documented)) == 1, directive.format(documented)
        text = text.replace(directive.format(documented), directive.format(port))
    return text


def documented(command: str) -> list[str]:
    """The first line of docs/deploy.md that runs `command`, split as the shell would."""
    lines = DEPLOY_MD.read_text().splitlines()
    return shlex.split(next(line for line in lines if line.startswith(command + " ")))


def nginx_command(prefix: Path, conf: Path) -> list[str]:
    """docs/deploy.md's nginx command, with this test's prefix and configuration file."""
    cmd = documented("/usr/sbin/nginx")
    places = {"/tmp/duplex-nginx": str(prefix), "$PWD/deploy/nginx.conf": str(conf)}
    assert set(places) <= set(cmd), cmd
    return [places.get(arg, arg) for arg in cmd]


@contextlib.contextmanager
def running_nginx(conf: str, prefix: Path) -> Iterator[int]:
    """nginx as docs/deploy.md runs it; yields its port."""
    prefix.mkdir()
    path = prefix / "nginx.conf"
    path.write_text(conf)
    port = int(conf.split("listen 127.0.0.1:")[1].split(";")[0])
    cmd = nginx_command(prefix, path)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:

        def listening() -> bool:
            assert proc.poll() is None, f"nginx exited: {proc.communicate()[0]}"
            return accepts(port)

        wait_until_blocking(listening, 30, "nginx to listen", interval=0.05)
        yield port
    finally:
        proc.send_signal(signal.SIGQUIT)  # nginx's graceful stop
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def accepts(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def health(gw: GatewayProcess) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{gw.port}/healthz", timeout=10) as r:
        payload: dict[str, Any] = json.loads(r.read())
        return payload


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default profile with room for a response to finish on a busy CI machine."""
    data = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    data["gateway"] = {**(data.get("gateway") or {}), "drain_timeout_s": 300}
    path = tmp_path_factory.mktemp("profile") / "deploy.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


class Session:
    """One SDK session through nginx, and the instance that took it."""

    def __init__(self, conn: Any, instance: GatewayProcess) -> None:
        self.conn = conn
        self.instance = instance
        self.first_item: str | None = None

    async def until(self, *kinds: str, timeout: float = 300) -> list[Any]:
        events = []
        async with asyncio.timeout(timeout):
            while True:
                events.append(await self.conn.recv())
                if events[-1].type in kinds:
                    return events

    async def text_turn(self, question: str) -> None:
        await self.conn.conversation.item.create(
            item={
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": question}],
            }
        )
        added = (await self.until("conversation.item.added"))[-1]
        self.first_item = self.first_item or added.item.id
        await self.conn.response.create(response={"max_output_tokens": 8})
        done = (await self.until("response.done"))[-1]
        assert done.response.status in ("completed", "incomplete"), done.response

    async def still_whole(self) -> None:
        """A second turn, then the first turn's item: the session's state is all here."""
        await self.text_turn("And what about Spain?")
        await self.conn.conversation.item.retrieve(item_id=self.first_item)
        retrieved = (await self.until("conversation.item.retrieved", "error"))[-1]
        assert retrieved.type == "conversation.item.retrieved", retrieved
        assert retrieved.item.content[0].text == "What is the capital of France?"

    async def closed_with(self) -> tuple[int, str, list[Any]]:
        """Read to the close: its code and reason, and the events before it."""
        events = []
        with pytest.raises(ConnectionClosed) as closed:
            async with asyncio.timeout(300):
                while True:
                    events.append(await self.conn.recv())
        assert closed.value.rcvd is not None
        return closed.value.rcvd.code, closed.value.rcvd.reason, events


async def open_session(
    stack: contextlib.AsyncExitStack, url: str, instances: list[GatewayProcess]
) -> Session:
    """A text session through nginx; the instance whose session count rose took it."""
    before = [health(gw)["sessions"] for gw in instances]
    client = AsyncOpenAI(api_key="sk-local", websocket_base_url=url)
    conn = await stack.enter_async_context(client.realtime.connect(model="gpt-realtime"))
    created = await conn.recv()
    assert created.type == "session.created" and created.session.model == "gpt-realtime"
    after = [health(gw)["sessions"] for gw in instances]
    (taker,) = [gw for gw, b, a in zip(instances, before, after, strict=True) if a == b + 1]
    session = Session(conn, taker)
    text = {
        "type": "realtime",
        "output_modalities": ["text"],
        "audio": {"input": {"turn_detection": None}},
    }
    await conn.session.update(session=text)
    await session.until("session.updated")
    return session


async def test_two_instances_behind_nginx_and_a_drain(profile: Path, tmp_path: Path) -> None:
    # The instances as docs/deploy.md starts them, on free ports, with the test's profile.
    for name, port in (("gw-a", 8765), ("gw-b", 8766)):
        assert f"duplex-gateway --port {port} --instance {name} &" in DEPLOY_MD.read_text()
    with contextlib.ExitStack() as processes:
        a = processes.enter_context(running_gateway("--config", str(profile), "--instance", "gw-a"))
        b = processes.enter_context(running_gateway("--config", str(profile), "--instance", "gw-b"))
        instances = [a, b]
        assert [health(gw)["instance"] for gw in instances] == ["gw-a", "gw-b"]
        conf = nginx_conf(free_port(), (a.port, b.port))
        port = processes.enter_context(running_nginx(conf, tmp_path / "nginx"))
        url = f"ws://127.0.0.1:{port}/v1"
        async with contextlib.AsyncExitStack() as stack:
            sessions = [await open_session(stack, url, instances) for _ in range(4)]
            assert sorted(health(gw)["sessions"] for gw in instances) == [2, 2]
            await asyncio.gather(*(s.text_turn("What is the capital of France?") for s in sessions))
            await asyncio.gather(*(s.still_whole() for s in sessions))

            drained = sessions[0].instance
            other = b if drained is a else a
            busy, idle = [s for s in sessions if s.instance is drained]
            staying = [s for s in sessions if s.instance is other]
            # A spoken answer is running on `busy` when the drain begins.
            await busy.conn.session.update(
                session={"type": "realtime", "output_modalities": ["audio"]}
            )
            await busy.until("session.updated")
            await busy.conn.response.create(response={"max_output_tokens": 24})
            await busy.until("response.output_audio.delta")
            drained.proc.send_signal(signal.SIGTERM)

            assert await idle.closed_with() == (1001, DRAIN_REASON, [])
            # Draining: new sessions through nginx are all taken by the other instance.
            newcomers = [await open_session(stack, url, [other]) for _ in range(2)]
            assert health(other)["sessions"] == 4
            code, reason, events = await busy.closed_with()
            assert (code, reason) == (1001, DRAIN_REASON)
            # As the service orders them: the response ends, then its rate limits.
            types = [e.type for e in events]
            assert types[-2:] == ["response.done", "rate_limits.updated"], types
            assert events[-2].response.status in ("completed", "incomplete")
            assert drained.proc.wait(120) == 0, "".join(drained.lines[-30:])

            await asyncio.gather(
                *(s.text_turn("What is the capital of France?") for s in newcomers)
            )
            await asyncio.gather(*(s.still_whole() for s in [*staying, *newcomers]))
