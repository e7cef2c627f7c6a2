"""The OpenAI-compatible gateway (``flowprefill serve-gateway``).

A request's path, one module per stage (each a plain class or function over
:class:`~flowprefill.gateway.classify.Job`, testable without HTTP)::

    app.py        FastAPI wiring: routes -> the stages below; probes; SLO table reload
    classify.py   1. intake: model check, SLO class and TTFT target, tokens -> Job
    prefill.py    2. admission, then the first token from a prefill instance
    decode.py     3. the rest from a vLLM decode instance; who releases the KV hand-off
    relay.py      4. one OpenAI body or an SSE stream (the OpenAI wire format)

Beside them: openai_api.py (request bodies and what is done with every field), tokens.py
(the one tokenization path; vLLM's /tokenize and /detokenize), admission.py (the
shedding decision), routing.py (instance pools, routing policies, the retry rule, health
probes), upstream.py (the prefill and decode clients over one HTTP client), errors.py
(failures -> status and metric reason), metrics.py, cli.py.
"""
