"""Verification and sampling: the verifier, the target's sampler chain, token probabilities, synthetic acceptance."""
