"""vLLM decode under FlowPrefill's settings."""
