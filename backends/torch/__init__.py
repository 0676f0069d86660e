"""The PyTorch backend (CPU, CUDA), batch-invariant where it claims exactness, and its draft-head runtimes."""
