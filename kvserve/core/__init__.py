"""The engine core in pure Python: requests, sampling params, scheduler and KV cache manager."""
