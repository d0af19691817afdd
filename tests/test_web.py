"""The browser demo at /web, driven in Debian's headless Chromium against the real gateway.

Chromium's fake microphone plays a WAV: a spoken request for a long story, a pause
long enough for the answer to start playing, then a second spoken question that cuts
the answer off. The page must show both transcripts, play the answer, flush playback on
barge-in and send `conversation.item.truncate` with what it actually played over a
WebSocket. Over WebRTC (the demo's default) the gateway plays the answer on the call's
track and truncates it itself.

Captions only (a transcription session): the microphone plays recorded speech, and the
page shows the user's words as live captions, then the completed transcripts, and
nothing answers. Captions before `speech_stopped` need the engine's live transcription.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import yaml
from playwright.sync_api import Page, sync_playwright

from tests.helpers import ROOT, espeak, read_audio, running_gateway, wait_until_blocking

pytestmark = pytest.mark.models

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = ROOT / "tests" / "artifacts"
FIRST = "Please tell me a long story about a brave little dragon."
SECOND = "Stop. What is the capital of France?"
CAPTIONED = "The children played in the park until the sun went down."
RATE = 48000


def _silence(seconds: float) -> np.ndarray:
    return np.zeros(int(RATE * seconds), np.float32)


def _recording(name: str) -> np.ndarray:
    """An alsa-utils recording of a voice ("Front left"...), at the microphone's rate."""
    return read_audio(f"/usr/share/sounds/alsa/{name}.wav", RATE)


@pytest.fixture(scope="module")
def microphone_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("mic")
    audio = np.concatenate(
        [
            _silence(1.0),
            espeak(FIRST, RATE),
            # The answer starts playing in here; the second question cuts in while
            # it plays (and, with the long answers of `web_url`'s profile, while it is
            # still being generated).
            _silence(7.0),
            espeak(SECOND, RATE),
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


@pytest.fixture(scope="module")
def captions_microphone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Recorded speech: four short phrases run together (short pauses within one
    utterance), a pause that ends it, then an eSpeak NG sentence."""
    folder = tmp_path_factory.mktemp("captions")
    phrases = ("Front_Center", "Front_Left", "Front_Right", "Side_Left")
    first = np.concatenate([np.concatenate([_recording(p), _silence(0.15)]) for p in phrases])
    audio = np.concatenate(
        [_silence(1.0), first, _silence(2.5), espeak(CAPTIONED, RATE), _silence(60)]
    )
    path = folder / "microphone.wav"
    sf.write(path, audio, RATE, subtype="PCM_16")
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


def _words(text: str) -> str:
    return " ".join(re.findall(r"[a-z']+", text.lower()))


def _chromium_args(microphone: Path) -> list[str]:
    return [
        "--no-sandbox",
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={microphone}%noloop",
        "--autoplay-policy=no-user-gesture-required",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
    ]


def test_voice_conversation_with_barge_in(web_url: str, microphone_wav: Path) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=_chromium_args(microphone_wav)
        )
        try:
            page = browser.new_page()
            page.on("console", lambda m: m.type == "error" and problems.append(m.text))
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.goto(web_url)
            page.select_option("#transport", "websocket")
            page.click("#connect")

            state = _wait_for(page, lambda s: s["state"] == "connected", 30)
            assert state["transport"] == "websocket", state

            # The spoken request shows up as the user's transcript.
            state = _wait_for(page, lambda s: s["userTranscripts"], 120)
            assert "dragon" in _words(" ".join(state["userTranscripts"])), state

            # The answer is played, then the second question interrupts it: the page
            # truncates on speech_started and records the cancelled response.done that
            # comes next, each as its message is handled.
            state = _wait_for(page, lambda s: s["truncatesSent"] and s["responses"], 120)
            page.screenshot(path=str(ARTIFACTS / "web-demo-barge-in.png"))
            assert state["samplesPlayed"] > 0, state
            assert state["responses"][:1] == ["cancelled"], state
            truncate = state["truncatesSent"][0]
            assert truncate["content_index"] == 0
            assert 0 < truncate["audio_end_ms"] <= state["samplesReceived"] / 24, state
            assert page.locator(".bubble.assistant.interrupted").count() >= 1

            # The second question is heard and answered; nothing of the old answer plays.
            # An answer cut at max_output_tokens ("incomplete") is answered too: what the
            # small model says, and so how long, varies from run to run.
            state = _wait_for(
                page,
                lambda s: (
                    len(s["userTranscripts"]) >= 2
                    and len(s["responses"]) >= 2
                    and s["responses"][-1] in ("completed", "incomplete")
                ),
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


def test_the_demo_talks_over_webrtc(web_url: str, microphone_wav: Path) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=_chromium_args(microphone_wav)
        )
        try:
            page = browser.new_page()
            page.on("console", lambda m: m.type == "error" and problems.append(m.text))
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.goto(web_url)
            assert page.locator("#transport").input_value() == "webrtc"  # the default
            page.click("#connect")
            state = _wait_for(page, lambda s: s["state"] == "connected", 30)
            assert state["transport"] == "webrtc", state

            state = _wait_for(page, lambda s: s["userTranscripts"], 120)
            assert "dragon" in _words(" ".join(state["userTranscripts"])), state

            # The answer plays on the call's track; the second question cuts it, and
            # the gateway truncates it where the track had got to, then says the track
            # was cleared (two messages on the data channel: both are waited for).
            state = _wait_for(
                page,
                lambda s: s["truncated"] and s["eventCounts"].get("output_audio_buffer.cleared"),
                120,
            )
            assert state["eventCounts"].get("output_audio_buffer.started", 0) >= 1, state
            assert state["truncated"][0]["audio_end_ms"] > 0, state
            assert page.locator(".bubble.assistant.interrupted").count() >= 1
            assert not state["truncatesSent"], state  # the page sends none over WebRTC
            assert "response.output_audio.delta" not in state["eventCounts"], state

            state = _wait_for(
                page,
                lambda s: len(s["userTranscripts"]) >= 2 and s["responses"][-1:] == ["completed"],
                180,
            )
            page.screenshot(path=str(ARTIFACTS / "web-demo-webrtc.png"))
            assert "capital" in _words(" ".join(state["userTranscripts"])), state
            assert state["latencyMs"], state
            assert not state["errors"], state["errors"]
        finally:
            browser.close()
    assert not problems, problems


@pytest.fixture(scope="module")
def captioned(web_url: str, captions_microphone: Path) -> dict:
    """The demo in captions-only mode once both utterances are transcribed: its state,
    the user bubbles' text and class, and the page's problems."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=_chromium_args(captions_microphone)
        )
        try:
            page = browser.new_page()
            page.on("console", lambda m: m.type == "error" and problems.append(m.text))
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.goto(web_url)
            page.check("#captionsOnly")
            page.click("#connect")
            # Waits on the page's own state (Playwright re-checks it as the page runs).
            page.wait_for_function("window.duplexDemo.userTranscripts.length >= 2", timeout=180_000)
            page.screenshot(path=str(ARTIFACTS / "web-demo-captions.png"))
            bubbles = page.locator(".bubble.user")
            return {
                "state": _demo(page),
                "bubbles": [bubbles.nth(i).inner_text() for i in range(bubbles.count())],
                "live": page.locator(".bubble.user.live").count(),
                "assistant": page.locator(".bubble.assistant").count(),
                "problems": problems,
            }
        finally:
            browser.close()


def test_captions_only_shows_the_completed_transcripts(captioned: dict) -> None:
    state = captioned["state"]
    assert state["sessionType"] == "transcription", state
    first, second = state["userTranscripts"][:2]
    assert {"front", "center", "left", "right"} <= set(_words(first).split()), state
    assert {"children", "park", "sun"} <= set(_words(second).split()), state
    # The captions end as the completed transcripts, and nothing answered.
    assert [b.split("\n", 1)[-1] for b in captioned["bubbles"]] == state["userTranscripts"]
    assert captioned["live"] == 0 and captioned["assistant"] == 0
    assert state["responses"] == [] and "response.created" not in state["eventCounts"]
    assert not state["errors"], state["errors"]
    assert not captioned["problems"], captioned["problems"]


def test_captions_appear_before_speech_stopped(captioned: dict) -> None:
    """The words show while the user speaks: the sentence had a caption when its
    `speech_stopped` came, and every early caption was the start of its completed
    transcript. The first utterance's one-second phrases may end before two guesses
    agree on a word (how many guesses fit depends on the machine's load), so only
    the sentence must show early."""
    state = captioned["state"]
    early = state["captionsAtSpeechStopped"][:2]
    assert len(early) == 2 and early[1], state
    for caption, final in zip(early, state["userTranscripts"], strict=True):
        assert _words(final).startswith(_words(caption)), (caption, final)
