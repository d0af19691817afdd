"""Model-neutral duplex session core: contracts, sessions, turns, epochs and barge-in.

Nothing here imports MLX, websockets, `engine` or `gateway`: the core talks to the
engine only through a `DuplexStreamingStagePort` and to the client only through the
values it returns.
"""
