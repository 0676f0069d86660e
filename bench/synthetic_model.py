"""A synthetic 1B-parameter llama GGUF in Q4_K_M, for measuring how memory and speed scale.

Realistic shapes (those of a 1.2B llama: hidden 2048, 16 blocks, 32 query / 8 key-value heads of 64,
feed-forward 8192, vocabulary 128256, tied output) with random weights: the text it generates is
noise, but every matmul, cache and head has the size a real model's has. The F16 file is written with
the fixture writer and quantized to Q4_K_M by llama.cpp's own `llama-quantize` (next to the
llama-server binary), so the block mix is exactly what llama.cpp users run. Cached under
~/.cache/spekula/bench/.

    .venv/bin/python bench/synthetic_model.py [--llama-server PATH]   # prints the path
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

SHAPE = {"n_embd": 2048, "n_layer": 16, "n_head": 32, "n_head_kv": 8, "head_dim": 64, "n_ff": 8192,
         "vocab": 128256}
# A 0.6B llama (head size, GQA and FFN ratio of the 1.2B; a 32000-token vocabulary) for the block-type
# mixes users download to save memory (IQ4_XS, IQ4_NL, Q3_K_M, Q2_K: bench/vs_llama_server.py --synthetic-mixes).
SHAPE_06B = {"n_embd": 1536, "n_layer": 16, "n_head": 24, "n_head_kv": 8, "head_dim": 64, "n_ff": 6144, "vocab": 32000}
CACHE = Path(os.environ.get("SPEKULA_CACHE_DIR", Path.home() / ".cache" / "spekula")) / "bench"


def _tokenizer_meta(vocab: int) -> dict[str, object]:
    from spekula.core.modelfile.tokenizer import NORMAL
    from spekula.fixtures.tiny_gguf import tokenizer_metadata

    meta = tokenizer_metadata("smollm", 320)
    tokens = list(meta["tokenizer.ggml.tokens"])  # type: ignore[call-overload]
    types = list(meta["tokenizer.ggml.token_type"])  # type: ignore[call-overload]
    extra = vocab - len(tokens)
    tokens += [f"z{i}" for i in range(extra)]  # distinct plain tokens no merge produces
    types += [NORMAL] * extra
    return {**meta, "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types}


def write_f16(path: Path, seed: int = 0, shape: dict[str, int] = SHAPE) -> Path:
    """The F16 file of a llama of `shape` (SHAPE: the 1.2B one) with random weights."""
    from spekula.fixtures.tiny_gguf import llama_permute, write_gguf

    s = shape
    rng = np.random.default_rng(seed)
    E, hd, nh, nkv, ff = s["n_embd"], s["head_dim"], s["n_head"], s["n_head_kv"], s["n_ff"]

    def mat(rows: int, cols: int) -> tuple[np.ndarray, str]:
        w = rng.standard_normal((rows, cols), dtype=np.float32)
        w *= 1.0 / np.sqrt(cols)
        return w.astype(np.float16), "F16"

    tensors: dict[str, object] = {"token_embd.weight": mat(s["vocab"], E)}
    for i in range(s["n_layer"]):
        b = f"blk.{i}."
        wq, wk = mat(nh * hd, E), mat(nkv * hd, E)
        tensors |= {
            b + "attn_norm.weight": np.ones(E, np.float32),
            b + "attn_q.weight": (llama_permute(wq[0], nh), "F16"),
            b + "attn_k.weight": (llama_permute(wk[0], nkv), "F16"),
            b + "attn_v.weight": mat(nkv * hd, E),
            b + "attn_output.weight": mat(E, nh * hd),
            b + "ffn_norm.weight": np.ones(E, np.float32),
            b + "ffn_gate.weight": mat(ff, E),
            b + "ffn_up.weight": mat(ff, E),
            b + "ffn_down.weight": mat(E, ff),
        }
    tensors["output_norm.weight"] = np.ones(E, np.float32)
    hparams = {"context_length": 8192, "embedding_length": E, "block_count": s["n_layer"], "feed_forward_length": ff,
               "attention.head_count": nh, "attention.head_count_kv": nkv, "rope.freq_base": 500000.0,
               "attention.layer_norm_rms_epsilon": 1e-5, "rope.dimension_count": hd, "vocab_size": s["vocab"]}
    params = s["vocab"] * E + s["n_layer"] * (E * (nh + 2 * nkv) * hd + nh * hd * E + 3 * E * ff)
    meta = {"general.name": f"spekula synthetic {params / 1e9:.1f}B llama (random weights)", "general.file_type": 1,
            **_tokenizer_meta(s["vocab"])}
    return write_gguf(path, "llama", hparams, tensors, meta)  # type: ignore[arg-type]


def quantized_q4_k_m(name: str, write_f16: Callable[[Path], Path], llama_server: str | None) -> Path:
    """``CACHE/<name>-Q4_K_M.gguf``, built on first use: ``write_f16`` writes the F16 file, then the
    llama-quantize next to `llama_server` quantizes it (the F16 file is removed afterwards)."""
    return quantized(name, write_f16, llama_server, "Q4_K_M")


def quantized(name: str, write_f16: Callable[[Path], Path], llama_server: str | None, mix: str,
              keep_f16: bool = False) -> Path:
    """``CACHE/<name>-<mix>.gguf`` (a llama-quantize type mix: Q4_K_M, IQ4_XS, Q3_K_M, ...), built on
    first use from ``CACHE/<name>-F16.gguf`` (written by ``write_f16`` unless there; removed afterwards
    unless `keep_f16`, for the next mix of the same model)."""
    out = CACHE / f"{name}-{mix}.gguf"
    if out.is_file():
        return out
    if not llama_server:
        raise SystemExit(f"building {name} needs llama.cpp's llama-quantize (next to llama-server)")
    quantize = Path(llama_server).resolve().with_name("llama-quantize")
    if not quantize.is_file():
        raise SystemExit(f"{quantize} not found (build the llama-quantize target of the same sdist)")
    CACHE.mkdir(parents=True, exist_ok=True)
    f16 = CACHE / f"{name}-F16.gguf"
    if not f16.is_file():
        print(f"writing {f16} ...", file=sys.stderr)
        write_f16(f16)
    tmp = out.with_suffix(".tmp")
    done = subprocess.run([str(quantize), str(f16), str(tmp), mix], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"llama-quantize failed:\n{done.stderr[-3000:]}")
    tmp.replace(out)
    if not keep_f16:
        f16.unlink()
    return out


def synthetic_1b(llama_server: str | None) -> Path:
    """The cached Q4_K_M file, built on first use with the llama-quantize next to `llama_server`."""
    return quantized_q4_k_m("synthetic-1b", write_f16, llama_server)


def synthetic_06b(mixes: list[str], llama_server: str | None) -> list[Path]:
    """The cached files of the 0.6B llama (SHAPE_06B) in each llama-quantize mix, built on first use
    from one F16 file (removed after the last)."""
    def write(path: Path) -> Path:
        return write_f16(path, shape=SHAPE_06B)

    return [quantized("synthetic-0.6b", write, llama_server, mix, keep_f16=i < len(mixes) - 1)
            for i, mix in enumerate(mixes)]


def llama_server_binary(path: str | None) -> str:
    """The llama-server binary at `path`, else the one bench/llama_server.py finds; exits saying why
    where there is none (the synthetic builders' command lines take it as ``--llama-server PATH``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from llama_server import find_llama_server

    binary, why = find_llama_server(path)
    if binary is None:
        raise SystemExit(why)
    return binary


def build_cli(description: str, build: Callable[[str | None], Path]) -> int:
    """`python bench/<synthetic model>.py [--llama-server PATH]`: build (or find) the file, print its path."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--llama-server", metavar="PATH")
    args = p.parse_args()
    print(build(llama_server_binary(args.llama_server)))
    return 0


if __name__ == "__main__":
    sys.exit(build_cli(__doc__.split("\n\n")[0], synthetic_1b))
