"""`PlaybackLedger`: the text the client heard, from the audio chunks it was sent."""

from __future__ import annotations

import pytest

from duplex.playback import PlaybackLedger


def test_an_empty_ledger_heard_nothing() -> None:
    ledger = PlaybackLedger()
    assert (ledger.duration_ms, ledger.text) == (0.0, "")
    assert ledger.heard_text(0) == "" and ledger.heard_text(1000) == ""


def test_whole_chunks_are_heard_by_their_end() -> None:
    ledger = PlaybackLedger()
    ledger.add(500, "Hello there. ")
    ledger.add(1000, "How are you today? ")
    assert ledger.duration_ms == pytest.approx(1500)
    assert ledger.heard_text(500) == "Hello there. "
    assert ledger.heard_text(1100) == "Hello there. How are you"
    assert ledger.heard_text(5000) == "Hello there. How are you today? "
    assert ledger.heard_text(0) == ""


def test_a_partly_played_chunk_is_cut_at_a_word_boundary() -> None:
    ledger = PlaybackLedger()
    ledger.add(100, "abc def")
    ledger.add(0, "")
    ledger.add(100, "ghi")
    assert ledger.duration_ms == 200 and ledger.text == "abc defghi"
    assert ledger.heard_text(50) == "abc"
    assert ledger.heard_text(60) == "abc "  # cut inside "def" keeps the words before it
    assert ledger.heard_text(90) == "abc "
    assert ledger.heard_text(20) == ""
    assert ledger.heard_text(100) == "abc def"
    assert ledger.heard_text(199) == "abc def"
    assert ledger.heard_text(200) == "abc defghi"


def test_negative_times_are_refused() -> None:
    ledger = PlaybackLedger()
    with pytest.raises(ValueError, match="audio_end_ms"):
        ledger.heard_text(-1)
    with pytest.raises(ValueError, match="duration"):
        ledger.add(-5, "x")
