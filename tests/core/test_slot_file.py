"""Slot files (core/engine/slot_file.py): plain names inside the directory only, and every file that is not
this model's and this backend's intact slot file (corrupt, truncated, another version, model or backend, a
crafted header) refused with the slot's own cache kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from slot_helpers import complete, repeating_prompt, serving, slot_engine

from spekula.core.engine.slot_actions import SlotActionError
from spekula.core.engine.slot_file import FORMAT_VERSION, SlotFileError, slot_path
from spekula.core.events import FinalEvent


@pytest.mark.parametrize("name", ["", "..", "../x", "a/b", "/etc/passwd", "a\\b", "x\0y", ".hidden", "a..b",
                                  "n" * 256, " pad", "tab\t"])
def test_file_names_that_escape_or_are_not_plain_are_refused(name: str, tmp_path: Path) -> None:
    with pytest.raises(SlotFileError, match="Invalid filename"):
        slot_path(tmp_path, name)
    assert slot_path(tmp_path, "slot-1.bin") == tmp_path / "slot-1.bin"



def _saved(tmp_path: Path) -> tuple[Path, list[int], FinalEvent, dict[str, Any]]:
    """A llama slot file of one finished request (native), and what made it."""
    prompt = repeating_prompt(3)

    async def go() -> tuple[FinalEvent, dict[str, Any]]:
        async with serving(slot_engine("llama", "native", "ngram-simple")) as engine:
            first = await complete(engine, prompt, 0)
            return first, await engine.slot_action("save", 0, tmp_path / "good.bin")

    first, saved = anyio.run(go)
    return tmp_path / "good.bin", prompt, first, saved


def _variant(src: Path, name: str, edit: Any) -> Path:
    data = bytearray(src.read_bytes())
    out = src.with_name(name)
    out.write_bytes(bytes(edit(data)))
    return out


def test_bad_files_are_refused_and_the_slot_keeps_its_cache(tmp_path: Path) -> None:
    good, prompt, first, _ = _saved(tmp_path)

    def flip(data: bytearray) -> bytearray:
        data[len(data) // 2] ^= 0x40
        return data

    def version(data: bytearray) -> bytearray:
        data[8:12] = (FORMAT_VERSION + 1).to_bytes(4, "little")
        return data

    cases = {
        _variant(good, "corrupt.bin", flip): "corrupt",
        _variant(good, "truncated.bin", lambda d: d[: len(d) - 100]): "corrupt or truncated",
        _variant(good, "short.bin", lambda d: d[:20]): "too short|truncated",
        _variant(good, "version.bin", version): f"version {FORMAT_VERSION + 1}",
        _variant(good, "magic.bin", lambda d: b"GGUF" + d[4:]): "not a spekula slot file",
        tmp_path / "missing.bin": "no slot file",
    }
    other = [9, 8, 7, 6, 5, 4, 3]

    async def go() -> None:
        async with serving(slot_engine("llama", "native", "ngram-simple")) as engine:
            mine = await complete(engine, other, 1)
            for path, why in cases.items():
                with pytest.raises(SlotFileError, match=why):
                    await engine.slot_action("restore", 1, path)
                assert engine.slots()[1]["n_cached"] == len(other) + len(mine.tokens) - 1
            again = await complete(engine, [*other, *mine.tokens, 4], 1)
            assert again.timings["cache_n"] == len(other) + len(mine.tokens) - 1  # its own cache survived
            restored = await engine.slot_action("restore", 1, good)  # and a good file still restores
            assert restored["n_restored"] == len(prompt) + len(first.tokens) - 1

    anyio.run(go)


def _rewrite_header(src: Path, name: str, edit: Any) -> Path:
    """A copy of `src` whose JSON header `edit` changed, with a valid checksum again (a crafted file)."""
    import hashlib
    import json
    import struct

    data = src.read_bytes()
    magic, version, n = struct.unpack_from("<8sII", data)
    header = edit(json.loads(data[16 : 16 + n]))
    raw = json.dumps(header).encode()
    body = struct.pack("<8sII", magic, version, len(raw)) + raw + data[16 + n : -32]
    out = src.with_name(name)
    out.write_bytes(body + hashlib.sha256(body).digest())
    return out


def test_crafted_headers_with_a_valid_checksum_are_refused(tmp_path: Path) -> None:
    good, *_ = _saved(tmp_path)

    def arrays(edit: Any) -> Any:
        def go(h: dict[str, Any]) -> dict[str, Any]:
            edit(h["arrays"][0])
            return h
        return go

    cases = {
        _rewrite_header(good, "list.bin", lambda h: {**h, "model": [1, 2]}): "bad header",
        _rewrite_header(good, "object.bin", arrays(lambda a: a.update(dtype="|O"))): "bad header",
        _rewrite_header(good, "negative.bin", arrays(lambda a: a.update(shape=[-1, -4]))): "bad header",
        _rewrite_header(good, "huge.bin", arrays(lambda a: a.update(shape=[2**40, 2**40]))): "not the size",
        _rewrite_header(good, "name.bin", arrays(lambda a: a.update(name="elsewhere/kv"))): "array named",
        _rewrite_header(good, "tokens.bin", lambda h: {**h, "n_tokens": h["n_tokens"] + 1}): "tokens at length",
        _rewrite_header(good, "dtype.bin", arrays(lambda a: a.update(dtype="<i2"))): "Unable to restore",
    }

    async def go() -> None:
        async with serving(slot_engine("llama", "native", "ngram-simple")) as engine:
            for path, why in cases.items():
                with pytest.raises((SlotFileError, SlotActionError), match=why):
                    await engine.slot_action("restore", 0, path)
            await engine.slot_action("restore", 0, good)

    anyio.run(go)


def test_foreign_files_are_refused(tmp_path: Path) -> None:
    good, *_ = _saved(tmp_path)

    async def go(arch: str, backend: str, why: str) -> None:
        async with serving(slot_engine(arch, backend, "ngram-simple")) as engine:
            with pytest.raises(SlotFileError, match=why):
                await engine.slot_action("restore", 0, good)
            await complete(engine, [5, 6, 7], 0)  # and it keeps serving

    anyio.run(go, "qwen2", "native", "another model")
    anyio.run(go, "llama", "torch", "another backend")
