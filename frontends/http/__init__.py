"""The HTTP API: llama-server's, OpenAI's and Anthropic's endpoints as one Starlette app."""
