"""What the words of a turn say about it: does it stop mid-sentence, is it only a
backchannel. English only, like the transcription the gateway offers.

Whisper transcribes the first few hundred milliseconds of speech loosely ("and then",
"M.S." for "mm hmm", "Earth." for "uh huh"), so a word counts as meaning to take the turn
only if it has content of its own.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from engine.stages.asr_request import SENTENCE_ENDS, SURE_LOGPROB

__all__ = [
    "BACKCHANNELS",
    "FILLERS",
    "GUESSED_OBJECTS",
    "UNFINISHED_ENDINGS",
    "ends_unsure",
    "is_backchannel",
    "sounds_unfinished",
    "sounds_unsure",
]

# Words an English sentence almost never ends with: articles, possessives, most
# prepositions, conjunctions, subject pronouns. A transcript ending on one is cut off.
# Words that can close a sentence ("so", "in", "is", "can") are left out on purpose.
UNFINISHED_ENDINGS = frozenset(
    ("a", "an", "the", "my", "your", "his", "her", "our", "their", "every")
    + ("to", "of", "for", "with", "from", "into", "onto", "at", "by", "about", "than")
    + ("and", "or", "but", "because", "if", "when", "while", "although", "unless")
    + ("whether", "been", "being", "very", "i", "we", "they", "he", "she", "i'm")
)

# What a listener says to show they follow, not to take the turn; whisper's habits of
# hearing "Thank you." in short noise and "Amen." in a short "mm hmm" are in here too.
BACKCHANNELS = frozenset(
    ("mm", "mmm", "hm", "hmm", "mhm", "uh", "huh", "um", "ah", "oh", "ooh", "aha", "amen")
    + ("yeah", "yep", "yes", "ya", "yup", "okay", "ok", "right", "sure", "alright", "cool")
    + ("i", "see", "got", "it", "nice", "wow", "really", "true", "exactly", "great", "good")
    + ("fine", "thanks", "thank", "you", "so", "well")
)

# Short words whisper makes of a sound's first syllable, which say nothing on their own.
FILLERS = frozenset(("then", "so", "it", "is", "in", "on", "that", "this", "there"))


# A hum spelt out at any length ("MMMM", "hmmmm", "mhm"): whisper writes as many letters
# as it hears.
_HUM = re.compile(r"[mh]+")


def is_backchannel(transcript: str) -> bool:
    """Whether a transcript holds no word that means to take the turn: only backchannels,
    hums, words that cannot stand alone ("and", "the"), or single letters."""
    words = re.findall(r"[a-z']+", transcript.lower())  # "mm-hmm": "mm", "hmm"
    ignored = BACKCHANNELS | UNFINISHED_ENDINGS | FILLERS
    return all(len(word) < 2 or word in ignored or _HUM.fullmatch(word) for word in words)


# Whisper completes speech cut after a preposition with a pronoun of its own ("a table
# for" becomes "a table for it."): after such a word, these prove nothing.
GUESSED_OBJECTS = frozenset(("it", "you", "me", "them", "him", "us"))


def sounds_unfinished(transcript: str) -> bool:
    """Whether a transcript stops on a word no English sentence ends with, or on a
    pronoun right after one (a real "...for you." then waits a little longer)."""
    words = re.findall(r"[a-z']+", transcript.lower())
    if len(words) >= 2 and words[-1] in GUESSED_OBJECTS and words[-2] in UNFINISHED_ENDINGS:
        return True
    return bool(words) and words[-1] in UNFINISHED_ENDINGS


# Whisper also completes a phrase cut mid-sentence with words or a stop of its own ("Can
# you add eggs and" heard as "Can you have excellent?", "Could you tell me what the" as
# "Could you tell me what?"), and is unsure of them: a token of the transcript's end (its
# last word or two and the punctuation) under SURE_LOGPROB.
ENDING_TOKENS = 3


def ends_unsure(logprobs: Sequence[float]) -> bool:
    """Whether Whisper was unsure how the transcript ends (its tokens' log-probabilities,
    in order; a cut phrase that it completed on its own usually is)."""
    return any(score < SURE_LOGPROB for score in logprobs[-ENDING_TOKENS:])


# Whisper closes every whole sentence with a stop (SENTENCE_ENDS); in a day of
# `bench/turns.py` runs every transcript of a whole sentence had one, while cut phrases
# sometimes had none ("I think the best way to get there is", called complete by the
# turn-end model at 0.6). How sure Whisper is of that stop says how sure it is that the
# sentence is over: at even odds or less, it is in doubt. In `bench/turn_endings.py` the
# stops of whole sentences scored -0.08 to -0.62, those Whisper put after a cut phrase it
# completed ("I think the best way to get married.", "... to get there is.") -0.89.
SURE_STOP_LOGPROB = math.log(0.5)


def sounds_unsure(transcript: str, logprobs: Sequence[float]) -> bool:
    """Whether how a transcript ends is in doubt: Whisper was unsure of its last tokens,
    put no stop after them, or gave the stop even odds or less."""
    closed = transcript.rstrip().rstrip("\"')").endswith(SENTENCE_ENDS)
    doubted_stop = closed and bool(logprobs) and logprobs[-1] <= SURE_STOP_LOGPROB
    return ends_unsure(logprobs) or not closed or doubted_stop
