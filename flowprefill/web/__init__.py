"""HTTP plumbing shared by the gateway and the prefill server (torch-free).

- :mod:`~flowprefill.web.errors`: OpenAI-style error bodies, the exception handlers that
  produce them, and :class:`~flowprefill.web.errors.BodySizeLimit`.
- :mod:`~flowprefill.web.disconnect`: await something unless the client goes away first.
- :mod:`~flowprefill.web.probes`: ``/health``, ``/ready`` and ``/metrics``.
- :mod:`~flowprefill.web.sse`: server-sent event framing.
- :mod:`~flowprefill.web.gc_tuning`: startup frozen out of the garbage collector's scans.
"""
