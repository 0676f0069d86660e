"""The Textual app driven by Pilot: typing a prompt streams a coloured answer and the statistics update."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import rpc_fakes as fakes
from rich.control import strip_control_codes

from spekula.frontends.tui.app import EmbeddedSource, SpekulaApp
from spekula.frontends.tui.widgets import (
    AnswerView,
    DrafterTable,
    SlotsTable,
    adaptive_cells,
    drafter_style,
    split_pieces,
)


async def wait_for(pilot: Any, cond: Any, timeout: float = 60.0) -> None:
    with anyio.fail_after(timeout):
        while not cond():
            await pilot.pause(0.05)


async def type_prompt_and_wait(app: SpekulaApp, prompt: str, timeout: float = 60.0) -> Any:
    async with app.run_test(size=(140, 40)) as pilot:
        await wait_for(pilot, lambda: app.ready, timeout)
        await pilot.click("#prompt")
        await pilot.press(*prompt, "enter")
        await wait_for(pilot, lambda: app.last_result is not None, timeout)
        updates = app.n_stats_updates
        await wait_for(pilot, lambda: app.n_stats_updates > updates, timeout)  # the poll after the answer
        return {
            "answer": app.query_one(AnswerView).text,
            "drafter_rows": app.query_one(DrafterTable).row_count,
            "slot_rows": app.query_one(SlotsTable).row_count,
            "result": app.last_result,
            "status": app.status,
        }


def test_split_pieces_colours_tokens_or_falls_back() -> None:
    assert split_pieces("abc", ["a", "bc"], ["ngram-mod", None]) == [("a", "ngram-mod"), ("bc", None)]
    # pieces that do not spell the content (held-back text): the chunk takes its last token's origin
    assert split_pieces("ab", ["a", "bc"], ["ngram-mod", None]) == [("ab", None)]
    assert drafter_style("ngram-mod") != drafter_style("ngram-simple") != drafter_style(None)


def test_the_drafter_table_says_what_the_cost_model_decided() -> None:
    assert adaptive_cells({"gen_tokens": 5}) == ("-", "-")  # fixed lengths, or nothing decided yet
    decided = {"rounds": 40, "shortened": 7, "skipped": 12, "predicted_gain": 1.5, "measured_gain": 1.25}
    assert adaptive_cells({"adaptive": decided}) == ("7/12", "1.5/1.2")
    assert len(DrafterTable.COLUMNS) == 9


def test_prompt_streams_answer_and_updates_stats_fake_engine() -> None:
    app = SpekulaApp(EmbeddedSource(lambda: fakes.FakeEngine()), n_predict=20, poll_interval=0.1)
    out = anyio.run(type_prompt_and_wait, app, "hello")
    assert out["result"]["content"] == out["answer"].plain
    assert out["answer"].plain == fakes.expected_text("<user>hello\n<assistant>", 20)
    styles = {span.style for span in out["answer"].spans}
    assert drafter_style("ngram-mod") in styles and drafter_style(None) in styles
    assert out["drafter_rows"] == 1 and out["slot_rows"] == 2
    assert out["status"].startswith("done")


def test_prompt_streams_answer_real_engine_tiny_model() -> None:
    """The embedded engine for real (torch backend, tiny llama fixture, ngram-simple)."""
    from spekula.fixtures.tiny_gguf import tiny_model_path
    from spekula.frontends.cli.main import build_parser
    from spekula.frontends.cli.options import build_engine, sampling_from_args
    from spekula.frontends.schema.completion import ServerDefaults

    argv = ["tui", "-m", str(tiny_model_path("llama")), "--spec-type", "ngram-simple",
            "--spec-ngram-simple-size-n", "2", "--temp", "0", "-c", "256"]
    args = build_parser(argv).parse_args(argv)
    source = EmbeddedSource(lambda: build_engine(args), ServerDefaults(sampling=sampling_from_args(args)))
    app = SpekulaApp(source, n_predict=48, poll_interval=0.2)

    async def drive() -> dict[str, Any]:
        async with app.run_test(size=(140, 40)) as pilot:
            await wait_for(pilot, lambda: app.ready)
            app.query_one("#mode").value = "completion"  # type: ignore[attr-defined]
            await pilot.click("#prompt")
            await pilot.press(*"the cat sat on the mat. the cat sat on", "enter")
            await wait_for(pilot, lambda: app.last_result is not None)
            updates = app.n_stats_updates
            await wait_for(pilot, lambda: app.n_stats_updates > updates)
            return {"answer": app.query_one(AnswerView).text, "result": app.last_result,
                    "drafter_rows": app.query_one(DrafterTable).row_count,
                    "drafter_row": [str(c) for c in app.query_one(DrafterTable).get_row_at(0)],
                    "stats": app.query_one(DrafterTable).stats,
                    "slot_rows": app.query_one(SlotsTable).row_count}

    out = anyio.run(drive)
    assert out["result"]["tokens_predicted"] > 0
    # Rich drops control characters on display (a random tiny model emits some).
    assert out["answer"].plain == strip_control_codes(out["result"]["content"])
    assert out["drafter_rows"] == 1 and out["slot_rows"] == 1  # ngram-simple was asked: its row is there
    assert out["drafter_row"][-2:] == list(adaptive_cells(out["stats"]["ngram-simple"]))


def test_attached_to_server_controls_reach_the_request_and_escape_cancels(tmp_path: Path) -> None:
    """RemoteSource against an in-process socket server: spec type and n_max go into the next request."""
    import anyio.from_thread

    from spekula.frontends.rpc.methods import SpekulaMethods
    from spekula.frontends.rpc.server import RpcServer, ServerConfig
    from spekula.frontends.tui.app import RemoteSource

    engine = fakes.FakeEngine(round_delay=0.02)
    sock = str(tmp_path / "tui.sock")
    server = RpcServer(engine, ServerConfig(sock, handle_signals=False),
                       lambda srv: SpekulaMethods(engine, server_state=srv.state).table())

    async def drive(app: SpekulaApp) -> None:
        async with app.run_test(size=(140, 40)) as pilot:
            await wait_for(pilot, lambda: app.ready, 20)
            app.query_one("#spec-type").value = "ngram-simple"  # type: ignore[attr-defined]
            app.query_one("#mode").value = "completion"  # type: ignore[attr-defined]
            await pilot.click("#n-max")
            await pilot.press("5")
            await pilot.click("#prompt")
            await pilot.press(*"abc", "enter")
            await wait_for(pilot, lambda: app.last_result is not None, 20)
            assert app.last_result["content"] == fakes.expected_text("abc", 12)
            app.n_predict = 100_000
            await pilot.press("enter")  # the same prompt again, long this time
            await wait_for(pilot, lambda: bool(engine.active), 20)
            await pilot.press("escape")
            await wait_for(pilot, lambda: not engine.active, 20)

    with anyio.from_thread.start_blocking_portal() as portal:
        future, _ = portal.start_task(server.serve)
        try:
            anyio.run(drive, SpekulaApp(RemoteSource(sock), n_predict=12, poll_interval=0.1))
        finally:
            portal.call(server.shutdown)
            future.result(timeout=10)
    first, second = engine.submitted
    assert first.spec is not None and first.spec.types == ("ngram-simple",) and first.spec.n_max == 5
    assert first.prompt == list(b"abc")
    assert engine.finished[-1].stop_type == "cancel" and len(engine.finished[-1].tokens) < 100_000
