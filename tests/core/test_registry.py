"""Drafter registry: names, priority, clear errors, and a real third-party plugin via entry points."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
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
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams

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
