"""The OpenAI Realtime gateway: `protocol/` (the protocol's shapes), `session/` (one
session, sans-I/O), `server/` (the server and its asyncio shells), `webrtc/` (OpenAI's
WebRTC endpoints) and the `duplex-gateway` CLI. Nothing here imports MLX; the engine is
reached through `gateway.session.backend`, wired by `gateway.cli`."""
