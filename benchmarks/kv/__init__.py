"""The KV hand-off: write, header check and read, and decode's first token with it."""
