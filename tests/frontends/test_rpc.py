"""RPC layer over in-memory streams: framing, dispatch, error boundary, cancel, batches, params."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import rpc_fakes as fakes
from rpc_peer import connected, run

from spekula.frontends.rpc import protocol as p


def test_completion_returns_engine_content() -> None:
    async def body() -> None:
        engine = fakes.FakeEngine()
        async with connected(engine) as peer:
            msg = await peer.call("completion", {"prompt": "hello", "n_predict": 7, "return_tokens": True})
            assert msg["id"] == 1
            assert msg["result"]["content"] == fakes.expected_text("hello", 7)
            assert msg["result"]["tokens"] == list(b"hellohe")
            assert msg["result"]["stop_type"] == "limit"
            assert not peer.notes  # not streaming: no chunks
            # ... and the engine was told so: it sends such a request its final event alone.
            assert [h.wants_pieces for h in engine.handles] == [False]

    run(body)


def test_stream_chunks_concatenate_to_final_and_carry_drafters() -> None:
    async def body() -> None:
        engine = fakes.FakeEngine()
        async with connected(engine) as peer:
            msg = await peer.call("completion", {"prompt": "abcd", "n_predict": 10, "stream": True}, rid="s1")
            chunks = [n["params"] for n in peer.notes]
            assert all(n["method"] == "completion.chunk" for n in peer.notes)
            assert all(c["id"] == "s1" and c["request_id"] == msg["result"]["request_id"] for c in chunks)
            assert "".join(c["content"] for c in chunks) == msg["result"]["content"] == fakes.expected_text("abcd", 10)
            assert all(len(c["drafters"]) == len(c["tokens"]) for c in chunks)
            assert {d for c in chunks for d in c["drafters"]} == {"ngram-mod", None}
            assert [h.wants_pieces for h in engine.handles] == [True]

    run(body)


def test_protocol_errors_leave_connection_usable() -> None:
    async def body() -> None:
        async with connected(fakes.FakeEngine(), max_bytes=4096) as peer:
            await peer.raw(b"{not json\n")
            assert (await peer.reply())["error"]["code"] == p.PARSE_ERROR
            await peer.send({"jsonrpc": "1.0", "method": "health", "id": 3})
            msg = await peer.reply()
            assert msg["error"]["code"] == p.INVALID_REQUEST and msg["id"] == 3
            await peer.send({"jsonrpc": "2.0", "method": 5, "id": 4})
            assert (await peer.reply())["error"]["code"] == p.INVALID_REQUEST
            await peer.send("just a string")
            assert (await peer.reply())["error"]["code"] == p.INVALID_REQUEST
            msg = await peer.call("no.such.method", rid=5)
            assert msg["error"]["code"] == p.METHOD_NOT_FOUND and "no.such.method" in msg["error"]["message"]
            await peer.raw(b'{"jsonrpc":"2.0","method":"health","id":6,"pad":"' + b"x" * 10_000 + b'"}\n')
            msg = await peer.reply()
            assert msg["error"]["code"] == p.INVALID_REQUEST and "4096" in msg["error"]["message"]
            msg = await peer.call("health", rid=7)
            assert msg["id"] == 7 and msg["result"]["status"] == "ok"

    run(body)


def test_invalid_params_name_the_field() -> None:
    cases = [
        ({"prompt": "x", "top_k": "many"}, "top_k"),
        ({"prompt": "x", "temprature": 0.5}, "temprature"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": [1, 2, 999]}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x", "speculative.n_max": -1}, "speculative.n_max"),
        ({"prompt": "x", "speculative": {"type": "ngram-bogus"}}, "speculative.type"),
        ({"prompt": "x", "stop": [1]}, "stop"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ]

    async def body() -> None:
        async with connected(fakes.FakeEngine()) as peer:
            for i, (params, field) in enumerate(cases):
                msg = await peer.call("completion", params, rid=i)
                assert msg["error"]["code"] == p.INVALID_PARAMS, (params, msg)
                assert field in msg["error"]["message"], (params, msg)
            msg = await peer.call("chat.completion", {"messages": [{"role": "user"}]}, rid=99)
            assert msg["error"]["code"] == p.INVALID_PARAMS and "messages[0]" in msg["error"]["message"]
            assert "result" in await peer.call("completion", {"prompt": "ok", "n_predict": 2}, rid=100)

    run(body)


def test_speculative_params_nested_and_flat() -> None:
    async def body() -> None:
        engine = fakes.FakeEngine()
        async with connected(engine) as peer:
            await peer.call("completion", {"prompt": "a", "n_predict": 1, "speculative": {"n_max": 5, "type": ["ngram-simple", "ngram-mod"]}})
            await peer.call("completion", {"prompt": "a", "n_predict": 1, "speculative.n_min": 2, "speculative.p_min": 0.5,
                                           "speculative.type": "none"}, rid=2)
            await peer.call("completion", {"prompt": "a", "n_predict": 1, "temperature": 0, "seed": 4}, rid=3)
        first, second, third = engine.submitted
        assert first.spec.n_max == 5 and first.spec.types == ("ngram-simple", "ngram-mod")
        assert second.spec.n_min == 2 and second.spec.p_min == 0.5 and second.spec.types == ()
        assert third.spec is None and third.sampling.temperature == 0.0 and third.sampling.seed == 4

    run(body)


def test_batch_replies_only_to_requests() -> None:
    async def body() -> None:
        async with connected(fakes.FakeEngine()) as peer:
            await peer.send([
                p.request("health", None, 1),
                {"jsonrpc": "2.0", "method": "health"},  # a notification: no reply
                p.request("nope", None, 2),
                p.request("tokenize", {"content": "hi"}, 3),
            ])
            replies = {r["id"]: r for r in await peer.reply()}
            assert set(replies) == {1, 2, 3}
            assert replies[2]["error"]["code"] == p.METHOD_NOT_FOUND
            assert replies[3]["result"]["tokens"] == [104, 105]
            await peer.send([])
            assert (await peer.reply())["error"]["code"] == p.INVALID_REQUEST

    run(body)


def test_cancel_by_rpc_id_and_by_request_id() -> None:
    async def body() -> None:
        engine = fakes.FakeEngine(round_delay=0.05)
        async with connected(engine) as peer:
            await peer.send(p.request("completion", {"prompt": "abc", "n_predict": 10_000, "stream": True}, "long"))
            while not peer.notes:  # wait until it is generating
                peer.notes.append(await peer.recv())
            await peer.send(p.request("cancel", {"id": "long"}, "c"))
            got = {}
            while len(got) < 2:
                msg = await peer.reply()
                got[msg["id"]] = msg
            assert got["c"]["result"] == {"cancelled": True}
            assert got["long"]["result"]["stop_type"] == "cancel"
            assert len(got["long"]["result"]["content"]) < 10_000
            # By engine request id, from the chunk notification.
            peer.notes.clear()
            await peer.send(p.request("completion", {"prompt": "xyz", "n_predict": 10_000, "stream": True}, "l2"))
            first = await peer.recv()
            await peer.send(p.request("cancel", {"request_id": first["params"]["request_id"]}, "c2"))
            got = {}
            while len(got) < 2:
                msg = await peer.reply()
                got[msg["id"]] = msg
            assert got["l2"]["result"]["stop_type"] == "cancel"
            msg = await peer.call("cancel", {"id": "gone"}, rid="c3")
            assert msg["result"] == {"cancelled": False}
            msg = await peer.call("cancel", {}, rid="c4")
            assert msg["error"]["code"] == p.INVALID_PARAMS

    run(body)


def test_duplicate_in_flight_id_is_refused() -> None:
    async def body() -> None:
        engine = fakes.FakeEngine(round_delay=0.05)
        async with connected(engine) as peer:
            await peer.send(p.request("completion", {"prompt": "abc", "n_predict": 30}, 7))
            await anyio.sleep(0.05)
            await peer.send(p.request("health", None, 7))
            first = await peer.reply()
            assert first["error"]["code"] == p.DUPLICATE_ID
            assert (await peer.reply())["result"]["content"] == fakes.expected_text("abc", 30)

    run(body)


def test_prompt_longer_than_context_fails_alone() -> None:
    async def body() -> None:
        engine = fakes.FakeEngine(fakes.FakeConfig(n_ctx=64))
        async with connected(engine) as peer:
            await peer.send(p.request("completion", {"prompt": "ok", "n_predict": 20}, 1))
            await peer.send(p.request("completion", {"prompt": "y" * 64}, 2))
            got = {}
            while len(got) < 2:
                msg = await peer.reply()
                got[msg["id"]] = msg
            assert got[2]["error"]["code"] == p.CONTEXT_OVERFLOW and "64" in got[2]["error"]["message"]
            assert got[1]["result"]["content"] == fakes.expected_text("ok", 20)

    run(body)


def test_disconnect_cancels_in_flight_request() -> None:
    async def body() -> None:
        engine = fakes.FakeEngine(round_delay=0.02)
        async with connected(engine) as peer:
            await peer.send(p.request("completion", {"prompt": "abc", "n_predict": 10_000, "stream": True}, 1))
            await peer.recv()
            await peer._send.aclose()  # the client goes away mid-stream
            with anyio.fail_after(2):
                while not engine.finished:
                    await anyio.sleep(0.01)
            assert engine.finished[0].stop_type == "cancel"
            assert not engine.active

    run(body)


def test_chat_and_tokenizer_methods() -> None:
    async def body() -> None:
        async with connected(fakes.FakeEngine()) as peer:
            msg = await peer.call("chat.completion", {"messages": [{"role": "user", "content": "hi"}], "n_predict": 4})
            res = msg["result"]
            assert res["message"] == {"role": "assistant", "content": res["content"]}
            assert res["content"] == fakes.expected_text("<user>hi\n<assistant>", 4)
            assert res["finish_reason"] == "length"
            history = [{"role": "user", "content": "w?"},  # an agent's history, as the HTTP chat takes it
                       {"role": "assistant", "content": None,
                        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                       {"role": "tool", "tool_call_id": "c", "content": "42"}]
            assert "result" in await peer.call("chat.completion", {"messages": history, "n_predict": 2}, rid=4)
            msg = await peer.call("chat.completion", {"messages": [{"role": "user", "content": "hi"}], "n_predict": 4,
                                                      "tools": [{"type": "function", "function": {"name": "f"}}],
                                                      "tool_choice": "none",
                                                      "chat_template_kwargs": {"enable_thinking": False}}, rid=6)
            assert msg["result"]["content"] == fakes.expected_text(
                "<vars ['enable_thinking', 'tools']><user>hi\n<assistant>", 4)
            msg = await peer.call("chat.completion", {"messages": [{"role": "user", "content": "hi"}], "n_predict": 4,
                                                      "add_generation_prompt": False}, rid=7)
            assert msg["result"]["content"] == fakes.expected_text("<user>hi\n", 4)
            # llama-server's "content" form of continue_final_message, read as the HTTP chat reads it.
            reply = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "He"}]
            msg = await peer.call("chat.completion", {"messages": reply, "n_predict": 2,
                                                      "continue_final_message": "content"}, rid=9)
            assert "result" in msg, msg
            msg = await peer.call("chat.completion", {"messages": reply, "continue_final_message": "reasoning_content"},
                                  rid=10)
            assert msg["error"]["code"] == p.INVALID_PARAMS  # named as itself, not as a failed template:
            assert msg["error"]["message"].startswith("'continue_final_message': "), msg
            for bad, word in (({"chat_template_kwargs": {"messages": 1}}, "messages"), ({"tools": "x"}, "tools"),
                              ({"continue_final_message": True}, "continue_final_message")):
                msg = await peer.call("chat.completion", {"messages": [{"role": "user", "content": "hi"}], **bad}, rid=8)
                assert msg["error"]["code"] == p.INVALID_PARAMS and word in msg["error"]["message"], msg
            msg = await peer.call("chat.completion", {"messages": [{"role": "user", "content": "x", "mood": 1}]}, rid=5)
            assert msg["error"]["code"] == p.INVALID_PARAMS and "mood" in msg["error"]["message"]
            msg = await peer.call("tokenize", {"content": "é", "with_pieces": True}, rid=2)
            assert [t["id"] for t in msg["result"]["tokens"]] == list("é".encode())
            msg = await peer.call("detokenize", {"tokens": list("é".encode())}, rid=3)
            assert msg["result"]["content"] == "é"
            for i, method in enumerate(("stats", "slots", "health", "props")):
                assert "result" in await peer.call(method, None, rid=10 + i)
            msg = await peer.call("health", [1], rid=20)
            assert msg["error"]["code"] == p.INVALID_PARAMS

    run(body)


def test_long_token_lists_are_checked_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A list of a few million ids takes a noticeable time to check: never on the loop that serves
    every other client. Short lists stay on the loop (a thread hop would cost more than the check)."""
    import threading

    from spekula.frontends.schema import completion as schema

    checked_on: list[int] = []
    real = schema.get_token_list

    def recording(value: Any, name: str, n_vocab: int) -> list[int]:
        checked_on.append(threading.get_ident())
        return real(value, name, n_vocab)

    monkeypatch.setattr(schema, "get_token_list", recording)

    async def body() -> None:
        loop_thread = threading.get_ident()
        async with connected(fakes.FakeEngine()) as peer:
            long_ids = [7] * 70_000
            await peer.call("detokenize", {"tokens": long_ids})
            await peer.call("completion", {"prompt": long_ids, "n_predict": 1})
            assert checked_on and all(t != loop_thread for t in checked_on)
            checked_on.clear()
            reply = await peer.call("detokenize", {"tokens": [7, 7]})
            assert reply["result"]["content"] == "\x07\x07"
            assert checked_on == [loop_thread]

    run(body, timeout=60)


def test_chat_reasoning_budget_fields() -> None:
    """A positive budget reaches the engine as the template's tags in tokens; a bad one names its field."""
    engine = fakes.FakeEngine()
    engine.tokenizer.chat_template = "{{ '<think>' }}"  # type: ignore[attr-defined]  # a template that reasons

    async def body() -> None:
        async with connected(engine) as peer:
            hi = {"messages": [{"role": "user", "content": "hi"}], "n_predict": 2}
            msg = await peer.call("chat.completion", {**hi, "reasoning_budget_tokens": 5,
                                                      "reasoning_budget_message": "ok"})
            assert "result" in msg, msg
            budget = engine.submitted[-1].reasoning_budget
            assert budget is not None and budget.budget == 5 and budget.start == tuple(b"<think>")
            assert budget.forced == tuple(b"ok</think>") and budget.ends == (tuple(b"</think>"),)
            msg = await peer.call("chat.completion", {**hi, "thinking_budget_tokens": 3}, rid=2)
            assert engine.submitted[-1].reasoning_budget.budget == 3  # type: ignore[union-attr]
            msg = await peer.call("chat.completion", hi, rid=3)
            assert engine.submitted[-1].reasoning_budget is None  # the server's: unlimited
            msg = await peer.call("chat.completion", {**hi, "reasoning_budget_tokens": -3}, rid=4)
            assert msg["error"]["code"] == p.INVALID_PARAMS and "'reasoning_budget_tokens'" in msg["error"]["message"]

    run(body)
