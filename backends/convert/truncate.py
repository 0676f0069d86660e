"""Write a layer-truncated copy of a GGUF model: the first K blocks, the final norm and the head.

A no-training draft model for draft-simple: it shares the target's tokenizer byte for byte (so the
vocabulary check passes) and its first K layers. Tensors are copied as stored (no dequantizing or
re-quantizing), metadata keeps its GGUF value types, `{arch}.block_count` becomes K, and per-layer
metadata arrays (one entry per block) are cut to K entries.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from spekula.backends.convert.gguf_copy import as_stored, copy_fields, raw_reader, write_with_tensors
from spekula.backends.convert.output import atomic_output, check_output_path
from spekula.core.errors import ConfigError, ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile

_BLOCK = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class TruncateResult:
    path: Path
    arch: str
    n_layer_in: int
    n_layer_out: int
    n_tensors: int
    n_bytes: int


def truncate_gguf(src: str | os.PathLike[str], dst: str | os.PathLike[str], n_keep: int) -> TruncateResult:
    """Copy `src` to `dst` keeping blocks [0, n_keep). Clear errors for bad files and bad K."""
    src, dst = Path(src), Path(dst)
    f = GGUFFile(src)  # validates the file and gives one clear ModelFileError on damage
    arch = f.architecture
    key = f"{arch}.block_count"
    n_layer = int(f.require(key))
    if not 1 <= n_keep <= n_layer:
        raise ConfigError(f"--layers must be in [1, {n_layer}] for {src} ({n_layer} blocks); got {n_keep}")
    if int(f.get(f"{arch}.nextn_predict_layers", 0) or 0) > 0:
        raise ConfigError(f"{src}: has MTP (nextn) layers after its trunk; truncating would turn them into trunk layers")
    if dst.resolve() == src.resolve():
        raise ConfigError(f"output {dst} is the input file; choose another path")
    # Before the (slow) metadata copy: a directory or a path below a file is refused here.
    check_output_path(dst, "-o")

    reader = raw_reader(f)
    kept = [t for t in reader.tensors if (m := _BLOCK.match(t.name)) is None or int(m.group(1)) < n_keep]
    if not any(_BLOCK.match(t.name) for t in kept):
        raise ModelFileError(src, "no blk.N.* tensors found; not a layered model")

    with atomic_output(dst, "-o") as tmp:
        writer = gguf.GGUFWriter(tmp, arch, endianess=reader.endianess)
        try:
            def change(name: str, value: Any) -> Any:
                if name == key:
                    return n_keep
                if name == "general.name":
                    return f"{value} (first {n_keep} of {n_layer} layers)"
                if name.startswith(arch + ".") and isinstance(value, list) and len(value) == n_layer:
                    return value[:n_keep]  # one entry per block
                return value

            copy_fields(reader, writer, change)
            write_with_tensors(writer, as_stored(kept), reader.endianess)
        finally:
            writer.close()
    return TruncateResult(dst, arch, n_layer, n_keep, len(kept), sum(int(t.n_bytes) for t in kept))
