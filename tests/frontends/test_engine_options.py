"""CLI options with llama.cpp's names/defaults, removed options, and build_engine's clear errors."""

from __future__ import annotations

import argparse
import threading
from pathlib import Path

import pytest

from spekula.core.drafting.registry import drafter_entries
from spekula.core.errors import ConfigError, ModelFileError, SpekulaError
from spekula.frontends.cli.options import (
    add_engine_options,
    build_engine,
    spec_params_from_args,
)

# The llama.cpp n-gram options, as the drafters declare them.
NGRAM_INT_OPTIONS = [o.name for e in drafter_entries() for o in e.description.options if o.name.startswith("spec-ngram-")]


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_engine_options(p)
    return p.parse_args(list(argv))


def test_defaults_match_llama_cpp() -> None:
    args = _parse()
    spec = spec_params_from_args(args)
    assert spec.types == () and spec.n_max == 3 and spec.n_min == 0 and spec.p_min == 0.0
    assert spec.draft_sampling == "greedy" and spec.synth_rates is None and spec.synth_len is None
    assert spec.drafter_options["spec-ngram-simple-size-n"] == 12
    assert spec.drafter_options["spec-ngram-mod-n-max"] == 64
    assert set(NGRAM_INT_OPTIONS) <= set(spec.drafter_options)
    assert (args.ctx_size, args.parallel, args.batch_size, args.n_predict, args.seed) == (4096, 1, 512, -1, -1)
    assert (args.temp, args.top_k, args.top_p, args.min_p) == (0.8, 40, 0.95, 0.05)


def test_spec_type_accumulates_in_priority_order() -> None:
    args = _parse("--spec-type", "ngram-mod", "--spec-type", "ngram-simple,ngram-mod", "--spec-draft-n-max", "5",
                  "--spec-ngram-simple-size-n", "4", "-lcs", "static.bin", "--spec-synth-rates", "0.5,0.25")
    spec = spec_params_from_args(args)
    assert spec.types == ("ngram-simple", "ngram-mod") and spec.n_max == 5
    assert spec.drafter_options["spec-ngram-simple-size-n"] == 4
    assert spec.drafter_options["lookup-cache-static"] == "static.bin"
    assert spec.synth_rates == (0.5, 0.25)


def test_spec_default_appends_ngram_mod() -> None:
    spec = spec_params_from_args(_parse("--spec-default", "--spec-ngram-mod-n-max", "10"))
    assert spec.types == ("ngram-mod",)
    assert spec.drafter_options["spec-ngram-mod-n-max"] == 64  # --spec-default sets 24/48/64


@pytest.mark.parametrize("option", ["--draft", "--draft-n", "--draft-max", "--draft-min", "--draft-n-min",
                                    "--spec-ngram-size-n", "--spec-ngram-size-m", "--spec-ngram-min-hits"])
def test_removed_options(option: str) -> None:
    with pytest.raises(argparse.ArgumentError, match="argument has been removed"):
        _parse(option, "4")


def test_unknown_spec_type_is_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown spec type 'bogus'; available: none"):
        spec_params_from_args(_parse("--spec-type", "bogus"))


def test_negative_draft_n_max_rejected() -> None:
    with pytest.raises(argparse.ArgumentError):
        _parse("--spec-draft-n-max", "-1")


def test_draft_hf_with_md_is_a_config_error() -> None:
    # -hfd itself resolves through the hub cache (tests/test_hf_models.py); with -md it is ambiguous.
    with pytest.raises(ConfigError, match="not both"):
        build_engine(_parse("--spec-draft-hf", "org/repo", "-md", "d.gguf", "-m", "x.gguf"))


def test_corrupt_model_is_model_file_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 10)
    with pytest.raises(ModelFileError):
        build_engine(_parse("-m", str(bad)))
    with pytest.raises(SpekulaError):
        build_engine(_parse("-m", str(tmp_path / "missing.gguf")))


def test_a_tokenizer_failure_releases_the_backend_waiting_for_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend's load waits for the tokenizer before packing its output head (build_engine, for any
    vocabulary here): a tokenizer that fails must end that wait, and its error is the one reported."""
    from sliding_window_checks import edited

    from spekula.fixtures.tiny_gguf import tiny_model_path
    from spekula.frontends.cli import in_thread

    monkeypatch.setattr(in_thread, "WAIT_FOR_TOKENIZER_MIN_VOCAB", 0)

    bad = edited(tiny_model_path("llama", weight_type="Q8_0"), tmp_path / "bad-tokenizer.gguf",
                 meta={"tokenizer.ggml.model": "bogus"})
    errors: list[BaseException] = []

    def build() -> None:
        try:
            build_engine(_parse("-m", str(bad), "-c", "256", "-t", "1"))
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=build)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive(), "build_engine hung: the backend never stopped waiting for the tokenizer"
    assert len(errors) == 1 and isinstance(errors[0], ModelFileError) and "bogus" in str(errors[0])


def test_a_backend_loaded_after_the_tokenizer_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the head waiting for the tokenizer (any vocabulary here), build_engine gives a working engine."""
    from spekula.fixtures.tiny_gguf import tiny_model_path
    from spekula.frontends.cli import in_thread

    monkeypatch.setattr(in_thread, "WAIT_FOR_TOKENIZER_MIN_VOCAB", 0)
    engine = build_engine(_parse("-m", str(tiny_model_path("llama", weight_type="Q8_0")), "-c", "256", "-t", "1"))
    try:
        assert engine.tokenizer.n_vocab == engine.backend.info.n_vocab
    finally:
        engine.close()
