"""The `gateway:` section of a profile (configs/*.yaml), validated once at start-up.

Every key here is used by the server or the realtime session; an unknown key is an
error so that a misspelt limit cannot be silently ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "OPENAI_REALTIME_MODELS",
    "OPENAI_VOICES",
    "CapacitySettings",
    "GatewayConfig",
    "SessionLimits",
    "load_profile",
]

# The names OpenAI's realtime models go by, so that an app written for the service runs
# unchanged. A trailing "*" matches every name with that prefix: the dated snapshots
# (gpt-4o-realtime-preview-2024-12-17, gpt-realtime-2025-08-28) included.
OPENAI_REALTIME_MODELS = (
    "gpt-realtime*",
    "gpt-4o-realtime-preview*",
    "gpt-4o-mini-realtime-preview*",
)
# The voice names OpenAI's realtime models take, so that an app written for the service
# (the Agents SDK asks for "ash", LiveKit's plugin for "alloy") runs unchanged. The
# profile's `openai_voices` table says which of its own voices speaks each.
OPENAI_VOICES = (
    "alloy",
    "ash",
    "ballad",
    "cedar",
    "coral",
    "echo",
    "marin",
    "sage",
    "shimmer",
    "verse",
)


class SessionLimits(BaseModel):
    """Per-connection bounds: what one client can make the server hold."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Incoming events above this get an `error` event (the service caps appends at 15 MiB).
    max_event_bytes: int = Field(default=15 * 1024 * 1024, ge=1024)
    # Frames above this are refused by the WebSocket layer itself (close 1009).
    max_frame_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    # Outgoing audio deltas are cut to at most this much audio.
    output_chunk_ms: int = Field(default=100, ge=10, le=1000)
    # Uncommitted input audio kept at most (manual mode); beyond it appends are refused.
    max_input_buffer_ms: int = Field(default=15 * 60 * 1000, ge=1000)
    # User audio the conversation's items hold at most, in seconds of audio (a commit or
    # an item with input audio). Beyond it the audio of the oldest transcribed items is
    # dropped (their words stay); audio not transcribed yet is never dropped, so if that
    # is not enough the commit or item is refused. 15 min is every buffer that
    # `max_input_buffer_ms` accepts: at most ~100 MB for 24 kHz pcm16 while none of it is
    # transcribed (wire bytes plus 16 kHz float32), ~43 MB once it all is.
    max_committed_audio_s: float = Field(default=900.0, gt=0)
    # Conversation items kept at most; creating more is refused.
    max_items: int = Field(default=512, ge=2)
    # Messages of history handed to the LLM per turn when truncation is "auto".
    max_context_messages: int = Field(default=64, ge=1)
    # Server events queued for a client that does not read; beyond it the session closes.
    send_queue_events: int = Field(default=2048, ge=16)
    # Wall-clock cap on one session, like the service's 60-minute limit.
    max_session_s: float = Field(default=3600.0, gt=0)
    # Connections that have not yet sent a whole HTTP request (WebSocket upgrade or a
    # plain GET), across the process and from one client address. Beyond either the
    # connection is answered 503 and closed at once, so idle or trickling clients cannot
    # use up the process's file descriptors.
    max_pending_handshakes: int = Field(default=256, ge=1)
    max_pending_handshakes_per_address: int = Field(default=32, ge=1)
    # A connection whose request and handshake take longer than this is closed.
    handshake_timeout_s: float = Field(default=10.0, gt=0)


class CapacitySettings(BaseModel):
    """Admission control (docs/protocol.md, "Capacity"): how many spoken responses may
    run at once before a new one waits or is refused with `server_busy`.

    Saturated means `max_speaking` spoken responses are running, or one of them that
    has begun to speak has less than `runway_floor_s` of audio left at its client (it
    is about to stall). On the 2-core reference machine bench/load.py measured 2
    responses speaking at once without a stall, 3 stalling 1.2 s and 5 stalling 15 s;
    4 bounds a burst of starts (none of which has a runway yet) below the worst of
    those, and the runway floor refuses earlier whenever the engine falls behind.
    Measure your machine with bench/load.py and raise `max_speaking` to its knee.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Spoken responses running at once, server-wide (text-only responses and
    # transcriptions are not counted: they never make a listener wait for audio).
    max_speaking: int = Field(default=4, ge=1)
    # Saturated while a speaking response's client has less audio than this left to
    # play (sent minus the wall time since its first delta); None: count only. Half a
    # second is under one clause of speech, so a healthy pipeline stays above it.
    runway_floor_s: float | None = Field(default=0.5, ge=0)
    # New spoken responses that wait, server-wide, while saturated; the next one is
    # refused at once. 0: refuse instead of queueing.
    max_queued: int = Field(default=8, ge=0)
    # A waiting response is refused after this long: an answer that starts later than
    # a few seconds after the user stopped is no longer a conversation.
    max_wait_s: float = Field(default=3.0, gt=0)


class TurnSettings(BaseModel):
    """Turn-taking thresholds (docs/protocol.md, "Turn detection", has the measurements).

    semantic_vad: once a silence in speech lasts `semantic_score_after_ms`, the turn-end
    model scores the speech so far; at `semantic_complete_threshold` or above the turn
    ends there, below it the turn waits for more speech up to the eagerness's longest
    wait. Interruptions: while a response is running, speech starts an interruption
    only once it has lasted `min_interruption_ms`, or earlier once its words are not
    all backchannels; shorter speech (a backchannel, a cough) neither cancels the
    response nor reaches the client. 0 interrupts on any speech at once.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    semantic_score_after_ms: int = Field(default=160, ge=32, le=2000)
    # ... and scores it again every this much longer silence, each time once the last
    # score is in (None: once).
    semantic_rescore_ms: int | None = Field(default=400, ge=100, le=8000)
    semantic_complete_threshold: float = Field(default=0.5, gt=0.0, lt=1.0)
    # Also transcribe the speech at the silence: a turn ending on "for", "the", "and"...
    # is not over, whatever the model heard.
    semantic_words: bool = True
    # The words are asked for sooner, once the silence lasts this long: the answer is
    # prepared from them, so its LLM and TTS start while the model scores the turn.
    semantic_words_after_ms: int = Field(default=64, ge=32, le=2000)
    # A transcript whose ending whisper is unsure of (maybe a cut phrase it completed
    # with words of its own) ends the turn only after this fraction of the eagerness's
    # longest wait (auto: 0.3 x 4 s = 1.2 s of silence); 1: wait all of it.
    semantic_unsure_wait: float = Field(default=0.3, ge=0.0, le=1.0)
    # Speech over a running response is transcribed once it began this long ago (and
    # again until `min_interruption_ms`, each time once the last transcript is in): words
    # other than backchannels ("yeah", "mm hmm", "okay") confirm the interruption early.
    # None: off.
    interruption_words_after_ms: int | None = Field(default=None, ge=32, le=5000)
    # After a check whose words said nothing ("So", "Uh"), the next one is due this much
    # more speech later, once that check is in (None: `interruption_words_after_ms`).
    interruption_words_every_ms: int | None = Field(default=None, ge=32, le=5000)
    min_interruption_ms: int = Field(default=0, ge=0, le=5000)

    @model_validator(mode="after")
    def _words_before_score(self) -> TurnSettings:
        if self.semantic_words_after_ms > self.semantic_score_after_ms:
            raise ValueError(
                "semantic_words_after_ms must not exceed semantic_score_after_ms: the "
                "score needs the words"
            )
        return self


class IceServer(BaseModel):
    """A STUN or TURN server for WebRTC calls (`ice_servers`), as a browser names one."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    urls: tuple[str, ...]
    username: str | None = None
    credential: str | None = None

    @field_validator("urls", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value


class GatewayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(default=8765, ge=0, le=65535)
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    # Open sessions, idle or not (docs/deploy.md, "Sessions and their cost"): a silent
    # stream costs about 1.3% of a core and an idle session well under 1 MiB, so 48 of
    # them take about 0.6 of a core; speaking is capped apart (capacity.max_speaking).
    max_sessions: int = Field(default=48, ge=1)
    # With max_sessions open, a new connection takes the place of the session that has
    # been idle longest (no response running, nothing sent to it) if that is at least
    # this long; it is closed with 1001. None: a full gateway refuses new sessions.
    idle_session_s: float | None = Field(default=60.0, gt=0)
    model_name: str = "duplex-smollm2"
    # More names a client may ask for (`?model=`, `session.model`) and be served by this
    # profile; `session.model` reports the name asked for. Exact, or a prefix when the
    # name ends in "*". Any other name is refused with an `invalid_model` error.
    model_aliases: tuple[str, ...] = OPENAI_REALTIME_MODELS
    # This process's name in /healthz, so that behind a load balancer an operator can
    # tell instances apart; the CLI fills in host name and port when none is given.
    instance: str = ""
    # WebRTC calls (/v1/realtime/calls): the STUN/TURN servers the gateway gathers its
    # ICE candidates with. None: host candidates only, enough on loopback and the LAN;
    # a gateway behind NAT names a STUN server, or a TURN relay where UDP cannot pass.
    ice_servers: tuple[IceServer, ...] = ()
    # On SIGTERM: sessions with a response running may finish it for this long; then
    # every session left is closed with 1001 and the process exits.
    drain_timeout_s: float = Field(default=30.0, ge=0)
    # The engine's threads (lanes, BLAS and MLX workers) run this many nice levels below
    # the event loop (Linux; gateway/server/priority.py), so that frames, pings and audio are
    # handled as soon as they come while the models keep every core busy. 0: equal.
    engine_nice: int = Field(default=10, ge=0, le=19)
    # The profile's own voices (the CLI fills in the TTS stage's voice).
    voices: tuple[str, ...] = ("joe",)
    # OpenAI voice name -> the profile voice that speaks it. A name of OPENAI_VOICES left
    # out is spoken by the first of `voices`; other names may be added as aliases too.
    # `session.voice` reports the name the client asked for.
    openai_voices: dict[str, str] = Field(default_factory=dict)
    # Stored prompts a session or response names by id (`prompt`): {id: {version: text}},
    # `{{name}}` marking a variable (gateway/protocol/prompts.py); the last version is the default.
    prompts: dict[str, dict[str, str]] = Field(default_factory=dict)
    # A new session's `instructions`; the CLI fills it from the profile's system prompt.
    default_instructions: str = ""
    transcription_languages: tuple[str, ...] = ("en",)
    # Server VAD: once a silence in speech lasts this long, the response its stop would
    # create starts in the engine with its outputs held back, so the silence the turn
    # detector waits out overlaps the model work. Speech going on discards it; None
    # turns it off. Below the session's silence_duration_ms to have any effect.
    prepare_after_silence_ms: int | None = Field(default=150, ge=0)
    # Whether the engine has the turn-end model behind semantic_vad (the CLI sets it).
    semantic_vad: bool = False
    # Whether sessions cancel the echo of their own output audio in their input
    # (gateway.session.input_processing); a session sets it with its echo_cancellation field.
    # Until the microphone is heard to carry that echo, the input passes as it came.
    echo_cancellation: bool = True
    turns: TurnSettings = TurnSettings()
    capacity: CapacitySettings = CapacitySettings()
    web_root: Path | None = None
    limits: SessionLimits = SessionLimits()

    @field_validator("model_aliases")
    @classmethod
    def _star_only_at_the_end(cls, aliases: tuple[str, ...]) -> tuple[str, ...]:
        for alias in aliases:
            if not alias.rstrip("*") or "*" in alias.rstrip("*") or alias.endswith("**"):
                raise ValueError(f"{alias!r}: a name, or a prefix followed by one '*'")
        return aliases

    @model_validator(mode="after")
    def _voices_exist(self) -> GatewayConfig:
        for name, voice in self.openai_voices.items():
            if voice not in self.voices:
                raise ValueError(
                    f"openai_voices maps {name!r} to {voice!r}, which is not one of this "
                    f"profile's voices ({', '.join(self.voices)})"
                )
        return self

    def speaker(self, voice: str) -> str | None:
        """The profile voice that speaks the voice a client asked for; None: unknown."""
        if voice in self.voices:
            return voice
        if voice in self.openai_voices:
            return self.openai_voices[voice]
        return self.voices[0] if voice in OPENAI_VOICES else None

    @property
    def voice_names(self) -> tuple[str, ...]:
        """Every voice name a client may ask for."""
        return tuple(dict.fromkeys((*self.voices, *OPENAI_VOICES, *self.openai_voices)))

    @property
    def served_models(self) -> tuple[str, ...]:
        """Every name this profile answers to, patterns as written."""
        return (self.model_name, *self.model_aliases)

    def serves(self, model: str) -> bool:
        """Whether a client asking for `model` is served by this profile."""
        return any(
            model.startswith(name[:-1]) if name.endswith("*") else model == name
            for name in self.served_models
        )


def load_profile(path: Path) -> tuple[dict[str, Any], GatewayConfig]:
    """The whole profile (for the engine) and its validated `gateway:` section."""
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a profile is a YAML mapping")
    section = dict(data.get("gateway") or {})
    # The voice table is checked against the voice the TTS stage speaks with.
    voice = ((data.get("stages") or {}).get("tts") or {}).get("voice")
    if isinstance(voice, str) and "voices" not in section:
        section["voices"] = (voice,)
    return data, GatewayConfig.model_validate(section)
