"""Attention backends over the paged KV cache, and the per-step metadata they read."""
