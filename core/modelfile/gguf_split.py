"""Split GGUF sets, as llama-gguf-split writes them: the shards' names and what ties them into one model.

A model split N ways is N files ``PREFIX-00001-of-0000N.gguf`` ... ``PREFIX-0000N-of-0000N.gguf`` in
one directory. Each is a complete GGUF file of its own (header, tensor directory, data section; a
tensor's offset is relative to its own shard's data), each carries ``split.no`` (0-based),
``split.count`` and ``split.tensors.count`` (the tensors of the whole set), and the first one also
carries every other metadata key (architecture, hyper-parameters, vocabulary). The first shard may
hold no tensors at all (``--no-tensor-first-split``).

This module only names shards and checks what their headers say; `gguf_file.GGUFFile` opens them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from spekula.core.errors import ModelFileError

SPLIT_NO = "split.no"
SPLIT_COUNT = "split.count"
SPLIT_TENSORS_COUNT = "split.tensors.count"
# llama.cpp writes the index and count with 5 digits; more digits appear past 99999 shards only.
_SHARD_NAME = re.compile(r"^(?P<prefix>.+)-(?P<number>\d{5,})-of-(?P<count>\d{5,})\.gguf$")
MERGE_HINT = "merge the shards into one file with `llama-gguf-split --merge FIRST-SHARD OUT.gguf`"


def shard_name(prefix: str, index: int, count: int) -> str:
    """The file name of shard `index` (0-based) of `count`: llama-gguf-split numbers files from 1."""
    return f"{prefix}-{index + 1:05d}-of-{count:05d}.gguf"


def split_count(meta: Mapping[str, Any], path: Path) -> int:
    """How many files the model in `path` (with header `meta`) spans: 1 for an ordinary GGUF."""
    count = meta.get(SPLIT_COUNT, 1)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ModelFileError(path, f"invalid {SPLIT_COUNT} {count!r}")
    return count


def shard_index(meta: Mapping[str, Any], path: Path, count: int) -> int:
    """`split.no` of a shard, checked against `count`."""
    if SPLIT_NO not in meta:
        raise ModelFileError(path, f"has {SPLIT_COUNT} {count} but no {SPLIT_NO}: not a shard of a split model")
    index = meta[SPLIT_NO]
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
        raise ModelFileError(path, f"invalid {SPLIT_NO} {index!r} for a split of {count} files")
    return index


def shard_paths(path: Path, index: int, count: int) -> list[Path]:
    """Every shard of the set that `path` (shard `index` of `count`) belongs to, first to last.

    The directory is `path`'s own, not its resolved one: in a Hugging Face cache the shards are links
    whose targets are named by hash, and only the links carry the set's names."""
    expected = shard_name("", index, count)
    m = _SHARD_NAME.match(path.name)
    if m is None or not path.name.endswith(expected):
        raise ModelFileError(path, f"is shard {index + 1} of a split model of {count} files, but its name does not "
                             f"end in {expected!r}, so the other shards cannot be found (keep the names "
                             "llama-gguf-split gave them)")
    prefix = m["prefix"]
    return [path.with_name(shard_name(prefix, i, count)) for i in range(count)]


def tensor_total(first: Path, meta: Mapping[str, Any]) -> int:
    """`split.tensors.count` of the first shard: how many tensors the whole set holds."""
    n = meta.get(SPLIT_TENSORS_COUNT)
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ModelFileError(first, f"is the first shard of a split model but has no valid {SPLIT_TENSORS_COUNT} "
                             f"({n!r})")
    return n


def check_shard(path: Path, meta: Mapping[str, Any], index: int, count: int, n_tensors: int) -> None:
    """A shard's own split keys agree with the first shard's: its place, the set's size and tensor count."""
    if split_count(meta, path) != count or SPLIT_COUNT not in meta:
        raise ModelFileError(path, f"{SPLIT_COUNT} is {meta.get(SPLIT_COUNT)!r}, but the first shard says {count}: "
                             "a shard of another split model")
    got = shard_index(meta, path, count)
    if got != index:
        raise ModelFileError(path, f"{SPLIT_NO} is {got} where shard {index} was expected "
                             "(renamed, or a shard of another split model)")
    theirs = meta.get(SPLIT_TENSORS_COUNT)
    if theirs is not None and theirs != n_tensors:
        raise ModelFileError(path, f"{SPLIT_TENSORS_COUNT} is {theirs}, but the first shard says {n_tensors}: "
                             "a shard of another split model")


def check_tensor_total(first: Path, expected: int, found: int) -> None:
    """The set holds exactly the tensors its first shard announces."""
    if expected != found:
        raise ModelFileError(first, f"{SPLIT_TENSORS_COUNT} is {expected}, but the shards hold {found} tensors")
