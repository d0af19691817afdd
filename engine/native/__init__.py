"""Native helpers the engine builds or loads once: the system BLAS and few-row products."""
