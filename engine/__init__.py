"""The MLX multi-stage engine: request types, stages, models, and the engine thread.

Importing it, or any module in it, sets nothing up. A process that runs models calls
`setup()` once, before anything imports `mlx.core` (the CLI does, before it builds the
engine): MLX then uses an optimised BLAS where one is installed (see `engine.native.blas`).
"""

__all__ = ["setup"]


def setup() -> str | None:
    """Put the optimised BLAS (and the few-row forwarder in front of it, built on first
    use) under MLX; returns the BLAS's path, or None where MLX keeps its own. Call it
    before `mlx.core` is imported; later calls return the first call's answer."""
    from engine.native.blas import ensure_fast_blas

    return ensure_fast_blas()
