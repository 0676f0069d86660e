"""`spekula tui`: a Textual app that streams answers and shows what the drafters are doing.

The app talks to a `Source`: `RemoteSource` is a client of a running `spekula serve`; `EmbeddedSource`
runs an Engine in-process and calls the same JSON-RPC method implementations directly, so both
modes see identical request and result shapes. All I/O happens in workers; handlers only move
message data into widget reactives.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import TaskStatus
from textual import on, work
from textual.app import App, ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.reactive import reactive
from textual.widgets import Footer, Header, Input, Label, Select

from spekula.core.drafting.registry import builtin_spec_types
from spekula.frontends.rpc.client import AsyncCompletionStream, AsyncSpekulaClient
from spekula.frontends.rpc.dispatch import CallContext, Handler
from spekula.frontends.rpc.methods import SpekulaMethods
from spekula.frontends.schema.completion import ServerDefaults
from spekula.frontends.tui.messages import (
    GenerationDone,
    GenerationFailed,
    GenerationStarted,
    PieceReceived,
    SourceFailed,
    SourceReady,
    StatsUpdated,
    ThroughputSample,
)
from spekula.frontends.tui.widgets import (
    AcceptanceHistogram,
    AnswerView,
    DrafterTable,
    Legend,
    RateSparkline,
    SlotsTable,
    Throughput,
)

if TYPE_CHECKING:
    from spekula.core.engine.engine import Engine

ChunkCallback = Callable[[dict[str, Any]], Awaitable[None]]
DEFAULT_SPEC = "__server__"


class Source(ABC):
    @abstractmethod
    async def run(self, *, task_status: TaskStatus[dict[str, Any]] = anyio.TASK_STATUS_IGNORED) -> None:
        """Connect or start; report `props` through task_status; then stay up until cancelled."""

    @abstractmethod
    async def call(self, method: str, params: dict[str, Any] | None = None) -> Any: ...

    @abstractmethod
    async def stream(self, method: str, params: dict[str, Any], on_chunk: ChunkCallback) -> dict[str, Any]: ...


class RemoteSource(Source):
    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.client: AsyncSpekulaClient | None = None

    async def run(self, *, task_status: TaskStatus[dict[str, Any]] = anyio.TASK_STATUS_IGNORED) -> None:
        async with AsyncSpekulaClient.connect(self.socket_path) as client:
            self.client = client
            task_status.started(await client.props())
            await anyio.sleep_forever()

    async def call(self, method: str, params: dict[str, Any] | None = None) -> Any:
        assert self.client is not None
        return await self.client.call(method, params)

    async def stream(self, method: str, params: dict[str, Any], on_chunk: ChunkCallback) -> dict[str, Any]:
        assert self.client is not None
        stream = AsyncCompletionStream(self.client, method, {**params, "stream": True})
        async for chunk in stream:
            await on_chunk(chunk)
        assert stream.result is not None
        return stream.result


class EmbeddedSource(Source):
    """An in-process engine. `factory` may load a model for seconds, so it runs in a thread."""

    def __init__(self, factory: Callable[[], Engine], defaults: ServerDefaults | None = None) -> None:
        self.factory = factory
        self.defaults = defaults
        self.engine: Engine | None = None
        self._table: dict[str, Handler] = {}

    async def run(self, *, task_status: TaskStatus[dict[str, Any]] = anyio.TASK_STATUS_IGNORED) -> None:
        self.engine = await anyio.to_thread.run_sync(self.factory)
        self._table = SpekulaMethods(self.engine, self.defaults, server_state=lambda: {"mode": "embedded"}).table()
        async with anyio.create_task_group() as tg:
            await tg.start(self.engine.run)
            task_status.started(await self.call("props"))
            await anyio.sleep_forever()

    async def _noop(self, method: str, params: dict[str, Any]) -> None:
        return None

    async def call(self, method: str, params: dict[str, Any] | None = None) -> Any:
        return await self._table[method](params, CallContext(id=None, notify=self._noop))

    async def stream(self, method: str, params: dict[str, Any], on_chunk: ChunkCallback) -> dict[str, Any]:
        async def notify(_method: str, chunk: dict[str, Any]) -> None:
            await on_chunk(chunk)

        return await self._table[method]({**params, "stream": True}, CallContext(id=1, notify=notify))


class SpekulaApp(App[None]):
    CSS_PATH = "tui.tcss"
    TITLE = "spekula"
    BINDINGS = [("escape", "stop", "Stop generation"), ("ctrl+l", "clear", "Clear answer"), ("ctrl+q", "quit", "Quit")]

    generating: reactive[bool] = reactive(False)
    status: reactive[str] = reactive("starting…")

    def __init__(self, source: Source, *, n_predict: int | None = None, poll_interval: float = 0.5,
                 sampling: dict[str, Any] | None = None, initial_prompt: str | None = None) -> None:
        super().__init__()
        self.source = source
        self.n_predict = n_predict  # None: the engine's default
        self.initial_prompt = initial_prompt
        self.poll_interval = poll_interval
        self.sampling = sampling or {}
        self.ready = False
        self.request_id: str | None = None
        self.last_result: dict[str, Any] | None = None
        self.n_stats_updates = 0

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            with Vertical(id="left"):
                with Horizontal(id="controls"):
                    yield Select([("chat", "chat"), ("completion", "completion")], value="chat",
                                 allow_blank=False, id="mode")
                    yield Select([("server default", DEFAULT_SPEC)], value=DEFAULT_SPEC, allow_blank=False,
                                 id="spec-type")
                    yield Input(placeholder="n_max", type="integer", id="n-max", tooltip="draft length cap for the next request")
                yield Input(placeholder="Type a prompt and press Enter", id="prompt")
                with VerticalScroll(id="answer-scroll"):
                    yield AnswerView(id="answer")
                yield Legend(id="legend")
                yield Label(id="status")
            with Vertical(id="right"):
                yield Label("throughput", classes="title")
                yield Throughput(id="throughput")
                yield RateSparkline([], id="sparkline")
                yield Label("drafters", classes="title")
                yield DrafterTable(id="drafters")
                yield AcceptanceHistogram(id="histogram")
                yield Label("slots", classes="title")
                yield SlotsTable(id="slots")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#prompt", Input).focus()
        self.start_source()
        self.set_interval(self.poll_interval, self.poll_stats)

    def watch_status(self, status: str) -> None:
        self.query_one("#status", Label).update(status)

    # -- workers -------------------------------------------------------------------------------

    @work(exclusive=True, group="source")
    async def start_source(self) -> None:
        try:
            async with anyio.create_task_group() as tg:
                props = await tg.start(self.source.run)
                self.post_message(SourceReady(props or {}))
        except Exception as exc:  # noqa: BLE001 - shown in the UI rather than crashing it
            self.post_message(SourceFailed(f"{type(exc).__name__}: {exc}"))

    @work(exclusive=True, group="stats")
    async def poll_stats(self) -> None:
        if not self.ready:
            return
        try:
            stats = await self.source.call("stats")
            slots = await self.source.call("slots")
            health = await self.source.call("health")
        except Exception as exc:  # noqa: BLE001
            self.status = f"stats unavailable: {exc}"
            return
        self.post_message(StatsUpdated(stats, slots, health))

    @work(exclusive=True, group="generate")
    async def generate(self, method: str, params: dict[str, Any]) -> None:
        self.post_message(GenerationStarted(params))
        window_tokens, window_start = 0, time.monotonic()
        self.request_id = None
        finished = False

        async def on_chunk(chunk: dict[str, Any]) -> None:
            nonlocal window_tokens, window_start
            self.request_id = chunk.get("request_id", self.request_id)
            self.post_message(PieceReceived(chunk.get("content", ""), chunk.get("pieces", []), chunk.get("drafters", [])))
            window_tokens += len(chunk.get("tokens", []))
            now = time.monotonic()
            if now - window_start >= 0.25:
                self.post_message(ThroughputSample(window_tokens / (now - window_start)))
                window_tokens, window_start = 0, now

        try:
            result = await self.source.stream(method, params, on_chunk)
            finished = True
            self.post_message(GenerationDone(result))
        except Exception as exc:  # noqa: BLE001
            finished = True
            self.post_message(GenerationFailed(str(exc)))
        finally:
            if not finished and self.request_id:
                # Replaced by a newer prompt or stopped: free the slot on the server as well.
                with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                    await self.source.call("cancel", {"request_id": self.request_id})

    def request(self, prompt: str) -> tuple[str, dict[str, Any]]:
        params: dict[str, Any] = dict(self.sampling)
        if self.n_predict is not None:
            params["n_predict"] = self.n_predict
        spec: dict[str, Any] = {}
        spec_type = self.query_one("#spec-type", Select).value
        if isinstance(spec_type, str) and spec_type != DEFAULT_SPEC:
            spec["type"] = spec_type
        n_max = self.query_one("#n-max", Input).value.strip()
        if n_max:
            try:
                spec["n_max"] = int(n_max)
            except ValueError:
                raise ValueError(f"n_max must be a whole number, got {n_max!r}") from None
        if spec:
            params["speculative"] = spec
        if self.query_one("#mode", Select).value == "chat":
            return "chat.completion", {"messages": [{"role": "user", "content": prompt}], **params}
        return "completion", {"prompt": prompt, **params}

    # -- actions and message handlers -----------------------------------------------------------

    @on(Input.Submitted, "#prompt")
    def submit_prompt(self, event: Input.Submitted) -> None:
        if not event.value.strip():
            return
        self.ask(event.value)

    def ask(self, prompt: str) -> None:
        if not self.ready:
            self.status = "not ready yet"
            return
        try:
            method, params = self.request(prompt)
        except ValueError as exc:
            self.status = f"[red]{exc}[/red]"
            return
        self.generate(method, params)

    def action_stop(self) -> None:
        self.workers.cancel_group(self, "generate")
        self.generating = False
        self.status = "stopped"

    def action_clear(self) -> None:
        self.query_one(AnswerView).clear()
        self.query_one(Legend).counts = {}

    def on_source_ready(self, message: SourceReady) -> None:
        self.ready = True
        props = message.props
        builtin = builtin_spec_types()
        types = props.get("available_drafters") or list(builtin)
        spec_types = [t for t in builtin if t in types] + sorted(set(types) - set(builtin))
        self.query_one("#spec-type", Select).set_options(
            [("server default", DEFAULT_SPEC), ("none", "none"), *((t, t) for t in spec_types)])
        self.query_one("#spec-type", Select).value = DEFAULT_SPEC
        server_types = tuple((props.get("spec") or {}).get("types", ()))
        self.query_one(Legend).drafters = server_types
        model = props.get("model") or {}
        self.sub_title = f"{model.get('name', '?')} · {props.get('n_slots', '?')} slot(s) · spec {','.join(server_types) or 'none'}"
        self.status = "ready"
        self.poll_stats()
        if self.initial_prompt:
            self.query_one("#prompt", Input).value = self.initial_prompt
            self.ask(self.initial_prompt)
            self.initial_prompt = None

    def on_source_failed(self, message: SourceFailed) -> None:
        self.status = f"[red]cannot start: {message.error}[/red]"

    def on_generation_started(self, message: GenerationStarted) -> None:
        self.query_one(AnswerView).clear()
        self.query_one(Legend).counts = {}
        self.query_one(Throughput).final = ""
        self.generating = True
        self.status = "generating…"

    def on_piece_received(self, message: PieceReceived) -> None:
        if not self.query(AnswerView):
            return
        answer = self.query_one(AnswerView)
        answer.append(message.content, message.pieces, message.drafters)
        self.query_one(Legend).counts = dict(answer.counts)
        self.query_one("#answer-scroll", VerticalScroll).scroll_end(animate=False)

    def on_throughput_sample(self, message: ThroughputSample) -> None:
        self.query_one(Throughput).rate = message.tokens_per_s
        self.query_one(RateSparkline).push(message.tokens_per_s)

    def on_generation_done(self, message: GenerationDone) -> None:
        self.last_result = message.result
        self.generating = False
        t = message.result.get("timings", {})
        rate = t.get("predicted_per_second")
        if isinstance(rate, int | float):
            self.query_one(Throughput).rate = float(rate)
            self.query_one(RateSparkline).push(float(rate))
        drafted = t.get("draft_n")
        accepted = t.get("draft_n_accepted")
        spec = f" · drafted {drafted}, accepted {accepted}" if drafted else ""
        self.query_one(Throughput).final = f"{message.result.get('tokens_predicted', 0)} tokens{spec}"
        self.status = f"done ({message.result.get('stop_type')})"
        self.poll_stats()

    def on_generation_failed(self, message: GenerationFailed) -> None:
        self.generating = False
        self.status = f"[red]error: {message.error}[/red]"

    def on_stats_updated(self, message: StatsUpdated) -> None:
        if not self.query(DrafterTable):  # a late poll after the app began to exit
            return
        self.n_stats_updates += 1
        self.query_one(DrafterTable).stats = message.stats.get("drafters", {})
        self.query_one(AcceptanceHistogram).stats = message.stats
        self.query_one(SlotsTable).slots = message.slots
        h = message.health
        self.query_one("#slots", SlotsTable).border_subtitle = (
            f"idle {h.get('slots_idle', '?')} · busy {h.get('slots_busy', '?')} · queued {h.get('queued', '?')}")
