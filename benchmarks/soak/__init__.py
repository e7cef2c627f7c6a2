"""Soak of a running stack: memory and file-descriptor trends, and the gateway's counters
against the client's."""
