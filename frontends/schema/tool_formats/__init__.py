"""Chat replies split into content, reasoning and tool calls, one module per template family
(frontends/schema/chat_reply.py is the interface the frontends import)."""
