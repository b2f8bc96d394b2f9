"""Speculative decoding: proposers (a draft model, prompt lookup), the rejection sampler
and the runner that verifies proposals with the target model in one forward pass."""
