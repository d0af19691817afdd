"""OpenAI's documented browser code for WebRTC, unchanged but for the base URL, run in
Debian's headless Chromium against `duplex-gateway` started through its CLI.

A test backend (the app's own server, as in OpenAI's guide) serves the page and mints
an ephemeral key with the real one (`POST /v1/realtime/client_secrets`); the page gets
it from `/token`, opens an `RTCPeerConnection` with the fake microphone's track and an
`oai-events` data channel, and posts its SDP offer to the gateway's
`/v1/realtime/calls` from its own origin (CORS). The microphone asks for a long story,
waits while the answer plays, then cuts in with a second question.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf
import yaml
from playwright.sync_api import sync_playwright

from tests.helpers import ROOT, espeak, running_gateway, wait_until_blocking

pytestmark = pytest.mark.models

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
KEY = "sk-browser-test"
RATE = 48000
FIRST = "Please tell me a long story about a brave little dragon."
SECOND = "Stop. What is the capital of France?"

# OpenAI's WebRTC guide, in its own words but for the base URL and the record it keeps
# for the test (`window.oai`).
PAGE = """<!doctype html>
<html><body><script type="module">
window.oai = {events: [], state: "starting", error: null};
async function init() {
  const tokenResponse = await fetch("/token");
  const data = await tokenResponse.json();
  const EPHEMERAL_KEY = data.value;

  const pc = new RTCPeerConnection();
  const audioElement = document.createElement("audio");
  audioElement.autoplay = true;
  pc.ontrack = (e) => (audioElement.srcObject = e.streams[0]);
  const ms = await navigator.mediaDevices.getUserMedia({audio: true});
  pc.addTrack(ms.getTracks()[0]);

  const dc = pc.createDataChannel("oai-events");
  dc.addEventListener("message", (e) => window.oai.events.push(JSON.parse(e.data)));

  const offer = await pc.createOffer();
  await pc.setLocalDescription(offer);
  const baseUrl = "GATEWAY/v1/realtime/calls";
  const model = "gpt-realtime";
  const sdpResponse = await fetch(`${baseUrl}?model=${model}`, {
    method: "POST",
    body: offer.sdp,
    headers: {
      Authorization: `Bearer ${EPHEMERAL_KEY}`,
      "Content-Type": "application/sdp",
    },
  });
  window.oai.location = sdpResponse.headers.get("Location");
  const answer = {type: "answer", sdp: await sdpResponse.text()};
  await pc.setRemoteDescription(answer);
  window.oai.state = "connected";
  window.oai.pc = pc;
}
window.audioReceived = async () => {
  const stats = await window.oai.pc.getStats();
  let energy = 0;
  stats.forEach((s) => {
    if (s.type === "inbound-rtp" && s.kind === "audio") energy = s.totalAudioEnergy || 0;
  });
  return energy;
};
init().catch((e) => { window.oai.error = String(e); });
</script></body></html>
"""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # Room for a long story, so that the second question cuts in while it plays.
    profile = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    profile["stages"]["llm"]["sampling"]["max_tokens"] = 400
    path = tmp_path_factory.mktemp("profile") / "long-answers.yaml"
    path.write_text(yaml.safe_dump(profile))
    with running_gateway("--config", str(path), "--api-key", KEY) as gw:
        yield f"http://127.0.0.1:{gw.port}"


@pytest.fixture(scope="module")
def backend(gateway: str) -> Iterator[str]:
    """The app's server: the page, and `/token` minting an ephemeral key."""
    session = {
        "type": "realtime",
        "audio": {"input": {"transcription": {"model": "whisper-1"}}},
    }

    class App(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/token":
                minted = httpx.post(
                    f"{gateway}/v1/realtime/client_secrets",
                    json={"session": session},
                    headers={"Authorization": f"Bearer {KEY}"},
                )
                self._answer(minted.status_code, minted.content, "application/json")
            else:
                page = PAGE.replace("GATEWAY", gateway).encode()
                self._answer(200, page, "text/html")

        def _answer(self, status: int, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), App)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def microphone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    silence = lambda s: np.zeros(int(RATE * s), np.float32)  # noqa: E731
    audio = np.concatenate(
        [silence(1.0), espeak(FIRST, RATE), silence(7.0), espeak(SECOND, RATE), silence(60)]
    )
    path = tmp_path_factory.mktemp("mic") / "microphone.wav"
    sf.write(path, audio, RATE, subtype="PCM_16")
    return path


def words(text: str) -> str:
    return " ".join(re.findall(r"[a-z']+", text.lower()))


def test_openai_browser_code_talks_to_the_gateway(backend: str, microphone: Path) -> None:
    problems: list[str] = []
    args = [
        "--no-sandbox",
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={microphone}%noloop",
        "--autoplay-policy=no-user-gesture-required",
        "--disable-background-networking",
        "--no-first-run",
    ]
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
        try:
            page = browser.new_page()
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.goto(backend)

            def events() -> list[dict[str, Any]]:
                return list(json.loads(page.evaluate("JSON.stringify(window.oai.events)")))

            def seen(kind: str) -> list[dict[str, Any]]:
                return [e for e in events() if e["type"] == kind]

            def state() -> str:
                oai = json.loads(page.evaluate("JSON.stringify(window.oai)"))
                kinds = [e["type"] for e in oai["events"]][-12:]
                return f"state {oai['state']}, error {oai['error']}, events {kinds}"

            wait_until_blocking(lambda: bool(seen("session.created")), 30, state)
            assert page.evaluate("window.oai.location").startswith("/v1/realtime/calls/rtc_")

            # The spoken request, transcribed.
            wait_until_blocking(
                lambda: bool(seen("conversation.item.input_audio_transcription.completed")),
                120,
                state,
            )
            first = seen("conversation.item.input_audio_transcription.completed")[0]
            assert "dragon" in words(first["transcript"]), first

            # The spoken answer reaches the browser's track.
            wait_until_blocking(lambda: bool(seen("output_audio_buffer.started")), 120, state)
            wait_until_blocking(lambda: page.evaluate("window.audioReceived()") > 0, 30, state)

            # The second question cuts the answer off where the track had got to.
            wait_until_blocking(lambda: bool(seen("output_audio_buffer.cleared")), 120, state)
            answer_id = seen("output_audio_buffer.started")[0]["response_id"]
            assert seen("output_audio_buffer.cleared")[0]["response_id"] == answer_id
            truncated = seen("conversation.item.truncated")
            assert truncated and truncated[0]["audio_end_ms"] > 0, truncated
            wait_until_blocking(
                lambda: any(e["response"]["id"] == answer_id for e in seen("response.done")),
                60,
                state,
            )
            done = [e for e in seen("response.done") if e["response"]["id"] == answer_id]
            # Still being generated when it was cut (cancelled), or played to the cut.
            assert done[0]["response"]["status"] in ("cancelled", "completed"), done

            # The second question is heard and answered.
            wait_until_blocking(
                lambda: len(seen("conversation.item.input_audio_transcription.completed")) >= 2,
                120,
                state,
            )
            second = seen("conversation.item.input_audio_transcription.completed")[1]
            assert "capital" in words(second["transcript"]), second
            assert not seen("error"), seen("error")
        finally:
            browser.close()
    assert not problems, problems
