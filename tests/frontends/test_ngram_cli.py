"""`spekula ngram-cache build`: a static cache from a corpus, with the model's tokenizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from spekula.core.drafting.drafter import DrafterContext
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.core.params import SpecParams
from spekula.drafters.draftless.ngram_cache import NgramCacheDrafter
from spekula.drafters.draftless.ngram_cache_file import NgramCache, load_cache
from spekula.fixtures.tiny_gguf import tiny_model_path
from spekula.frontends.cli.main import main

TEXT_A = "the cat sat on the mat. the cat sat on the hat. the cat ran."
TEXT_B = "a dog sat on the mat and the cat sat on the dog."


@pytest.fixture(scope="module")
def model() -> Path:
    return tiny_model_path("llama")


def expected_counts(tok: Tokenizer, texts: list[str]) -> NgramCache:
    cache: NgramCache = {}
    for text in texts:
        ids = tok.encode(text, add_special=True, parse_special=True)
        for a, b, c in zip(ids, ids[1:], ids[2:], strict=False):
            part = cache.setdefault((a, b, -1, -1), {})
            part[c] = part.get(c, 0) + 1
    return cache


def test_build_counts_every_file_separately(tmp_path: Path, model: Path) -> None:
    (tmp_path / "a.txt").write_text(TEXT_A, encoding="utf-8")
    (tmp_path / "b.txt").write_text(TEXT_B, encoding="utf-8")
    out = tmp_path / "static.lcs"
    rc = main(
        [
            "ngram-cache",
            "build",
            str(tmp_path / "a.txt"),
            str(tmp_path / "b.txt"),
            "-o",
            str(out),
            "-m",
            str(model),
            "-q",
        ]
    )
    assert rc == 0
    tok = Tokenizer.from_gguf(GGUFFile(model))
    assert load_cache(out) == expected_counts(tok, [TEXT_A, TEXT_B])
    # The file feeds the drafter: after "the cat" the corpus says " sat" 2 of 3 times.
    ctx = DrafterContext(
        spec=SpecParams(drafter_options={"lookup-cache-static": str(out)}),
        target=None,
        tokenizer=None,
        n_seq_max=1,  # type: ignore[arg-type]
    )
    drafter = NgramCacheDrafter.create(ctx)
    ids = tok.encode("the cat", add_special=True)
    drafted = drafter.draft_one(0, np.asarray(ids[:-1], dtype=np.int32), ids[-1], 2)
    assert drafted and " sat on".startswith(tok.decode(drafted))


def test_default_model_is_used_without_m(
    tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import spekula.backends.gguf.default_model as default_model

    monkeypatch.setattr(default_model, "ensure_default_model", lambda quiet=False: model)
    (tmp_path / "a.txt").write_text(TEXT_A, encoding="utf-8")
    assert main(["ngram-cache", "build", str(tmp_path / "a.txt"), "-o", str(tmp_path / "o.lcs"), "-q"]) == 0
    assert load_cache(tmp_path / "o.lcs")


def test_bad_input_is_a_clear_error(tmp_path: Path, model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "ngram-cache",
                "build",
                str(tmp_path / "missing.txt"),
                "-o",
                str(tmp_path / "o.lcs"),
                "-m",
                str(model),
            ]
        )
        == 1
    )
    assert "missing.txt: cannot read" in capsys.readouterr().err
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00bad")
    assert (
        main(
            [
                "ngram-cache",
                "build",
                str(tmp_path / "bin.txt"),
                "-o",
                str(tmp_path / "o.lcs"),
                "-m",
                str(model),
            ]
        )
        == 1
    )
    assert "not UTF-8" in capsys.readouterr().err
    (tmp_path / "ok.txt").write_text(TEXT_A, encoding="utf-8")
    assert (
        main(
            [
                "ngram-cache",
                "build",
                str(tmp_path / "ok.txt"),
                "-o",
                str(tmp_path / "no" / "dir" / "o.lcs"),
                "-m",
                str(model),
            ]
        )
        == 1
    )
    assert "cannot write" in capsys.readouterr().err
    assert not (tmp_path / "o.lcs").exists()
