"""The native CPU backend: spekula's C kernels (csrc/) over the GGUF blocks, and its draft-head runtimes."""
