"""``kvserve router``: an OpenAI-compatible front over several backend servers
(round-robin, least-load and prefix-aware routing, health checks, retries),
and ``kvserve serve --data-parallel-size N`` built on it. Talks HTTP only:
imports nothing of the engine but its tokenizer."""
