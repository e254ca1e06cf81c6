"""Token sampling on the device: penalties, masks, seeded sampling, logprobs."""

from kvserve.sampling.sampler import Sampler, SamplerOutput, SamplingBatch, make_generator

__all__ = ["Sampler", "SamplerOutput", "SamplingBatch", "make_generator"]
