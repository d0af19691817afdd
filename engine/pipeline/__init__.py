"""The duplex stage port: the multi-stage pipeline, one turn's run through it, and the chat
format it hands the LLM."""
