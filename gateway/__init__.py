"""The OpenAI Realtime gateway: WebSocket server, protocol events, audio codecs, server
VAD glue and the `duplex-gateway` CLI. Nothing here imports MLX; the engine is reached
through `gateway.backend`."""
