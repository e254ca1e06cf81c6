"""Speculative decoding proposers, chosen by name (``SpeculativeConfig.method``):
``ngram`` (prompt lookup), ``oracle`` (benchmarks), ``draft_model`` and
``eagle``. Verification is ``kvserve/sampling/rejection.py``; the runner's
side of a speculative step is ``kvserve/worker/spec_decode.py``."""
