"""POST /slots/{id}?action=save|restore|erase on a real `spekula serve --slot-save-path DIR` (tiny llama, native),
driven as a user would: generate, save, erase, restore into another slot, continue reusing the cache;
then every kind of bad input, each a clear 4xx while the server keeps serving; an action on a busy slot
waits for its request, as llama-server defers it."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from http_helpers import HttpServer, running

from spekula.fixtures.tiny_gguf import tiny_model_path
from spekula.frontends.cli.llama_server_compat import translate

PROMPT = [17, 42, 99, 5, 17, 42, 99, 5, 60, 61, 62, 17, 42]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    base = tmp_path_factory.mktemp("slots")
    with running(tiny_model_path("llama"), "-np", "2", "-c", "256", "-t", "1", "--spec-type", "ngram-simple",
                 "--spec-ngram-simple-size-n", "1", "--slot-save-path", str(base / "saved"),
                 log=base / "server.log") as srv:
        srv.saved = base / "saved"  # type: ignore[attr-defined]
        yield srv


def _complete(server: HttpServer, prompt: list[int], slot: int, n_predict: int = 12, **extra: Any) -> dict[str, Any]:
    status, body = server.post("/completion", {"prompt": prompt, "id_slot": slot, "cache_prompt": True,
                                               "n_predict": n_predict, "temperature": 0, "return_tokens": True,
                                               **extra})
    assert status == 200, body
    return body


def _error(server: HttpServer, path: str, body: Any = None, *, status: int = 400, raw: bytes | None = None) -> str:
    got, _, value = server.call("POST", path, body, raw=raw)
    assert got == status, value
    assert value["error"]["code"] == status
    return str(value["error"]["message"])


def test_save_erase_restore_and_continue_with_the_cache(server: HttpServer) -> None:
    first = _complete(server, PROMPT, 0)
    n_cached = len(PROMPT) + len(first["tokens"]) - 1
    assert first["tokens_cached"] == n_cached
    status, saved = server.post("/slots/0?action=save", {"filename": "turn1.bin"})
    assert status == 200, saved
    assert saved["id_slot"] == 0 and saved["filename"] == "turn1.bin" and saved["n_saved"] == n_cached
    assert saved["n_written"] == (server.saved / "turn1.bin").stat().st_size  # type: ignore[attr-defined]
    assert saved["timings"]["save_ms"] >= 0
    status, erased = server.post("/slots/0?action=erase", None)
    assert (status, erased) == (200, {"id_slot": 0, "n_erased": n_cached})
    assert server.get("/slots")[1][0]["n_cached"] == 0
    status, restored = server.post("/slots/1?action=restore", {"filename": "turn1.bin"})
    assert status == 200, restored
    assert restored["n_restored"] == n_cached and restored["n_read"] == saved["n_written"]
    assert server.get("/slots")[1][1]["n_cached"] == n_cached
    turn2 = [*PROMPT, *first["tokens"], 8, 9, 10]
    second = _complete(server, turn2, 1, 16)
    assert second["timings"]["cache_n"] == n_cached and second["timings"]["prompt_n"] == len(turn2) - n_cached
    assert second["tokens_cached"] == len(turn2) + len(second["tokens"]) - 1
    cold = _complete(server, turn2, 0, 16, cache_prompt=False)
    assert cold["timings"]["cache_n"] == 0 and cold["tokens"] == second["tokens"]
    assert second["timings"].get("draft_n", 0) == cold["timings"].get("draft_n", 0)


@pytest.mark.parametrize("filename", ["../escape.bin", "/etc/passwd", "a/b.bin", "..", "", "x\u0000y", "n" * 300, 5])
def test_file_names_outside_the_directory_are_refused(server: HttpServer, filename: Any) -> None:
    _complete(server, PROMPT, 0, 4)
    assert "Invalid filename" in _error(server, "/slots/0?action=save", {"filename": filename})
    assert "Invalid filename" in _error(server, "/slots/0?action=restore", {"filename": filename})
    assert not (server.saved.parent / "escape.bin").exists()  # type: ignore[attr-defined]


def test_bad_requests_are_refused_and_the_server_keeps_serving(server: HttpServer) -> None:
    saved_dir: Path = server.saved  # type: ignore[attr-defined]
    assert "filename" in _error(server, "/slots/0?action=save", {})
    assert "filename" in _error(server, "/slots/0?action=restore", None)
    assert "Invalid action" in _error(server, "/slots/0?action=load", {"filename": "a.bin"})
    assert "Invalid action" in _error(server, "/slots/0", {"filename": "a.bin"})
    assert "Invalid slot ID" in _error(server, "/slots/7?action=erase")
    assert "Invalid slot ID" in _error(server, "/slots/x?action=erase")
    assert "invalid JSON" in _error(server, "/slots/0?action=save", raw=b"{nope")
    assert "no slot file" in _error(server, "/slots/0?action=restore", {"filename": "absent.bin"})
    (saved_dir / "garbage.bin").write_bytes(b"not a slot file at all, just some bytes......")
    assert "not a spekula slot file" in _error(server, "/slots/0?action=restore", {"filename": "garbage.bin"})
    _complete(server, PROMPT, 1, 4)
    assert server.post("/slots/1?action=save", {"filename": "cut.bin"})[0] == 200
    data = (saved_dir / "cut.bin").read_bytes()
    (saved_dir / "cut.bin").write_bytes(data[: len(data) // 2])
    before = server.get("/slots")[1][1]["n_cached"]
    assert "truncated" in _error(server, "/slots/1?action=restore", {"filename": "cut.bin"})
    assert server.get("/slots")[1][1]["n_cached"] == before  # nothing lost
    assert server.get("/health")[0] == 200
    _complete(server, PROMPT, 1, 4)


@contextmanager
def _generating(server: HttpServer, prompt: list[int], slot: int) -> Iterator[dict[str, Any]]:
    """Inside: `slot` generates 200 tokens after `prompt` (in a thread); after: the answer is in the dict."""
    done: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: done.update(_complete(server, prompt, slot, 200, ignore_eos=True)))
    worker.start()
    try:
        for _ in range(2000):
            if server.get("/slots")[1][slot]["is_processing"]:
                break
        else:
            pytest.fail("the request never started")
        yield done
    finally:
        worker.join(timeout=120)
    assert len(done["tokens"]) == 200


def test_an_action_on_a_busy_slot_waits_for_its_request(server: HttpServer) -> None:
    with _generating(server, [5, 6, 7], 0):
        status, erased = server.post("/slots/0?action=erase", None)  # answered once the request is done
    assert (status, erased) == (200, {"id_slot": 0, "n_erased": 3 + 200 - 1})
    assert server.get("/slots")[1][0]["n_cached"] == 0


def test_a_client_gone_while_its_action_waits_cancels_it(server: HttpServer) -> None:
    with _generating(server, [5, 6, 8], 1), socket.create_connection(("127.0.0.1", server.port)) as sock:
        # asks for an erase of the busy slot, then leaves
        sock.sendall(b"POST /slots/1?action=erase HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    time.sleep(0.2)  # the loop has had its turn: the cancelled erase would have run by now
    assert server.get("/slots")[1][1]["n_cached"] == 3 + 200 - 1


def test_a_saved_slot_restores_in_a_new_server_process(tmp_path: Path) -> None:
    args = (tiny_model_path("qwen3"), "-c", "128", "-t", "1", "--slot-save-path", str(tmp_path / "saved"))
    with running(*args, log=tmp_path / "a.log") as first_server:
        first = _complete(first_server, PROMPT, 0)
        assert first_server.post("/slots/0?action=save", {"filename": "keep.bin"})[0] == 200
    turn2 = [*PROMPT, *first["tokens"], 3, 4]
    with running(*args, log=tmp_path / "b.log") as second_server:
        cold = _complete(second_server, turn2, 0, 8)
        assert second_server.post("/slots/0?action=restore", {"filename": "keep.bin"})[0] == 200
        warm = _complete(second_server, turn2, 0, 8)
    assert warm["timings"]["cache_n"] == len(PROMPT) + len(first["tokens"]) - 1
    assert warm["tokens"] == cold["tokens"]


def test_without_slot_save_path_the_actions_are_not_supported(tmp_path: Path) -> None:
    with running(tiny_model_path("llama"), "-c", "128", "-t", "1", log=tmp_path / "server.log") as srv:
        assert "--slot-save-path" in _error(srv, "/slots/0?action=erase", status=501)


def test_spekula_server_passes_the_option_on(tmp_path: Path) -> None:
    tr = translate(["--slot-save-path", str(tmp_path)], {})
    args = tr.serve_argv()
    assert not tr.errors and args[args.index("--slot-save-path") + 1] == str(tmp_path)


def test_a_slot_save_path_that_cannot_be_a_directory_is_refused_at_start(tmp_path: Path) -> None:
    from spekula.core.errors import ConfigError
    from spekula.frontends.cli.serve_options import _slot_save_dir

    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="cannot create the directory"):
        _slot_save_dir(str(tmp_path / "file" / "sub"))
    with pytest.raises(ConfigError, match="needs a directory"):
        _slot_save_dir("")
    assert _slot_save_dir(str(tmp_path / "new" / "dir")) == str(tmp_path / "new" / "dir")
    assert (tmp_path / "new" / "dir").is_dir()
