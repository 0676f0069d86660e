"""Offline converters: Hugging Face checkpoints (targets and draft heads) to GGUF, and GGUF truncation."""
