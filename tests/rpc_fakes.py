"""A small in-process engine with the Engine API's shape (docs/architecture.md, "The interfaces between layers"), for the frontend tests.

Shared by tests/test_rpc.py, test_server.py, test_client.py and test_tui.py (tests/conftest.py puts tests/ on sys.path).

Its "model" echoes the prompt cyclically, a few tokens per round, so results are predictable and
tests can check content exactly. It honours n_slots (extra requests queue), cancel, and n_predict.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from spekula.core.events import Event, FinalEvent, PieceEvent
from spekula.core.params import CompletionRequest, SpecParams


class ByteTokenizer:
    """Token id = UTF-8 byte; enough to exercise tokenize/detokenize and chat templating."""

    n_vocab = 256
    bos_id = None
    eos_id = None

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], *, skip_special: bool = False) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True,
                            **variables: object) -> str:
        text = f"<vars {sorted(variables)}>" if variables else ""
        text += "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass
class FakeConfig:
    n_slots: int = 2
    n_ctx: int = 256
    spec: SpecParams = field(default_factory=lambda: SpecParams(types=("ngram-mod",)))
    embeddings_only: bool = False


def expected_text(prompt: str, n_predict: int) -> str:
    data = prompt.encode("utf-8")
    return bytes(data[i % len(data)] for i in range(n_predict)).decode("utf-8", errors="replace")


class FakeHandle:
    def __init__(self, request: CompletionRequest, engine: FakeEngine) -> None:
        self.id = request.id
        self.request = request
        self._engine = engine
        self._send, self._receive = anyio.create_memory_object_stream[Event](1024)
        self.cancelled = False
        self.wants_pieces = True  # as the real outbox: final_only() stops the pieces

    def __aiter__(self) -> Any:
        return self._events()

    async def _events(self) -> Any:
        async with self._receive:
            async for ev in self._receive:
                yield ev
                if isinstance(ev, FinalEvent):
                    return

    def final_only(self) -> None:
        self.wants_pieces = False

    def cancel(self) -> None:
        self._engine.cancel(self.id)


class FakeEngine:
    def __init__(self, config: FakeConfig | None = None, *, round_delay: float = 0.01, per_round: int = 3) -> None:
        self.tokenizer = ByteTokenizer()
        self.config = config or FakeConfig()
        self.round_delay = round_delay
        self.per_round = per_round
        self.submitted: list[CompletionRequest] = []
        self.cancelled: set[str] = set()
        self.active: dict[str, FakeHandle] = {}
        self.handles: list[FakeHandle] = []  # every request submitted, in order
        self._queue_send, self._queue_recv = anyio.create_memory_object_stream[FakeHandle](1000)
        self._limiter = anyio.CapacityLimiter(self.config.n_slots)
        self._n = 0
        self.finished: list[FinalEvent] = []

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            task_status.started()
            async for handle in self._queue_recv:
                tg.start_soon(self._generate, handle)

    def submit(self, req: CompletionRequest) -> FakeHandle:
        self._n += 1
        req.id = req.id or f"req-{self._n}"
        self.submitted.append(req)
        handle = FakeHandle(req, self)
        self.handles.append(handle)
        self.active[req.id] = handle
        self._queue_send.send_nowait(handle)
        return handle

    def cancel(self, request_id: str) -> bool:
        if request_id not in self.active:
            return False
        self.cancelled.add(request_id)
        return True

    async def _generate(self, h: FakeHandle) -> None:
        req = h.request
        out: list[int] = []
        n_predict = req.n_predict if req.n_predict >= 0 else 32
        stop = "limit"
        send: MemoryObjectSendStream[Event] = h._send
        async with self._limiter, send:
            while len(out) < n_predict:
                if h.id in self.cancelled:
                    stop = "cancel"
                    break
                await anyio.sleep(self.round_delay)
                take = min(self.per_round, n_predict - len(out))
                toks = [req.prompt[(len(out) + i) % len(req.prompt)] for i in range(take)]
                out += toks
                drafters: list[str | None] = ["ngram-mod"] * (take - 1) + [None]
                try:
                    if h.wants_pieces:
                        await send.send(PieceEvent(h.id, toks, bytes(toks).decode("utf-8", "replace"), drafters))
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    stop = "cancel"
                    break
            final = FinalEvent(h.id, bytes(out).decode("utf-8", "replace"), out, stop,  # type: ignore[arg-type]
                               timings={"predicted_n": len(out)}, tokens_evaluated=len(req.prompt))
            self.finished.append(final)
            self.active.pop(h.id, None)
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await send.send(final)

    def stats(self) -> dict[str, Any]:
        # The real engine's shape (core/stats/spec_stats.py), with made-up numbers.
        ngram = {"calls_begin": 1, "calls_draft": 4, "calls_accept": 4, "gen_drafts": 4, "acc_drafts": 3,
                 "gen_tokens": 12, "acc_tokens": 7, "mean_acc_len": 2.75, "acc_per_pos": [3, 3, 1]}
        return {"drafters": {"ngram-mod": ngram}, "histogram": [1, 0, 2, 1], "acc_per_pos": [3, 3, 1],
                "n_rounds": 4, "mean_acc_len": 2.75, "n_requests": len(self.finished)}

    def slots(self) -> list[dict[str, Any]]:
        busy = list(self.active)
        return [{"id": i, "state": "generating" if i < len(busy) else "idle"} for i in range(self.config.n_slots)]

    def health(self) -> dict[str, Any]:
        busy = min(len(self.active), self.config.n_slots)
        return {"status": "ok", "slots_idle": self.config.n_slots - busy, "slots_busy": busy,
                "queued": max(0, len(self.active) - self.config.n_slots)}

    def props(self) -> dict[str, Any]:
        return {"model": {"name": "fake"}, "n_slots": self.config.n_slots, "n_ctx": self.config.n_ctx}
