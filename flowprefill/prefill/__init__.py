"""The prefill instance: requests, the S-EDF scheduler, the preemptible executor, tensor
parallelism, the TTFT predictor, the engine that runs them, its HTTP server and the factory
that builds a model backend for it."""
