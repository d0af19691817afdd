"""The LLM stage, as vLLM v1 splits it: scheduler, model runner, output processor; its
sampling, prompt cache, tool calls and the remote alternative."""
