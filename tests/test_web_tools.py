"""The browser demo's built-in tool, in Debian's headless Chromium against the real
gateway: a typed question, a call the page answers itself (the local time), the call and
its result shown, and a spoken answer after it, over the demo's default transport
(WebRTC)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import yaml
from playwright.sync_api import Page, sync_playwright

from tests.helpers import ROOT, running_gateway, wait_until_blocking

pytestmark = pytest.mark.models

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def web_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    profile = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    profile["stages"]["llm"]["sampling"]["temperature"] = 0.0
    path = tmp_path_factory.mktemp("profile") / "greedy.yaml"
    path.write_text(yaml.safe_dump(profile))
    with running_gateway("--config", str(path)) as gateway:
        yield f"http://127.0.0.1:{gateway.port}/web/"


@pytest.fixture(scope="module")
def silent_microphone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mic") / "silence.wav"
    sf.write(path, np.zeros(48000 * 60, np.float32), 48000, subtype="PCM_16")
    return path


def _demo(page: Page) -> dict:
    return json.loads(page.evaluate("JSON.stringify(window.duplexDemo)"))


def _wait_for(page: Page, done, timeout: float) -> dict:
    """The page's demo state once `done(state)` holds; a timeout fails with the last one."""
    state: dict = {}

    def holds() -> bool:
        state.clear()
        state.update(_demo(page))
        return bool(done(state))

    wait_until_blocking(holds, timeout, lambda: f"the demo's state; last: {state}", interval=0.25)
    return state


def test_the_page_answers_its_local_time_tool(web_url: str, silent_microphone: Path) -> None:
    problems: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox",
                "--use-fake-ui-for-media-stream",
                "--use-fake-device-for-media-stream",
                f"--use-file-for-fake-audio-capture={silent_microphone}%noloop",
                "--autoplay-policy=no-user-gesture-required",
            ],
        )
        try:
            page = browser.new_page()
            page.on("console", lambda m: m.type == "error" and problems.append(m.text))
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.goto(web_url)
            page.click("#connect")
            state = _wait_for(page, lambda s: s["eventCounts"].get("session.updated"), 30)
            assert state["state"] == "connected", state
            page.select_option("#turnDetection", "none")
            page.select_option("#tools", "required")
            page.click("#settings button[type=submit]")
            state = _wait_for(page, lambda s: s["eventCounts"]["session.updated"] == 2, 30)
            assert state["eventCounts"]["session.updated"] == 2, state
            assert page.locator("#tools").input_value() == "required"
            page.fill("#text", "What time is it?")
            page.press("#text", "Enter")
            state = _wait_for(page, lambda s: s["responses"] == ["completed", "completed"], 180)
            assert state["responses"] == ["completed", "completed"], state
            (call,) = state["toolCalls"]
            assert call["name"] == "get_local_time" and json.loads(call["arguments"]) == {}
            assert "time" in json.loads(call["output"])
            shown = page.locator(".bubble.tool .text").inner_text()
            assert shown.startswith("get_local_time(") and call["output"] in shown
            # The call was not spoken; the answer after it was.
            assert state["assistantTexts"] and state["assistantTexts"][-1].strip(), state
            # Over the demo's default transport, WebRTC, it plays on the call's track.
            assert state["transport"] == "webrtc", state
            assert state["eventCounts"].get("output_audio_buffer.started", 0) >= 1, state
            assert not state["errors"], state
        finally:
            browser.close()
    assert not problems, problems
