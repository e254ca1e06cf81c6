"""The device side: model runner, KV cache tensors, input preparation."""
