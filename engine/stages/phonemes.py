"""Text to IPA phonemes with eSpeak NG, and IPA to a Piper voice's phoneme ids.

eSpeak NG comes from the `espeakng-loader` wheel (library and data, no system package)
and is driven through ctypes. eSpeak reads numbers, abbreviations and symbols the way
it always does; it returns one clause per call and drops the clause punctuation, which
Piper voices were trained with, so the punctuation is recovered from the consumed text.
"""

from __future__ import annotations

import ctypes
import re
import threading
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Phonemizer", "PhonemeError", "phoneme_ids", "get_phonemizer"]

_AUDIO_OUTPUT_SYNCHRONOUS = 0x02
_CHARS_UTF8 = 1
_PHONEMES_IPA = 0x02
_CLAUSE_PUNCTUATION = ".,;:!?"
# eSpeak marks a switch to another language's rules inline, e.g. "(fr)"; voices never saw it.
_LANGUAGE_SWITCH = re.compile(r"\([a-z]{2,3}(?:-[a-z0-9]+)*\)")

# Piper's id sequence: BOS, PAD, then each phoneme followed by PAD, then EOS.
BOS, EOS, PAD = "^", "$", "_"


class PhonemeError(ValueError):
    """Text that cannot be turned into phonemes (raised with a readable reason)."""


@dataclass(frozen=True)
class Clause:
    """One eSpeak clause: its IPA (punctuation restored) and the text it came from."""

    phonemes: str
    text: str


class Phonemizer:
    """eSpeak NG for one voice (e.g. `en-us`). eSpeak has global state, so calls lock."""

    _lock = threading.Lock()
    _lib: ctypes.CDLL | None = None
    _current_voice: str | None = None

    def __init__(self, voice: str = "en-us") -> None:
        self.voice = voice
        self._ensure_library()
        with self._lock:
            self._select_voice()

    @classmethod
    def _ensure_library(cls) -> None:
        if cls._lib is not None:
            return
        import espeakng_loader

        lib = ctypes.CDLL(espeakng_loader.get_library_path())
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_Initialize.restype = ctypes.c_int
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetVoiceByName.restype = ctypes.c_int
        lib.espeak_TextToPhonemes.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_int,
            ctypes.c_int,
        ]
        lib.espeak_TextToPhonemes.restype = ctypes.c_char_p
        data = espeakng_loader.get_data_path().encode()
        if lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, data, 0) <= 0:
            raise RuntimeError(f"eSpeak NG failed to initialise with data at {data.decode()}")
        cls._lib = lib

    def _select_voice(self) -> None:
        if Phonemizer._current_voice == self.voice:
            return
        assert self._lib is not None
        if self._lib.espeak_SetVoiceByName(self.voice.encode()) != 0:
            raise PhonemeError(f"eSpeak NG has no voice named {self.voice!r}")
        Phonemizer._current_voice = self.voice

    def clauses(self, text: str) -> list[Clause]:
        """IPA per eSpeak clause, each ending in its punctuation when it had any."""
        raw = text.encode("utf-8")
        buf = ctypes.create_string_buffer(raw + b"\0")
        start = ctypes.addressof(buf)
        ptr = ctypes.c_void_p(start)
        out: list[Clause] = []
        carry = ""
        with self._lock:
            self._select_voice()
            assert self._lib is not None
            while ptr.value is not None:
                before = ptr.value
                ipa = self._lib.espeak_TextToPhonemes(ctypes.byref(ptr), _CHARS_UTF8, _PHONEMES_IPA)
                end = ptr.value if ptr.value is not None else start + len(raw)
                source = carry + raw[before - start : end - start].decode("utf-8", "replace")
                carry = ""
                if ptr.value is not None:
                    # eSpeak has read one character of the next clause ahead.
                    source, carry = source[:-1], source[-1:]
                ipa_text = (ipa or b"").decode("utf-8", "replace")
                phonemes = _LANGUAGE_SWITCH.sub("", ipa_text).strip()
                punct = _trailing_punctuation(source)
                if phonemes or punct:
                    out.append(Clause(phonemes + punct, source.strip()))
        return out

    def phonemize(self, text: str) -> str:
        """IPA for the whole text, clauses joined by spaces, punctuation kept."""
        return " ".join(c.phonemes for c in self.clauses(text) if c.phonemes)


def _trailing_punctuation(source: str) -> str:
    for ch in reversed(source.rstrip()):
        if ch in _CLAUSE_PUNCTUATION:
            return ch
        if not (ch in "\"')]}»”’" or ch.isspace()):
            return ""
    return ""


def phoneme_ids(phonemes: str, id_map: Mapping[str, Sequence[int]]) -> list[int]:
    """Piper ids: `^`, `_`, then every known phoneme's ids each followed by `_`, then `$`.

    A symbol missing from the map is tried in its NFD-decomposed form (a letter with a
    combining mark); what the voice still does not know is skipped.
    """
    pad = list(id_map[PAD])
    ids = list(id_map[BOS]) + pad
    for ch in phonemes:
        for part in [ch] if ch in id_map else unicodedata.normalize("NFD", ch):
            if part in id_map:
                ids.extend(id_map[part])
                ids.extend(pad)
    ids.extend(id_map[EOS])
    return ids


_phonemizers: dict[str, Phonemizer] = {}


def get_phonemizer(voice: str = "en-us") -> Phonemizer:
    if voice not in _phonemizers:
        _phonemizers[voice] = Phonemizer(voice)
    return _phonemizers[voice]
