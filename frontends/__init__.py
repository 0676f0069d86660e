"""Frontends: CLI, JSON-RPC server and client, Textual TUI."""
