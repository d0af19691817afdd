"""The browser demo at /web, driven in Debian's headless Chromium against the real gateway.

Chromium's fake microphone plays a WAV: a spoken request for a long story, a pause
long enough for the answer to start playing, then a second spoken question that cuts
the answer off. The page must show both transcripts, play the answer, flush playback on
barge-in and send `conversation.item.truncate` with what it actually played.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr
import yaml
from playwright.sync_api import Page, sync_playwright

from tests.helpers import ROOT, running_gateway

pytestmark = pytest.mark.models

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = ROOT / "tests" / "artifacts"
FIRST = "Please tell me a long story about a brave little dragon."
SECOND = "Stop. What is the capital of France?"
RATE = 48000


def _espeak(text: str, path: Path) -> np.ndarray:
    subprocess.run(["espeak-ng", "-w", str(path), text], check=True)
    audio, rate = sf.read(path, dtype="float32")
    return soxr.resample(audio, rate, RATE)


def _silence(seconds: float) -> np.ndarray:
    return np.zeros(int(RATE * seconds), np.float32)


@pytest.fixture(scope="module")
def microphone_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("mic")
    audio = np.concatenate(
        [
            _silence(1.0),
            _espeak(FIRST, folder / "first.wav"),
            # The answer starts playing in here; the second question cuts in while
            # it plays (and, with the long answers of `web_url`'s profile, while it is
            # still being generated).
            _silence(7.0),
            _espeak(SECOND, folder / "second.wav"),
            _silence(60.0),
        ]
    )
    path = folder / "microphone.wav"
    sf.write(path, audio, RATE, subtype="PCM_16")
    return path


@pytest.fixture(scope="module")
def web_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # The default profile with room for a long story, so the answer is still being
    # generated when the second question interrupts it.
    profile = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    profile["stages"]["llm"]["sampling"]["max_tokens"] = 400
    path = tmp_path_factory.mktemp("profile") / "long-answers.yaml"
    path.write_text(yaml.safe_dump(profile))
    with running_gateway("--config", str(path)) as gateway:
        yield f"http://127.0.0.1:{gateway.port}/web/"


def _demo(page: Page) -> dict:
    return json.loads(page.evaluate("JSON.stringify(window.duplexDemo)"))


def _wait_for(page: Page, done, timeout: float) -> dict:
    """The page's demo state once `done(state)` holds, else the last one seen after
    `timeout` s; the callers assert on it, so a timeout fails with the state."""
    deadline = time.monotonic() + timeout
    state = _demo(page)
    while time.monotonic() < deadline and not done(state):
        time.sleep(0.25)
        state = _demo(page)
    return state


def _words(text: str) -> str:
    return " ".join(re.findall(r"[a-z']+", text.lower()))


def test_voice_conversation_with_barge_in(web_url: str, microphone_wav: Path) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox",
                "--use-fake-ui-for-media-stream",
                "--use-fake-device-for-media-stream",
                f"--use-file-for-fake-audio-capture={microphone_wav}%noloop",
                "--autoplay-policy=no-user-gesture-required",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        try:
            page = browser.new_page()
            page.on("console", lambda m: m.type == "error" and problems.append(m.text))
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.goto(web_url)
            page.click("#connect")

            state = _wait_for(page, lambda s: s["state"] == "connected", 30)
            assert state["state"] == "connected", state

            # The spoken request shows up as the user's transcript.
            state = _wait_for(page, lambda s: s["userTranscripts"], 120)
            assert "dragon" in _words(" ".join(state["userTranscripts"])), state

            # The answer is played, then the second question interrupts it.
            state = _wait_for(page, lambda s: s["truncatesSent"], 120)
            page.screenshot(path=str(ARTIFACTS / "web-demo-barge-in.png"))
            assert state["samplesPlayed"] > 0, state
            assert state["responses"][:1] == ["cancelled"], state
            truncate = state["truncatesSent"][0]
            assert truncate["content_index"] == 0
            assert 0 < truncate["audio_end_ms"] <= state["samplesReceived"] / 24, state
            assert page.locator(".bubble.assistant.interrupted").count() >= 1

            # The second question is heard and answered; nothing of the old answer plays.
            state = _wait_for(
                page,
                lambda s: len(s["userTranscripts"]) >= 2 and s["responses"][-1:] == ["completed"],
                180,
            )
            page.screenshot(path=str(ARTIFACTS / "web-demo.png"))
            assert "capital" in _words(" ".join(state["userTranscripts"])), state
            assert state["assistantTexts"] and state["assistantTexts"][-1].strip(), state
            assert state["staleChunks"] == 0, state
            assert state["latencyMs"], state
            assert not state["errors"], state["errors"]
        finally:
            browser.close()
    assert not problems, problems
