"""What a model file says as text: GGUF metadata, the tokenizer, chat templates, infill layouts, grammars."""
