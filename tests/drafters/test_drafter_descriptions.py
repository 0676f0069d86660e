"""What the drafters declare about themselves, and everything built from it: the CLI options of
`spekula` and `spekula-server`, the priority order, docs/drafters.md and the runtime table."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from spekula.core.drafting.description import DrafterOption
from spekula.core.drafting.draft_models import DFlashRuntime, Eagle3Runtime, runtime_class
from spekula.core.drafting.mtp_runtime import MtpRuntime
from spekula.core.drafting.reference import render
from spekula.core.drafting.registry import builtin_spec_types, drafter_entries
from spekula.core.errors import ConfigError
from spekula.drafters.model.runtimes import DRAFT_RUNTIMES
from spekula.frontends.cli import llama_server_compat as compat
from spekula.frontends.cli.options import add_engine_options, spec_params_from_args

DOCS = Path(__file__).parents[2] / "docs" / "drafters.md"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_engine_options(p)
    return p


def test_docs_drafters_md_is_the_rendering() -> None:
    assert DOCS.read_text(encoding="utf-8") == render(), (
        "docs/drafters.md is stale: python -m spekula.core.drafting.reference > docs/drafters.md")


def test_builtin_priority_is_the_fixed_order() -> None:
    assert builtin_spec_types() == (
        "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache", "suffix",
        "draft-simple", "draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark")


def test_every_declared_option_is_on_the_cli_with_its_default() -> None:
    parser = _parser()
    spellings = {s: a for a in parser._actions for s in a.option_strings}
    options = [o for e in drafter_entries() for o in e.description.options]
    assert len(options) >= 20
    for opt in options:
        for spelled in opt.spellings:
            assert spellings[spelled].default == opt.default, spelled
    spec = spec_params_from_args(parser.parse_args([]))
    assert spec.drafter_options == {o.name: o.default for o in options if o.default is not None}


def test_spekula_server_translates_exactly_the_llama_cpp_drafter_options() -> None:
    for entry in drafter_entries():
        for opt in entry.description.options:
            for spelled in opt.spellings:
                if opt.llama_cpp:
                    assert compat.BY_NAME[spelled].kind == "translated", spelled
                else:
                    assert spelled not in compat.BY_NAME, spelled
    tr = compat.translate(["--spec-ngram-mod-n-max", "32", "-lcs", "static.bin"])
    assert not tr.errors and tr.args[:4] == ["--spec-ngram-mod-n-max", "32", "--lookup-cache-static", "static.bin"]
    args = _parser().parse_args(tr.args)
    assert spec_params_from_args(args).drafter_options["lookup-cache-static"] == "static.bin"


@pytest.mark.parametrize("option", ["--spec-draft-p-split", "--draft-p-split"])
def test_p_split_is_refused_by_name_in_spekula(option: str) -> None:
    with pytest.raises(argparse.ArgumentError, match="not implemented by spekula") as info:
        _parser().parse_args([option, "0.1"])
    assert option in str(info.value)


def test_p_split_is_refused_by_name_in_spekula_server() -> None:
    assert compat.translate(["--draft-p-split", "0.1"]).errors == [
        "--draft-p-split (the draft-tree split probability: spekula drafts one sequence) is not implemented by spekula"]
    from_env = compat.translate([], {"LLAMA_ARG_SPEC_DRAFT_P_SPLIT": "0.1"}).errors
    assert len(from_env) == 1 and from_env[0].startswith("$LLAMA_ARG_SPEC_DRAFT_P_SPLIT")


def test_option_values_are_converted_and_checked() -> None:
    opt = DrafterOption("x-n", int, 3, "n", minimum=1, maximum=8)
    assert opt.convert(None) == 3 and opt.convert("5") == 5
    with pytest.raises(ConfigError, match=r"--x-n must be in \[1, 8\], got 9"):
        opt.convert(9)
    with pytest.raises(ConfigError, match=r"--x-n must be in \[1, 4\], got 5"):
        opt.convert(5, maximum=4)
    with pytest.raises(ConfigError, match="--x-n: expected an integer, got 'a'"):
        opt.convert("a")
    ratio = DrafterOption("x-f", float, 1.0, "f", minimum=0.0, maximum=2.0, minimum_open=True)
    with pytest.raises(ConfigError, match=r"--x-f must be in \(0.0, 2.0\], got 0.0"):
        ratio.convert(0)
    with pytest.raises(ConfigError, match=r"must be in \(0.0, 2.0\], got nan"):
        ratio.convert("nan")
    assert DrafterOption("x-s", str, None, "s").convert(None) is None


def test_runtime_table_names_runtimes_of_the_right_kind() -> None:
    import importlib

    from spekula.core.drafting.assistant_runtime import AssistantRuntime

    want = {"eagle3": Eagle3Runtime, "dflash": DFlashRuntime, "dspark": DFlashRuntime, "mtp": MtpRuntime,
            "assistant": AssistantRuntime}
    for (backend, kind), entry in DRAFT_RUNTIMES.items():
        module, _, attr = entry.class_path.partition(":")
        cls = getattr(importlib.import_module(module), attr)
        assert issubclass(cls, want[kind]), (backend, kind)


def test_a_backend_without_a_runtime_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="no runtime for onnx"):
        runtime_class(DRAFT_RUNTIMES, "onnx", "eagle3", "no runtime for onnx")
    cls, entry = runtime_class(DRAFT_RUNTIMES, "native", "dspark", "unused")
    assert cls.__name__ == "TorchDFlashRuntime" and not entry.shares_target  # DSpark: torch beside native


def test_a_plugin_option_that_is_already_spelled_is_left_out() -> None:
    """Another drafter's (or a core option's) spelling must not break every command."""
    from spekula.core.drafting.description import DrafterDescription
    from spekula.core.drafting.registry import DrafterEntry
    from spekula.frontends.cli.options import _add_drafter_options

    parser = _parser()
    group = parser.add_argument_group("plugin")
    clash = DrafterOption("temp", float, 1.0, "clashes with the sampling option")
    fresh = DrafterOption("demo-fresh", int, 2, "a new one")
    entry = DrafterEntry("demo", object, DrafterDescription("demo", options=(clash, fresh)), False, False)
    _add_drafter_options(group, entry)
    args = parser.parse_args(["--demo-fresh", "5"])
    assert args.demo_fresh == 5 and args.temp == 0.8  # --temp is still the sampling option
