"""The MLX multi-stage engine: request types, stages, models, and the engine thread.

Importing this package first makes MLX use an optimised BLAS where one is installed
(see `engine.blas`), so every module below may import `mlx.core` freely.
"""

from engine import blas as _blas

_blas.ensure_fast_blas()
