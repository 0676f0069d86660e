"""What the HTTP routes share: the engine once it is loaded, the server's settings, and the body and
chat-template reading every route does the same way."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.requests import Request

from spekula.core.embedding import EUCLIDEAN
from spekula.core.modelfile.chat_template import ChatTemplateError, chat_prompt
from spekula.frontends.http.errors import HttpError
from spekula.frontends.http.fields import MAX_BODY_DEFAULT, HttpOptions
from spekula.frontends.http.generation import GenerationService
from spekula.frontends.rpc.parse_off_loop import decode_json
from spekula.frontends.rpc.protocol import RpcError
from spekula.frontends.schema.chat_messages import MessagesError, chat_messages
from spekula.frontends.schema.unicode_check import not_unicode_message

if TYPE_CHECKING:
    from spekula.core.modelfile.rerank_prompt import RerankFormat
    from spekula.frontends.http.serving_engine import ServingEngine


@dataclass
class HttpState:
    """What the routes share: the engine once it is loaded, and the server's settings."""

    api_keys: tuple[str, ...] = ()
    metrics: bool = False
    max_body_bytes: int = MAX_BODY_DEFAULT
    model_alias: str = "spekula"
    model_path: str = ""
    write_timeout: float = 30.0
    # A request's whole body must arrive within this many seconds of its headers (408 beyond), so a
    # client that stalls mid-body cannot hold a connection and its buffers.
    body_timeout: float = 60.0
    cors_origins: str = "*"
    slots_endpoint: bool = True
    slot_save_path: str | None = None  # --slot-save-path: POST /slots/{id}?action=save|restore|erase in this directory
    verbose: bool = False  # -v: every OpenAI answer carries `__verbose` (the native result), as llama-server's does
    static_dir: str | None = None  # --path: static files (e.g. a web UI build) served at /, without a key
    spm_infill: bool = False  # --spm-infill: /infill puts the suffix before the prefix
    embd_normalize: int = EUCLIDEAN  # --embd-normalize: a pooled embedding's default normalisation
    rerank_format: RerankFormat | None = None  # how /rerank lays out (query, document): set with --reranking
    engine: ServingEngine | None = None
    service: GenerationService = field(init=False)
    version: str = "0.1.0"
    created: int = field(default_factory=lambda: int(time.time()))
    metrics_render: Callable[[], bytes] | None = None
    # Fetches the engine's live state before /health, /slots and /metrics answer: replicas of a
    # Ray deployment report over the network; a local engine is read directly (None).
    refresh: Callable[[], Awaitable[None]] | None = None
    server_header: bool = True  # off behind Ray Serve, whose HTTP proxy sends its own
    started: float = field(default_factory=time.time)

    @property
    def fingerprint(self) -> str:
        return f"b{self.version}-spekula"  # llama-server's build-string form: "b<build>-<commit>"

    def attach(self, engine: ServingEngine, service: GenerationService) -> None:
        self.engine, self.service = engine, service

    def ready(self) -> ServingEngine:
        if self.engine is None:
            raise HttpError("Loading model", "unavailable_error")
        return self.engine

    async def live(self) -> ServingEngine:
        """The engine, with its reported state fresh."""
        engine = self.ready()
        if self.refresh is not None:
            await self.refresh()
        return engine

    async def read_json(self, request: Request) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise HttpError(f"request body of {declared} bytes is over the limit of {self.max_body_bytes}",
                            "payload_too_large_error")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise HttpError(f"request body is over the limit of {self.max_body_bytes} bytes",
                                "payload_too_large_error")
            chunks.append(chunk)
        raw = b"".join(chunks)
        del chunks
        if not raw.strip():
            return {}
        try:
            decoded = await decode_json(raw)
        except RpcError as exc:
            raise HttpError(f"invalid JSON body: {exc.message.removeprefix('parse error: ')}") from None
        if decoded.not_unicode_at is not None:
            raise HttpError(not_unicode_message(decoded.not_unicode_at))
        return decoded.value

    def render_chat(self, messages: Any, opts: HttpOptions | None = None, *, allow_empty: bool = False) -> str:
        """The prompt text of a chat. The request's `tools` and `chat_template_kwargs` go to the template,
        as llama-server's jinja path does (the reply's calls are parsed by the route, frontends/schema/chat_reply.py).
        A final assistant message is continued (a prefill) unless the server runs with
        --no-prefill-assistant; `continue_final_message` insists on one."""
        engine = self.ready()
        opts = opts or HttpOptions()
        try:
            msgs = chat_messages(messages, allow_empty=allow_empty)
        except MessagesError as exc:
            raise HttpError(str(exc)) from None
        template = opts.template
        try:
            return chat_prompt(engine.tokenizer, msgs, add_generation_prompt=template.add_generation_prompt,
                               continue_final=template.continue_final, prefill=self.service.defaults.prefill_assistant,
                               **template.variables())
        except ChatTemplateError as exc:
            raise HttpError(f"'messages': {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a template error is about the caller's messages
            raise HttpError(f"'messages': chat template failed: {exc}") from None

    def special_text(self, kind: str) -> str:
        engine = self.ready()
        tid = getattr(engine.tokenizer, f"{kind}_id", None)
        return engine.tokenizer.token_text(tid) if tid is not None else ""
