"""GGUF models as weights: hyper-parameters and tensors for the runtimes, and where model files come from (the default model, the Hugging Face hub)."""
