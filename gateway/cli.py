"""`duplex-gateway`: prepare the models, start the engine, serve the realtime gateway.

    duplex-gateway [--host H] [--port P] [--profile NAME | --config FILE] [--api-key KEY]
                   [--allowed-origin ORIGIN ...] [--max-sessions N] [--max-speaking N]
                   [--instance NAME]
                   [--llm NAME_OR_PATH | --llm-url URL [--llm-model NAME]]
                   [--asr NAME_OR_PATH] [--tts NAME_OR_PATH]
                   [--log-level LEVEL]
    duplex-gateway models {list,prepare} ...

Models are converted (with a progress bar) and loaded before the port opens, so a client
that can connect is served at once. `--profile NAME` is `--config configs/NAME.yaml`.
`--llm` and `--llm-url` replace the profile's LLM stage (see `llm_override`); `--asr`
and `--tts` the model of those stages (`speech_overrides`). SIGINT/SIGTERM drain: new
sessions are refused and /healthz answers 503, each open session is closed with code
1001 once its running response is done (at the latest after the profile's
`drain_timeout_s`), then the engine stops and the process exits 0. A second signal cuts
the drain short.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import logging
import os
import re
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the engine is imported only once the gateway starts
    from gateway.config import GatewayConfig
    from gateway.session.engine_backend import EngineBackend

__all__ = ["main"]

logger = logging.getLogger("duplex_gateway")

PROFILES = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CONFIG = PROFILES / "default.yaml"
# What mlx_lm.server calls the model it was started with.
REMOTE_DEFAULT_MODEL = "default_model"
HF_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="duplex-gateway",
        description="OpenAI Realtime gateway over a local speech/LLM engine.",
        epilog="Subcommand: `duplex-gateway models {list,prepare}` manages the model cache.",
    )
    parser.add_argument("--host", help="interface to bind (default from config: 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to bind (default from config: 8765)")
    profile = parser.add_mutually_exclusive_group()
    profile.add_argument(
        "--profile",
        metavar="NAME",
        help="a profile shipped in configs/: default, quality (Qwen2.5-Coder, Whisper "
        "base), remote-llm",
    )
    profile.add_argument("--config", type=Path, help="profile YAML (default: the default profile)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("DUPLEX_GATEWAY_API_KEY"),
        help="require this key (Authorization: Bearer, or the openai-insecure-api-key. "
        "subprotocol); env DUPLEX_GATEWAY_API_KEY",
    )
    parser.add_argument(
        "--allowed-origin",
        action="append",
        dest="allowed_origins",
        metavar="ORIGIN",
        help="browser Origin allowed to connect (repeatable; default: any)",
    )
    parser.add_argument("--max-sessions", type=int, help="concurrent realtime sessions")
    parser.add_argument(
        "--ice-server",
        action="append",
        dest="ice_servers",
        metavar="URL",
        help="STUN or TURN server for WebRTC calls, e.g. stun:stun.example.org:3478 "
        "(repeatable; TURN credentials go in the profile's ice_servers; default: host "
        "candidates only, for loopback and the LAN)",
    )
    parser.add_argument(
        "--max-speaking",
        type=int,
        help="spoken responses running at once before new ones wait or are refused with "
        "server_busy (default from config: capacity.max_speaking)",
    )
    parser.add_argument(
        "--instance", help="this process's name in /healthz (default: HOSTNAME:PORT)"
    )
    llm = parser.add_mutually_exclusive_group()
    llm.add_argument(
        "--llm",
        metavar="NAME_OR_PATH",
        help="run this model in the LLM stage: a local mlx-lm model folder, a Hugging Face "
        "id (org/name, downloaded once) or a name from `duplex-gateway models list`",
    )
    llm.add_argument(
        "--llm-url",
        metavar="URL",
        help="use an OpenAI-compatible server for the LLM stage (llama.cpp's server, "
        "vLLM, mlx_lm.server), e.g. http://127.0.0.1:8080/v1",
    )
    parser.add_argument(
        "--llm-model",
        metavar="NAME",
        help=f"the model to ask the --llm-url server for (default {REMOTE_DEFAULT_MODEL!r}: "
        "the loaded model of mlx_lm.server; llama.cpp's server ignores it; vLLM needs "
        "the name it serves)",
    )
    for stage, what in (("asr", "speech-to-text"), ("tts", "text-to-speech")):
        parser.add_argument(
            f"--{stage}",
            metavar="NAME_OR_PATH",
            help=f"run this model in the {what} stage: a name from `duplex-gateway models "
            f"list`, a folder of an already converted model, or a Hugging Face id "
            "(org/name, downloaded once, in the stage's converted layout)",
        )
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    return parser


def config_path(args: argparse.Namespace) -> Path:
    """The profile file `--profile` or `--config` names (the default profile if neither)."""
    if args.profile is None:
        return args.config or DEFAULT_CONFIG
    path = PROFILES / f"{args.profile}.yaml"
    if not re.fullmatch(r"[\w.-]+", args.profile) or not path.is_file():
        known = ", ".join(sorted(p.stem for p in PROFILES.glob("*.yaml")))
        raise SystemExit(f"duplex-gateway: no profile {args.profile!r}; known: {known}")
    return path


def speech_overrides(profile: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The profile with the models of its ASR and TTS stages replaced as `--asr` and
    `--tts` ask; their other settings stay."""
    stages = dict(profile.get("stages") or {})
    for stage in ("asr", "tts"):
        value = getattr(args, stage, None)
        if value is not None:
            stages[stage] = {**(stages.get(stage) or {}), "model": model_ref(stage, value)}
    if getattr(args, "tts", None) is not None:
        # The profile's voice was its own model's: the new model's default speaks.
        stages["tts"] = {**stages["tts"], "voice": None}
    return {**profile, "stages": stages}


def voice_settings(
    config: GatewayConfig, voices: tuple[str, ...], openai_voices: dict[str, str]
) -> dict[str, Any]:
    """The gateway's voice table for the voices the engine speaks (its default first):
    the profile's OpenAI names where they all name one of them, else the engine's own
    table (a model given by `--tts` that the profile's table was not written for)."""
    if all(v in voices for v in config.openai_voices.values()):
        openai_voices = {**openai_voices, **config.openai_voices}
    return {"voices": voices, "openai_voices": openai_voices}


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    given = {
        "host": args.host,
        "port": args.port,
        "api_key": args.api_key,
        "allowed_origins": tuple(args.allowed_origins) if args.allowed_origins else None,
        "max_sessions": args.max_sessions,
        "instance": args.instance,
        "ice_servers": tuple({"urls": url} for url in args.ice_servers)
        if args.ice_servers
        else None,
    }
    return {k: v for k, v in given.items() if v is not None}


def _capacity_override(config: GatewayConfig, args: argparse.Namespace) -> dict[str, Any]:
    if args.max_speaking is None:
        return {}
    return {"capacity": {**config.capacity.model_dump(), "max_speaking": args.max_speaking}}


def llm_override(profile: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The profile with its `stages.llm` replaced as `--llm` / `--llm-url` ask; the
    sampling settings stay. Without either flag, the profile as it is."""
    if args.llm is None and args.llm_url is None:
        if args.llm_model is not None:
            raise SystemExit("duplex-gateway: --llm-model is only used with --llm-url")
        return profile
    stages = dict(profile.get("stages") or {})
    sampling = (stages.get("llm") or {}).get("sampling")
    llm: dict[str, Any]
    if args.llm_url is not None:
        remote = {"base_url": args.llm_url, "model": args.llm_model or REMOTE_DEFAULT_MODEL}
        llm = {"backend": "remote", "remote": remote}
    else:
        if args.llm_model is not None:
            raise SystemExit("duplex-gateway: --llm-model is only used with --llm-url")
        llm = {"backend": "local", "model": local_llm_ref(args.llm)}
    if sampling is not None:
        llm["sampling"] = sampling
    return {**profile, "stages": {**stages, "llm": llm}}


def served_name(profile: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """With `--llm` or `--llm-url` the gateway's own model name (`session.model`,
    `/healthz`) follows the LLM it now serves, `duplex-<model>`, unless the profile names
    itself (`gateway: model_name:`)."""
    if args.llm is None and args.llm_url is None:
        return {}
    if "model_name" in (profile.get("gateway") or {}):
        return {}
    remote = args.llm_url is not None
    model = (args.llm_model or REMOTE_DEFAULT_MODEL) if remote else args.llm
    folder = Path(model).expanduser()
    last = folder.resolve().name if not remote and folder.is_dir() else model.rsplit("/", 1)[-1]
    return {"model_name": f"duplex-{_safe(last)}"}


def local_llm_ref(value: str) -> dict[str, str]:
    """`--llm`'s model (`model_ref`)."""
    return model_ref("llm", value)


def model_ref(stage: str, value: str) -> dict[str, str]:
    """`--llm`, `--asr` or `--tts`'s model: a registry name of that stage as it is; a
    folder or a Hugging Face id becomes a registry entry of its own (`path:` or `hf:`
    source, files linked into the cache)."""
    from engine.weights import registry

    if value in {spec.name for spec in registry.specs() if spec.stage == stage}:
        return {"name": value}
    folder = Path(value).expanduser()
    if folder.is_dir():
        folder = folder.resolve()
        # The folder's name for people, a digest of its path so two `model/` folders differ.
        digest = hashlib.sha256(str(folder).encode()).hexdigest()[:8]
        return {"name": f"local-{_safe(folder.name)}-{digest}", "source": f"path:{folder}"}
    if HF_ID.fullmatch(value):
        return {"name": f"hf-{_safe(value)}", "source": f"hf:{value}"}
    raise SystemExit(
        f"duplex-gateway: --{stage} {value!r} is neither a folder, a Hugging Face id "
        f"(org/name) nor a {stage} model name from `duplex-gateway models list`"
    )


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "--", text)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["models"]:
        import engine

        engine.setup()  # conversions run MLX
        from engine.weights.registry import models_command

        return models_command(argv[1:])
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return asyncio.run(_serve(args))
    except KeyboardInterrupt:
        return 0


async def _serve(args: argparse.Namespace) -> int:
    from gateway.config import GatewayConfig, load_profile
    from gateway.server.server import GatewayServer

    path = config_path(args)
    profile, config = load_profile(path)
    named = served_name(profile, args)
    profile = speech_overrides(llm_override(profile, args), args)
    config = GatewayConfig.model_validate(
        {**config.model_dump(), **_overrides(args), **_capacity_override(config, args), **named}
    )
    backend, voices, openai_voices = await _start_engine(profile, config, str(path))
    config = GatewayConfig.model_validate(
        {
            **config.model_dump(),
            **voice_settings(config, voices, openai_voices),
            "default_instructions": profile.get("system_prompt", ""),
            "semantic_vad": backend.semantic_vad,
        }
    )
    server = GatewayServer(config, backend)
    await server.start()
    print(f"duplex-gateway listening on ws://{config.host}:{server.port}/v1/realtime", flush=True)
    signals = _Signals()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signals.received)
    await signals.first.wait()
    drain = asyncio.create_task(server.drain(config.drain_timeout_s))
    cut = asyncio.create_task(signals.second.wait())
    await asyncio.wait({drain, cut}, return_when=asyncio.FIRST_COMPLETED)
    for task in (drain, cut):
        task.cancel()
    await asyncio.gather(drain, cut, return_exceptions=True)
    logger.info("shutting down")
    await server.shutdown("server shutting down")
    logger.info("stopped")
    return 0


class _Signals:
    """SIGINT/SIGTERM: the first starts the drain, a second cuts it short."""

    def __init__(self) -> None:
        self.first = asyncio.Event()
        self.second = asyncio.Event()

    def received(self) -> None:
        (self.second if self.first.is_set() else self.first).set()


async def _start_engine(
    profile: dict[str, Any], config: GatewayConfig, source: str
) -> tuple[EngineBackend, tuple[str, ...], dict[str, str]]:
    """Build the engine from the profile (preparing models first) and wrap it."""
    import engine

    engine.setup()  # before the engine's modules import MLX
    from duplex.manager import DuplexSessionManager
    from engine.build import build_engine
    from engine.config import parse_config
    from gateway.server.priority import lower_other_threads
    from gateway.session.engine_backend import EngineBackend
    from gateway.session.input_processing import start_runtime

    engine_config = parse_config(profile, source=source)
    bundle = await build_engine(engine_config)
    start_runtime()  # the echo canceller's threads
    lower_other_threads(config.engine_nice)  # the engine's threads all exist now
    # The models, their modules and their caches live as long as the process: out of
    # the collector's sight, a full collection (the event loop stopped meanwhile) no
    # longer walks them, only what the sessions made since.
    gc.freeze()
    manager = DuplexSessionManager(bundle.orchestrator, max_sessions=config.max_sessions)

    async def stop_engine() -> None:
        await bundle.aclose()
        # A step already running (a long prefill on a busy CPU) may outlast the bundle's
        # join; the process must not exit while the engine thread is inside MLX.
        await asyncio.to_thread(bundle.core.shutdown, 120.0)

    backend = EngineBackend(
        manager,
        bundle.engine,
        on_close=stop_engine,
        llm_tokens=bundle.llm_tokens,
        caches=bundle.cache_stats,
        turns=config.turns,
    )
    return backend, bundle.voices, bundle.openai_voices


def run() -> None:
    """The `duplex-gateway` console script: `main`, then a clean hard exit."""
    import engine

    engine.setup()  # first: engine.runtime.core imports MLX, which then keeps its reference BLAS
    from engine.runtime.core import exit_after

    exit_after(main)


if __name__ == "__main__":
    run()
