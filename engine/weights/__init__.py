"""Where models come from: weight carriers on PyPI, the model registry and its cache."""
