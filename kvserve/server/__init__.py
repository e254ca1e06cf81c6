"""The OpenAI-compatible HTTP server (``kvserve serve``).

``protocol`` (request models, error envelope), ``serving`` (completions and
chat on the engine client), ``api`` (FastAPI app, auth, probes, metrics
route), ``metrics`` (Prometheus), ``state`` (loading, admission, draining,
engine failure), ``launcher`` (flags and start-up), ``faults`` (test-only
fault injection). Import the submodules; this package imports nothing heavy.
"""
