"""The drafters' own options on the CLI's parser: added only when a command line may use them
(frontends/cli/deferred_options.py), and then exactly what a parser that always has them gives."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from spekula.fixtures.tiny_gguf import tiny_model_path
from spekula.frontends.cli import cmd_generate
from spekula.frontends.cli.main import build_parser
from spekula.frontends.cli.options import spec_params_from_args


def _cli(*argv: str) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    line = ["generate", *argv]
    parser = build_parser(line)
    return parser, parser.parse_args(line)


def _always(*argv: str) -> argparse.Namespace:
    """`spekula generate`'s options on a plain parser, which adds the drafters' options at once."""
    p = argparse.ArgumentParser()
    cmd_generate.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("argv", [
    ("--spec-type", "ngram-mod"),
    ("--spec-type=ngram-simple,ngram-mod", "--spec-ngram-simple-size-n", "4"),
    ("--spec-ngram-mod-n-max", "10"),
    ("--spec-ngram-mod-n-mi", "10"),  # an abbreviation argparse completes
    ("--spec-default",),
    ("-lcs", "static.bin", "--spec-draft-n-max", "5"),
    ("--spec-type", "none", "-n", "-1"),
])
def test_a_command_line_that_may_use_them_gets_the_same_speculation_settings(argv: tuple[str, ...]) -> None:
    _, args = _cli(*argv)
    assert spec_params_from_args(args) == spec_params_from_args(_always(*argv))


def test_a_command_line_without_speculation_leaves_them_out() -> None:
    parser, args = _cli("-m", "x.gguf", "-p", "hi", "-n", "-1", "--temp", "0", "-t", "2", "-c", "2048")
    assert not hasattr(args, "spec_ngram_mod_n_max")
    spec = spec_params_from_args(args)
    assert spec.types == () and spec.drafter_options == {}
    # the plain settings are those of a parser that has them all
    always = _always("-m", "x.gguf", "-p", "hi", "-n", "-1", "--temp", "0", "-t", "2", "-c", "2048")
    plain = {k: v for k, v in vars(args).items() if k != "command"}
    assert {k: v for k, v in vars(always).items() if k in plain} == plain


def test_help_lists_them_and_the_installed_types() -> None:
    parser, _ = _cli("-p", "hi")
    generate = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["generate"]
    text = " ".join(generate.format_help().split())
    assert "--spec-ngram-mod-n-max N" in text and "--lookup-cache-static" in text
    assert "accumulating: none, ngram-simple, ngram-map-k," in text


def test_an_unknown_option_is_still_refused() -> None:
    with pytest.raises(SystemExit):
        _cli("-p", "hi", "--no-such-option")


@pytest.mark.timeout(300)
def test_generate_without_speculation_loads_no_drafter() -> None:
    """The point of deferring: no drafter module (nor the entry-point metadata) is imported."""
    model = str(tiny_model_path("llama"))
    script = ("import json, sys\n"
              "from spekula.frontends.cli.main import main\n"
              f"assert main(['generate', '-m', {model!r}, '-p', 'hi', '-n', '1', '--temp', '0', '-t', '1']) == 0\n"
              "print(json.dumps(sorted(m for m in sys.modules if m.startswith('spekula.drafters'))))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == []
