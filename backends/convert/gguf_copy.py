"""Copying a GGUF file's metadata as stored: what every "copy with a change" writer (truncate, a head's
draft vocabulary) shares.

The raw reader keeps each key's GGUF value type (u32 vs i32, f32 arrays ...), which the plain values
of GGUFFile.metadata would lose.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import gguf
import numpy as np

from spekula.core.modelfile.gguf_file import GGUFFile


def raw_reader(f: GGUFFile) -> gguf.GGUFReader:
    """The file's gguf-py reader: GGUFFile's own when it has one (parsing a 49k-token vocabulary twice
    costs seconds)."""
    reader = getattr(f, "_reader", None)
    if not isinstance(reader, gguf.GGUFReader):
        reader = gguf.GGUFReader(str(f.path), "r")
    return reader


def copy_fields(reader: gguf.GGUFReader, writer: gguf.GGUFWriter,
                change: Callable[[str, Any], Any] = lambda _name, value: value,
                keep: Callable[[str], bool] = lambda _name: True) -> None:
    """Every key of `reader` for which keep(name) holds into `writer` with its value type, each value
    passed through `change` (name, value) -> value. The architecture and the GGUF.* keys are the writer's own."""
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF.") or not keep(field.name):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, change(field.name, field.contents()), vtype, sub_type=sub)


def as_stored(tensors: Iterable[Any]) -> list[tuple[str, np.ndarray, gguf.GGMLQuantizationType]]:
    """A reader's tensors as (name, data as stored, type), for write_with_tensors."""
    return [(t.name, t.data, t.tensor_type) for t in tensors]


def write_with_tensors(writer: gguf.GGUFWriter, tensors: Sequence[tuple[str, np.ndarray, gguf.GGMLQuantizationType]],
                       endianess: gguf.GGUFEndian) -> None:
    """The writer's header and keys, then `tensors` (name, data, type), their data written as given:
    blocks as stored stay blocks."""
    for name, data, qtype in tensors:
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data, tensor_endianess=endianess)
