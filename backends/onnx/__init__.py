"""The ONNX Runtime backend: the decoder exported to a cached graph, its KV caches and execution providers."""
