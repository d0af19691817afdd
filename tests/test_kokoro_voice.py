"""Kokoro's voices behind the TTS stage (`engine.stages.kokoro_voice`): the OpenAI voice
table, the phoneme rewrites, the ids, and what a request may ask of a voice. The model
itself is tested against onnxruntime in tests/test_kokoro.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from engine.stages.kokoro_voice import DEFAULT_VOICE, OPENAI_VOICES, KokoroVoice, kokoro_phonemes
from engine.stages.tts import TtsRequest
from gateway.config import OPENAI_VOICES as OPENAI_NAMES

VOCAB = {ch: i + 1 for i, ch in enumerate("həlˈoʊ ðɛɹ,?.jkdnaɪti")}
# kokoro-js 1.2.1's English voices, and two others.
AMERICAN_F = "alloy aoede bella heart jessica kore nicole nova river sarah sky"
AMERICAN_M = "adam echo eric fenrir liam michael onyx puck santa"
KOKORO_JS_VOICES = [
    *(f"af_{n}" for n in AMERICAN_F.split()),
    *(f"am_{n}" for n in AMERICAN_M.split()),
    *(f"bf_{n}" for n in ["alice", "emma", "isabella", "lily"]),
    *(f"bm_{n}" for n in ["daniel", "fable", "george", "lewis"]),
    "ef_dora",
    "jf_alpha",
]


def voice(**kwargs: Any) -> KokoroVoice:
    styles = {name: np.zeros((510, 256), np.float32) for name in KOKORO_JS_VOICES}
    config = {"vocab": VOCAB, "sample_rate": 24000}
    return KokoroVoice(model=None, config=config, voices=styles, **kwargs)  # type: ignore[arg-type]


def test_every_openai_voice_has_a_kokoro_voice_of_its_own() -> None:
    assert set(OPENAI_VOICES) == set(OPENAI_NAMES)
    assert len(set(OPENAI_VOICES.values())) == len(OPENAI_VOICES)  # all distinct
    assert set(OPENAI_VOICES.values()) <= set(KOKORO_JS_VOICES)
    assert voice(default=DEFAULT_VOICE).openai_voices == OPENAI_VOICES


def test_the_english_voices_are_offered_the_default_first() -> None:
    v = voice(default="bm_george")
    assert v.names[0] == "bm_george"
    assert len(v.names) == len(KOKORO_JS_VOICES) - 2  # not the Spanish or Japanese ones
    assert "ef_dora" not in v.names and "af_heart" in v.names
    with pytest.raises(ValueError, match="no voice 'joe'"):
        voice(default="joe")


def test_a_request_picks_its_voice_and_speed() -> None:
    v = voice(default=DEFAULT_VOICE)
    assert v.scales(TtsRequest()).voice == DEFAULT_VOICE
    chosen = v.scales(TtsRequest(voice="am_echo", speed=1.5))
    assert (chosen.voice, chosen.speed) == ("am_echo", 1.5)
    with pytest.raises(ValueError, match="no voice 'nobody'"):
        v.scales(TtsRequest(voice="nobody"))
    with pytest.raises(ValueError, match="not Piper's"):
        v.scales(TtsRequest(noise_scale=0.3))


def test_espeak_ipa_is_rewritten_into_kokoros_symbols() -> None:
    assert kokoro_phonemes("ɡɹˈiːn rˈɛd") == "ɡɹˈiːn ɹˈɛd"
    assert kokoro_phonemes("lɔx ʲ ɬ") == "lɔk j l"
    assert kokoro_phonemes("wˈʌnhˈʌndɹɪd") == "wˈʌn hˈʌndɹɪd"
    assert kokoro_phonemes("nˈaɪnti") == "nˈaɪndi"
    assert kokoro_phonemes("ðə kˈæts z.") == "ðə kˈætsz."


def test_ids_are_one_per_known_symbol_between_pads() -> None:
    ids = voice(default=DEFAULT_VOICE).ids("həlˈoʊ, ðɛɹ? ✓")
    assert ids[0] == ids[-1] == 0
    assert ids[1:-1] == [VOCAB[ch] for ch in "həlˈoʊ, ðɛɹ? "]


@pytest.mark.models
def test_the_openai_names_speak_distinct_intelligible_kokoro_voices() -> None:
    import engine

    engine.setup()
    import soxr

    from engine.stages.asr import load_transcriber
    from engine.stages.tts import load_voice
    from engine.weights import registry

    voices = load_voice("kokoro-82m")
    assert isinstance(voices, KokoroVoice)
    assert voices.openai_voices == OPENAI_VOICES  # every target is a converted voice
    listener = load_transcriber(registry.prepare("whisper-base", progress=False))
    text = "The train leaves from the north station."
    spoken = {}
    for name in ("alloy", "echo", "ballad"):
        request = TtsRequest(voice=OPENAI_VOICES[name])
        (audio,) = voices.synthesize([text], [voices.scales(request)])
        heard = listener.transcribe(soxr.resample(audio, 24000, 16000).astype(np.float32))
        # At most one word misheard ("lives" for "leaves" once in a few takes).
        said, got = text.lower().strip(" .").split(), heard.lower().strip(" .").split()
        assert len(got) == len(said) and sum(a != b for a, b in zip(said, got, strict=True)) <= 1, (
            heard
        )
        spoken[name] = np.log(np.abs(np.fft.rfft(audio[:24000], 4096)) + 1e-6)
    # Different speakers: their spectra differ far more than one voice's takes do (by
    # hand: one voice's two takes 0.98, alloy, echo and ballad 0.58 to 0.71).
    for a, b in (("alloy", "echo"), ("alloy", "ballad"), ("echo", "ballad")):
        assert np.corrcoef(spoken[a], spoken[b])[0, 1] < 0.95, (a, b)
