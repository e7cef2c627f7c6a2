"""The OpenAI-compatible gateway (``flowprefill serve-gateway``).

A request's path, one module per stage (each a plain class or function over
:class:`~flowprefill.gateway.job.Job`, testable without HTTP)::

    app.py        FastAPI wiring: routes -> the stages below; probes; SLO table reload
    admit.py      1. model check, SLO class (classify.py), tokens (tokenizer.py) -> Job
    prefill.py    2. the first token from a prefill instance (contracts.prefill_api)
    decode.py     3. the rest from a vLLM decode instance; who releases the KV hand-off
    relay.py      4. one OpenAI body or an SSE stream (openai_wire.py)

Beside them: job.py (the request and its deadline), failover.py (the one retry rule),
routing.py (instance pools and policies), upstream.py / transport.py (the upstream
clients), errors.py (failures -> status and metric reason), tokenize_api.py (vLLM's
/tokenize and /detokenize), metrics.py, state.py, cli.py.
"""
