"""Tensor and pipeline parallelism over ``torch.distributed``.

``sharding`` is the arithmetic of the split (no torch: the engine checks a
split before any process starts); ``parallel_state`` is one worker's place
in it and the state its layers are built for; ``communicator`` holds the
collectives and the pipeline's point-to-point hand-off. The processes
themselves are started and driven from ``kvserve/worker/``.
"""
