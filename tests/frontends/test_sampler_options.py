"""The sampler-stage command-line options: llama.cpp's spellings into SamplingParams, and out-of-range
values refused by argparse naming the option."""

from __future__ import annotations

import argparse

import pytest

from spekula.core.params import DEFAULT_SAMPLERS, SamplingParams
from spekula.frontends.cli.options import add_sampling_options, sampling_from_args


def parse(argv: str) -> SamplingParams:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_sampling_options(p)
    return sampling_from_args(p.parse_args(argv.split()))


def test_defaults_are_llama_cpp_s() -> None:
    s = parse("")
    assert (s.dry_multiplier, s.dry_base, s.dry_allowed_length, s.dry_penalty_last_n) == (0.0, 1.75, 2, 64)
    assert s.dry_sequence_breakers == ("\n", ":", '"', "*")
    assert (s.xtc_probability, s.xtc_threshold, s.typical_p, s.top_n_sigma) == (0.0, 0.1, 1.0, -1.0)
    assert (s.dynatemp_range, s.dynatemp_exponent, s.mirostat, s.mirostat_tau, s.mirostat_eta) == (0.0, 1.0, 0, 5.0, 0.1)
    assert s.samplers == DEFAULT_SAMPLERS


def test_every_option_reaches_the_sampler() -> None:
    s = parse("--dry-multiplier 0.8 --dry-base 1.5 --dry-allowed-length 3 --dry-penalty-last-n 128 "
              "--dry-sequence-breaker . --dry-sequence-breaker ; --xtc-probability 0.5 --xtc-threshold 0.2 "
              "--typical 0.9 --top-nsigma 1.5 --dynatemp-range 0.3 --dynatemp-exp 2 --mirostat 2 --mirostat-lr 0.2 "
              "--mirostat-ent 4 --samplers top_k;temperature")
    assert (s.dry_multiplier, s.dry_base, s.dry_allowed_length, s.dry_penalty_last_n) == (0.8, 1.5, 3, 128)
    assert s.dry_sequence_breakers == (".", ";")
    assert (s.xtc_probability, s.xtc_threshold, s.typical_p, s.top_n_sigma) == (0.5, 0.2, 0.9, 1.5)
    assert (s.dynatemp_range, s.dynatemp_exponent, s.mirostat, s.mirostat_eta, s.mirostat_tau) == (0.3, 2.0, 2, 0.2, 4.0)
    assert s.samplers == ("top_k", "temperature")
    assert parse("--sampler-seq kt").samplers == ("top_k", "temperature")
    assert parse("--dry-sequence-breaker none").dry_sequence_breakers == ()


@pytest.mark.parametrize("argv", ["--dry-base 0.5", "--dry-multiplier -1", "--dry-allowed-length -1",
                                  "--dry-penalty-last-n -1", "--xtc-probability 1.5", "--xtc-threshold nan",
                                  "--typical 2", "--mirostat 3", "--mirostat-ent -1", "--dynatemp-range -1",
                                  "--samplers top_k;bogus", "--sampler-seq kz", "--samplers infill"])
def test_out_of_range_values_are_refused(argv: str) -> None:
    with pytest.raises(argparse.ArgumentError, match=argv.split()[0]):
        parse(argv)
