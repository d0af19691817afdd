"""A session's resident stage-0 request: what it hears, its speech detection and live
transcript."""
