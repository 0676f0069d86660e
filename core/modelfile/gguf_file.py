"""Read a GGUF file's metadata and tensor directory with one clear error on damage.

This is the only place that opens GGUF files for reading; model loaders (weights) and the tokenizer
(vocabulary, chat template) both take a :class:`GGUFFile`.

A large header (a vocabulary) is parsed once per file and version of this module: the parsed metadata
and tensor directory go to the header cache (modelfile/file_cache.py), and the next process that opens
the same file reads them from there, several times faster than parsing; the tensor data is mapped either way.

The header is parsed here rather than with ``gguf.GGUFReader`` because that reader builds numpy
views for every element of every array: SmolLM2's 49k-token vocabulary took 4-14 s per open. This
parser reads string arrays in one pass and memory-maps tensor data (same views as GGUFReader).

A model split over several files by llama-gguf-split opens as one `GGUFFile`, given any of its shards
(modelfile/gguf_split.py): the metadata is the first shard's, the tensors are every shard's, each
shard mapped on its own, so nothing is copied or held twice. (Over 400 lines: the parser, the header
cache's round trip and the split-set join all build one private tensor directory; apart, they would
have to export it.)
"""

from __future__ import annotations

import math
import mmap
import os
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from spekula.core.errors import ModelFileError
from spekula.core.modelfile import file_cache, gguf_arrays, gguf_split
from spekula.core.modelfile.gguf_arrays import (
    LAZY_MIN_ITEMS,
    NumberArray,
    cache_form,
    from_cache_form,
    read_strings,
)

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> (struct format, numpy dtype)
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "<u1"),  # bool
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_STRING, _ARRAY, _BOOL = 8, 9, 7
_SHARED: dict[tuple[str, int, int], GGUFFile] = {}
_SHARED_LOCK = threading.Lock()
_SHARED_MAX = 4
_U64 = struct.Struct("<Q")
# Headers at least this large (vocabularies) go to the header cache; smaller ones parse in a few ms.
CACHE_MIN_HEADER_BYTES = 256 * 1024

# ggml types stored as plain typed arrays (everything else is exposed as raw bytes per row)
_PLAIN_TENSOR_DTYPES: dict[str, str] = {
    "F32": "<f4",
    "F16": "<f2",
    "F64": "<f8",
    "I8": "<i1",
    "I16": "<i2",
    "I32": "<i4",
    "I64": "<i8",
}


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of the file: `shape` in PyTorch order (outermost first), `data` as stored."""

    name: str
    type_name: str  # GGMLQuantizationType name: F32, F16, BF16, Q8_0, Q4_1, ...
    shape: tuple[int, ...]
    data: np.ndarray  # raw bytes [.., bytes per row] for quantized/BF16 types, typed array for plain types


@dataclass(frozen=True, slots=True)
class _TensorInfo:
    name: str
    type_id: int
    ne: tuple[int, ...]  # ggml order (innermost first)
    offset: int  # absolute offset of the data in its file
    shard: int = 0  # which file of a split model holds it (GGUFFile.shard_paths)


class _Cursor:
    """Bounds-checked little-endian reads over the mapped file."""

    def __init__(self, buf: mmap.mmap | bytes, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if n < 0 or end > len(self.buf):
            raise ModelFileError(self.path, f"truncated header: wanted {n} bytes at offset {self.pos}")
        view = memoryview(self.buf)[self.pos : end]
        self.pos = end
        return view

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        return bytes(self.take(n)).decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (vocabularies: one tight loop instead of a call chain per string)."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        length = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            if pos + 8 > end:
                raise ModelFileError(self.path, f"truncated header: string length at offset {pos}")
            (n,) = length(buf, pos)
            pos += 8
            if n > end - pos:
                raise ModelFileError(self.path, f"truncated header: wanted {n} bytes at offset {pos}")
            append(bytes(buf[pos : pos + n]).decode("utf-8", errors="replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype == _STRING and count >= LAZY_MIN_ITEMS:
                read = read_strings(self.buf, self.pos, count)
                if read is None:
                    raise ModelFileError(self.path, f"truncated header: {count} strings at offset {self.pos}")
                self.pos = read[1]
                return read[0]
            if etype == _STRING:
                return self.strings(count)
            if etype not in _SCALARS:
                raise ModelFileError(self.path, f"unknown array element type {etype}")
            dtype = np.dtype(_SCALARS[etype][1])
            arr = np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype)
            if etype == _BOOL:
                return [bool(v) for v in arr]
            return NumberArray(arr.copy()) if count >= LAZY_MIN_ITEMS else arr.tolist()
        if vtype not in _SCALARS:
            raise ModelFileError(self.path, f"unknown metadata value type {vtype}")
        v = self.scalar(_SCALARS[vtype][0])
        return bool(v) if vtype == _BOOL else v


class GGUFFile:
    """An opened GGUF model: one file, or every shard of a split one. `path` is the (first) file,
    `shard_paths` all of them. Metadata values are plain Python (str, int, float, bool, list), except
    arrays of LAZY_MIN_ITEMS or more (vocabularies, scores, merges): read-only `Sequence`s
    (modelfile/gguf_arrays.py) that compare equal to the lists they stand for."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._open_one(Path(path))
        self.shard_paths = [self.path]
        self._maps = [self._mmap]
        count = gguf_split.split_count(self.metadata_dict, self.path)
        if count > 1:
            self._join_split_set(count)

    def _join_split_set(self, count: int) -> None:
        """Open every shard of the split model this file is one of; take the metadata from the first."""
        index = gguf_split.shard_index(self.metadata_dict, self.path, count)
        paths = gguf_split.shard_paths(self.path, index, count)
        shards: list[GGUFFile] = []
        for i, shard_path in enumerate(paths):
            if i == index:
                shards.append(self)
                continue
            if not shard_path.is_file():
                raise ModelFileError(shard_path, f"missing: shard {i + 1} of the {count}-file split model "
                                     f"{paths[0].name} (every shard must be in {shard_path.parent})")
            shard = object.__new__(GGUFFile)
            shard._open_one(shard_path)
            shards.append(shard)
        first = shards[0]
        n_tensors = gguf_split.tensor_total(first.path, first.metadata_dict)
        for i, shard in enumerate(shards):
            gguf_split.check_shard(shard.path, shard.metadata_dict, i, count, n_tensors)
        infos: dict[str, _TensorInfo] = {}
        for i, shard in enumerate(shards):
            for name, info in shard._infos.items():
                if name in infos:
                    raise ModelFileError(shard.path, f"duplicated tensor {name!r}: shard "
                                         f"{paths[infos[name].shard].name} holds it too")
                infos[name] = _TensorInfo(name, info.type_id, info.ne, info.offset, i)
        gguf_split.check_tensor_total(paths[0], n_tensors, len(infos))
        self.path, self.shard_paths = paths[0], paths
        self.metadata_dict, self._value_types = first.metadata_dict, first._value_types
        self._mmap, self._maps, self._infos = first._mmap, [s._mmap for s in shards], infos

    def _open_one(self, path: Path) -> None:
        """Map one file and read its header (from the header cache when it is there)."""
        self.path = path
        if self.path.is_dir():
            raise ModelFileError(self.path, "is a directory, not a GGUF file")
        if not self.path.is_file():
            raise ModelFileError(self.path, "no such file")
        size = self.path.stat().st_size
        if size < 24:
            raise ModelFileError(self.path, f"not a GGUF file ({size} bytes)")
        with open(self.path, "rb") as fh:
            self._mmap = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        if self._mmap[:4] != GGUF_MAGIC:
            raise ModelFileError(self.path, f"not a GGUF file (magic {bytes(self._mmap[:4])!r}, expected b'GGUF')")
        identity = file_cache.file_identity(self.path)
        code = file_cache.source_digest(__file__) + file_cache.source_digest(gguf_arrays.__file__)
        if self._restore(file_cache.load("gguf-header", identity, code)):
            return
        try:
            header_bytes = self._parse_header()
        except ModelFileError:
            raise
        except Exception as exc:  # struct/unicode/overflow errors on damaged headers
            raise ModelFileError(self.path, f"corrupt GGUF header ({type(exc).__name__}: {exc})") from None
        if header_bytes >= CACHE_MIN_HEADER_BYTES:
            infos = [(i.name, i.type_id, i.ne, i.offset) for i in self._infos.values()]
            meta = {key: cache_form(value) for key, value in self.metadata_dict.items()}
            file_cache.store("gguf-header", identity, code, (meta, self._value_types, infos))
        self._drop_header_pages(header_bytes)

    def _drop_header_pages(self, header_bytes: int) -> None:
        """Take the header's pages out of this process's resident set: what was read from them is copied
        into the metadata, and a 262k-token vocabulary's header is ~5 MB that nothing reads again (a
        later read faults them back in from the page cache)."""
        whole_pages = header_bytes - header_bytes % mmap.PAGESIZE
        if whole_pages and hasattr(self._mmap, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            self._mmap.madvise(mmap.MADV_DONTNEED, 0, whole_pages)

    def _restore(self, cached: Any) -> bool:
        """Take the header from a cache entry of this very file (see file_cache); False if it is not one."""
        try:
            meta, types, infos = cached
            tensors = {name: _TensorInfo(name, type_id, tuple(ne), offset) for name, type_id, ne, offset in infos}
            if not (isinstance(meta, dict) and isinstance(types, dict)):
                return False
            meta = {key: from_cache_form(value) for key, value in meta.items()}
        except (TypeError, ValueError):
            return False
        self.metadata_dict, self._value_types, self._infos = meta, types, tensors
        return True

    def _parse_header(self) -> int:
        """Parse metadata and tensor directory; returns the header's size in bytes."""
        cur = _Cursor(self._mmap, self.path)
        cur.take(4)
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise ModelFileError(self.path, f"unsupported GGUF version {version} (expected 2 or 3)")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        if n_tensors > 1_000_000 or n_kv > 1_000_000:
            raise ModelFileError(self.path, f"corrupt header: {n_tensors} tensors, {n_kv} metadata keys")
        meta: dict[str, Any] = {}
        types: dict[str, tuple[int, int | None]] = {}
        for _ in range(n_kv):
            key = cur.string()
            vtype = cur.scalar("<I")
            # an array's element type leads its value; peeked so that copies can keep it (see value_type)
            etype = struct.unpack_from("<I", self._mmap, cur.pos)[0] if vtype == _ARRAY else None
            types[key] = (vtype, etype)
            meta[key] = cur.value(vtype)
        infos: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            if n_dims > 8:
                raise ModelFileError(self.path, f"corrupt tensor info for {name!r}: {n_dims} dims")
            ne = tuple(cur.scalar("<Q") for _ in range(n_dims))
            infos.append((name, ne, cur.scalar("<I"), cur.scalar("<Q")))
        align = int(meta.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-cur.pos // align) * align
        self.metadata_dict = meta
        self._value_types = types
        self._infos: dict[str, _TensorInfo] = {}
        file_size = len(self._mmap)
        for name, ne, type_id, rel in infos:
            if name in self._infos:
                raise ModelFileError(self.path, f"duplicated tensor {name!r}")
            info = _TensorInfo(name, type_id, ne, data_start + rel)
            end = info.offset + _n_bytes(info, self.path)
            if end > file_size:
                raise ModelFileError(
                    self.path, f"truncated: tensor {name!r} ends at byte {end} but the file has {file_size}"
                )
            self._infos[name] = info
        return cur.pos

    @classmethod
    def shared(cls, path: str | os.PathLike[str]) -> GGUFFile:
        """One parsed header per file (same path, size and mtime) for the whole process: the CLI reads
        the vocabulary for the tokenizer and the tensors for the backend from one parse."""
        p = Path(path)
        try:
            st = p.stat()
            key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
        except OSError:
            return cls(path)  # the constructor says what is wrong with the path
        with _SHARED_LOCK:
            hit = _SHARED.get(key)
        if hit is not None:
            return hit
        f = cls(path)
        with _SHARED_LOCK:
            _SHARED[key] = f
            while len(_SHARED) > _SHARED_MAX:
                _SHARED.pop(next(iter(_SHARED)))
        return f

    @property
    def metadata(self) -> dict[str, Any]:
        return self.metadata_dict

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata_dict.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata_dict:
            raise ModelFileError(self.path, f"missing metadata key {key!r}")
        return self.metadata_dict[key]

    def value_type(self, key: str) -> tuple[int, int | None]:
        """(GGUF value type, element type for arrays else None) of a metadata key, as stored: the plain
        values of `metadata` lose the difference between u32 and i32, which a verbatim copy must keep."""
        if key not in self._value_types:
            raise ModelFileError(self.path, f"missing metadata key {key!r}")
        return self._value_types[key]

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    def tensor_names(self) -> list[str]:
        return list(self._infos)

    def has_tensor(self, name: str) -> bool:
        return name in self._infos

    def tensor(self, name: str) -> TensorEntry:
        info = self._infos.get(name)
        if info is None:
            raise ModelFileError(self.path, f"missing tensor {name!r}")
        type_name = _type_name(info.type_id, self.path)
        shape = tuple(int(d) for d in reversed(info.ne))
        n_bytes = _n_bytes(info, self.path)
        raw = np.frombuffer(self._maps[info.shard], dtype=np.uint8, count=n_bytes, offset=info.offset)
        if type_name in _PLAIN_TENSOR_DTYPES:
            data = raw.view(np.dtype(_PLAIN_TENSOR_DTYPES[type_name])).reshape(shape)
        else:
            block, type_size = _quant_sizes(info.type_id)
            row_bytes = info.ne[0] // block * type_size
            data = raw.reshape(*shape[:-1], row_bytes) if shape else raw
        return TensorEntry(name=name, type_name=type_name, shape=shape, data=data)

    def tensors(self) -> Iterator[TensorEntry]:
        for name in self._infos:
            yield self.tensor(name)

    @cached_property
    def _reader(self) -> Any:
        """A full ``gguf.GGUFReader`` (slow to build) for tools that rewrite files field by field."""
        if len(self.shard_paths) > 1:
            raise ModelFileError(self.path, f"is split over {len(self.shard_paths)} files, which this tool does not "
                                 f"rewrite; {gguf_split.MERGE_HINT}")
        import gguf

        return gguf.GGUFReader(str(self.path), "r")


# (name, values per block, bytes per block) of the tensor types spekula's backends read, so that opening a
# model needs no import of the gguf package (a tenth of the CLI's start); other ids ask gguf, which knows
# every type llama.cpp defines. tests/test_gguf_file.py checks this table against gguf's.
COMMON_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 20: ("IQ4_NL", 32, 18),
    23: ("IQ4_XS", 256, 136), 30: ("BF16", 1, 2), 39: ("MXFP4", 32, 17),
}


def _type_name(type_id: int, path: Path) -> str:
    if type_id in COMMON_TYPES:
        return COMMON_TYPES[type_id][0]
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        raise ModelFileError(path, f"unknown tensor type id {type_id}") from None


def _quant_sizes(type_id: int) -> tuple[int, int]:
    if type_id in COMMON_TYPES:
        return COMMON_TYPES[type_id][1:]
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]


def _n_bytes(info: _TensorInfo, path: Path) -> int:
    _type_name(info.type_id, path)
    block, type_size = _quant_sizes(info.type_id)
    n = math.prod(int(d) for d in info.ne)  # 1 for a scalar; math.prod: np.prod costs ~20 us a tensor at load
    if info.ne and info.ne[0] % block:
        raise ModelFileError(path, f"tensor {info.name!r}: row of {info.ne[0]} is not a multiple of block {block}")
    return n * type_size // block
