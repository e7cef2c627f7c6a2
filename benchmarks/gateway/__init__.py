"""The gateway alone: latency it adds and requests/s it sustains, against stub upstreams."""
