"""`duplex-gateway`: prepare the models, start the engine, serve the realtime gateway.

    duplex-gateway [--host H] [--port P] [--config configs/default.yaml] [--api-key KEY]
                   [--allowed-origin ORIGIN ...] [--max-sessions N] [--log-level LEVEL]
    duplex-gateway models {list,prepare} ...

Models are converted (with a progress bar) and loaded before the port opens, so a client
that can connect is served at once. SIGINT/SIGTERM close every session with code 1001,
abort the engine's work and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the engine is imported only once the gateway starts
    from gateway.config import GatewayConfig
    from gateway.engine_backend import EngineBackend

__all__ = ["main"]

logger = logging.getLogger("duplex_gateway")

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="duplex-gateway",
        description="OpenAI Realtime gateway over a local speech/LLM engine.",
        epilog="Subcommand: `duplex-gateway models {list,prepare}` manages the model cache.",
    )
    parser.add_argument("--host", help="interface to bind (default from config: 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to bind (default from config: 8765)")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="profile YAML")
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
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    return parser


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    given = {
        "host": args.host,
        "port": args.port,
        "api_key": args.api_key,
        "allowed_origins": tuple(args.allowed_origins) if args.allowed_origins else None,
        "max_sessions": args.max_sessions,
    }
    return {k: v for k, v in given.items() if v is not None}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["models"]:
        from engine.registry import models_command

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
    from gateway.server import GatewayServer

    profile, config = load_profile(args.config)
    config = GatewayConfig.model_validate({**config.model_dump(), **_overrides(args)})
    backend, voice = await _start_engine(profile, config, str(args.config))
    config = GatewayConfig.model_validate(
        {
            **config.model_dump(),
            "voices": (voice,),
            "default_instructions": profile.get("system_prompt", ""),
            "semantic_vad": backend.semantic_vad,
        }
    )
    server = GatewayServer(config, backend)
    await server.start()
    print(f"duplex-gateway listening on ws://{config.host}:{server.port}/v1/realtime", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("shutting down")
    await server.shutdown("server shutting down")
    logger.info("stopped")
    return 0


async def _start_engine(
    profile: dict[str, Any], config: GatewayConfig, source: str
) -> tuple[EngineBackend, str]:
    """Build the engine from the profile (preparing models first) and wrap it."""
    from duplex.manager import DuplexSessionManager
    from engine.build import build_engine
    from engine.config import parse_config
    from gateway.engine_backend import EngineBackend

    engine_config = parse_config(profile, source=source)
    bundle = await build_engine(engine_config)
    manager = DuplexSessionManager(bundle.orchestrator, max_sessions=config.max_sessions)

    async def stop_engine() -> None:
        await bundle.aclose()
        # A step already running (a long prefill on a busy CPU) may outlast the bundle's
        # join; the process must not exit while the engine thread is inside MLX.
        await asyncio.to_thread(bundle.core.shutdown, 120.0)

    backend = EngineBackend(manager, bundle.engine, on_close=stop_engine, turns=config.turns)
    return backend, engine_config.stages.tts.voice


def run() -> None:
    """The `duplex-gateway` console script: `main`, then a clean hard exit."""
    from engine.core import exit_process

    exit_process(main())


if __name__ == "__main__":
    run()
