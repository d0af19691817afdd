"""Streaming detokenization: UTF-8-safe deltas and stop strings that span tokens."""

from __future__ import annotations

from engine.llm.detokenizer import StreamingDetokenizer


def byte_decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def _stream(text: str, stop: list[str] | None = None) -> tuple[list[str], StreamingDetokenizer]:
    detok = StreamingDetokenizer(byte_decode, stop or [])
    deltas = []
    for b in text.encode():
        deltas.append(detok.push([b]))
        if detok.stopped:
            break
    if not detok.stopped:
        deltas.append(detok.finish())
    return deltas, detok


def test_multibyte_characters_are_never_split() -> None:
    text = "héllo wörld – 日本語 🎉!"
    deltas, detok = _stream(text)
    assert "".join(deltas) == text == detok.text
    assert all("\ufffd" not in d for d in deltas)
    # The 4-byte emoji arrives as one delta after its last byte, nothing before.
    assert "🎉" in deltas


def test_stop_string_across_tokens_is_cut_and_never_emitted() -> None:
    deltas, detok = _stream("Hello END of text", stop=["END"])
    assert detok.stopped
    assert "".join(deltas) == "Hello " == detok.text
    assert not any("E" in d for d in deltas)


def test_partial_stop_prefix_is_released_at_finish() -> None:
    deltas, detok = _stream("almost EN", stop=["END"])
    assert not detok.stopped
    assert "".join(deltas) == "almost EN"


def test_earliest_of_several_stop_strings_wins() -> None:
    _, detok = _stream("abc STOP xyz HALT", stop=["HALT", "xyz", "STOP"])
    assert detok.text == "abc "


def test_stop_string_with_multibyte_characters() -> None:
    deltas, detok = _stream("naïve café ☕ done", stop=["☕"])
    assert detok.text == "naïve café " == "".join(deltas)


def test_word_joining_with_context_window() -> None:
    # A decoder that, like SentencePiece, drops a leading space on the first token.
    vocab = {1: "▁Hello", 2: "▁world", 3: "!"}

    def sp_decode(ids: list[int]) -> str:
        return "".join(vocab[i] for i in ids).replace("▁", " ").lstrip(" ")

    detok = StreamingDetokenizer(sp_decode)
    assert detok.push([1]) == "Hello"
    assert detok.push([2]) == " world"
    assert detok.push([3]) == "!"


def test_push_after_stop_returns_nothing() -> None:
    _, detok = _stream("a.b", stop=["."])
    assert detok.push([ord("c")]) == "" and detok.finish() == "" and detok.text == "a"
