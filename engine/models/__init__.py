"""One flat file per model (as mlx-lm keeps them), and the converters that turn a
carrier's weights into what that file loads."""
