"""JSON-RPC 2.0 over a Unix socket: framing, dispatch, the methods, the server and its Python clients."""
