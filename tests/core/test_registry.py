"""Drafter registry: names, priority, clear errors, and a real third-party plugin via entry points."""

from __future__ import annotations

import argparse
import importlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_helpers import error_line, run_cli
from toy_backend import (
    GarbageDrafter,
    ObservingDrafter,
    ToyBackend,
    ToyTokenizer,
    make_engine,
    plain_decode,
    run_requests,
)

from spekula.core.drafting.registry import (
    available_drafters,
    builtin_ranks,
    builtin_spec_types,
    create_drafters,
    load_drafter_class,
    parse_spec_types,
    priority_key,
)
from spekula.core.errors import ConfigError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.fixtures.tiny_gguf import tiny_model_path
from spekula.frontends.cli.options import add_engine_options, build_engine

PLUGIN_DIR = Path(__file__).parents[1] / "plugin_dist"


def test_builtin_names_are_declared() -> None:
    names = available_drafters()
    for name in ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache"):
        assert name in names


def test_parse_spec_types_accumulates_and_orders() -> None:
    assert parse_spec_types(["ngram-mod,ngram-simple", "ngram-mod"]) == ("ngram-simple", "ngram-mod")
    assert parse_spec_types(["draft-simple", "ngram-cache"]) == ("ngram-cache", "draft-simple")
    assert parse_spec_types(["none,ngram-mod"]) == ()  # a none inside one list collapses that list
    assert parse_spec_types(["none", "ngram-mod"]) == ("ngram-mod",)
    with pytest.raises(ConfigError, match="unknown spec type 'ngram-foo'; available: none, ngram-simple"):
        parse_spec_types(["ngram-foo"])


def test_third_party_priority() -> None:
    draftless_builtin = [priority_key(n, False) for n in builtin_spec_types() if not builtin_ranks()[n][0]]
    model_builtin = [priority_key(n, True) for n in builtin_spec_types() if builtin_ranks()[n][0]]
    third_draftless, third_model = priority_key("zz-plugin", False), priority_key("aa-plugin", True)
    assert max(draftless_builtin) < third_draftless < min(model_builtin)
    assert max(model_builtin) < third_model


def test_directly_registered_drafters_are_ordered_by_model_based() -> None:
    backend = ToyBackend()
    from spekula.core.drafting.drafter import DrafterContext

    ctx = DrafterContext(spec=SpecParams(), target=backend, tokenizer=None, n_seq_max=1)
    extra = {"test-observer": ObservingDrafter, "test-garbage": GarbageDrafter}
    drafters = create_drafters(["test-observer", "test-garbage"], ctx, extra)
    assert [d.name for d in drafters] == ["test-garbage", "test-observer"]


def test_unknown_name_lists_available() -> None:
    with pytest.raises(ConfigError) as info:
        load_drafter_class("not-a-drafter")
    assert "available: none," in str(info.value) and "ngram-mod" in str(info.value)


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """pip-install the demo plugin distribution into this venv; uninstall afterwards."""
    src = tmp_path_factory.mktemp("plugin") / "plugin_dist"
    shutil.copytree(PLUGIN_DIR, src)  # build outside the repository (pip writes build/ and egg-info/)
    pip = [sys.executable, "-m", "pip"]
    proc = subprocess.run([*pip, "install", "--no-deps", "--no-build-isolation", "--no-index", "-q", str(src)],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"could not install the plugin distribution:\n{proc.stdout}\n{proc.stderr}")
    importlib.invalidate_caches()
    try:
        yield
    finally:
        subprocess.run([*pip, "uninstall", "-y", "-q", "spekula-plugin-demo"], capture_output=True, timeout=300)
        sys.modules.pop("spekula_plugin_demo", None)
        sys.modules.pop("spekula_plugin_demo.broken", None)
        importlib.invalidate_caches()


@pytest.mark.anyio
async def test_third_party_plugin_drafts_through_the_engine(installed_plugin: None) -> None:
    assert "demo-lookback" in available_drafters()
    types = parse_spec_types(["demo-lookback,ngram-simple"])
    assert types == ("ngram-simple", "demo-lookback")  # third-party draftless after built-in draftless
    engine = make_engine(ToyBackend(), ToyTokenizer(), spec=SpecParams(types=("demo-lookback",), adaptive=False))
    assert "demo-lookback" in engine.props()["available_drafters"]
    greedy = SamplingParams(temperature=0.0)
    prompt = [3, 9, 4, 17, 5, 8, 2, 11]
    [final] = await run_requests(engine, [CompletionRequest(prompt, n_predict=60, sampling=greedy)])
    ref = plain_decode(ToyBackend(), prompt, n_predict=60, sampling=greedy, seed=0, is_eog=lambda t: False,
                       n_ctx=256)
    assert final.tokens == ref
    st = engine.stats()["drafters"]["demo-lookback"]
    assert st["gen_tokens"] > 0 and st["acc_tokens"] > 0
    assert final.timings["draft_n"] == st["gen_tokens"]


def test_broken_plugin_is_a_clear_config_error(installed_plugin: None) -> None:
    with pytest.raises(ConfigError) as info:
        make_engine(ToyBackend(), ToyTokenizer(), spec=SpecParams(types=("demo-broken",)))
    msg = str(info.value)
    assert "demo-broken" in msg and "failed to load" in msg and "ImportError" in msg
    assert "available:" in msg and "demo-lookback" in msg


def test_plugin_option_is_in_the_cli_help(installed_plugin: None) -> None:
    proc = run_cli("generate", "--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "--demo-lookback-n-max N" in text and "demo-lookback: longest draft (default: 4; [1, 64])" in text


def test_plugin_option_out_of_range_is_refused_by_name(installed_plugin: None) -> None:
    line = error_line(run_cli("generate", "-m", tiny_model_path("llama"), "-p", "hi", "-n", "2",
                              "--spec-type", "demo-lookback", "--demo-lookback-n-max", "0"))
    assert "--demo-lookback-n-max must be in [1, 64], got 0" in line


def _cli_engine(*argv: str):  # noqa: ANN202 - an Engine
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_engine_options(parser)
    return build_engine(parser.parse_args(["-m", str(tiny_model_path("llama")), "-c", "256", *argv]))


@pytest.mark.anyio
async def test_plugin_takes_its_option_and_drafts_losslessly(installed_plugin: None) -> None:
    """Registered through the entry point alone: its option reaches it from the command line, and its
    drafts leave the output exactly that of plain decoding on a real (tiny) model."""
    from spekula_plugin_demo import LookbackDrafter

    tok = Tokenizer.from_gguf(GGUFFile(tiny_model_path("llama")))
    prompt = tok.encode("one two three one two three one two three one two", add_special=True, parse_special=True)
    greedy = SamplingParams(temperature=0.0)
    spec = _cli_engine("--spec-type", "demo-lookback", "--demo-lookback-n-max", "3", "--spec-adaptive", "off")
    plain = _cli_engine()
    try:
        [drafted] = await run_requests(spec, [CompletionRequest(list(prompt), n_predict=48, sampling=greedy, ignore_eos=True)],
                                       timeout=120)
        [ref] = await run_requests(plain, [CompletionRequest(list(prompt), n_predict=48, sampling=greedy, ignore_eos=True)],
                                   timeout=120)
        assert LookbackDrafter.created and LookbackDrafter.created[-1].n_max == 3
        assert drafted.tokens == ref.tokens
        assert spec.stats()["drafters"]["demo-lookback"]["gen_tokens"] > 0
    finally:
        spec.close()
        plain.close()
