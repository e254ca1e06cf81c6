"""Triton kernels, each beside the Python launcher that checks its inputs and
computes its grid. Modules here import only torch and triton, and are
imported lazily (by the ``triton`` attention backend), so CPU runs without
Triton never load them.
"""
