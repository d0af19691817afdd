"""The engine thread that owns MLX, its stages' interface and the asyncio side of requests."""
