"""The sampler-stage options, with llama.cpp's spellings and defaults: DRY, XTC, typical-p,
top-n-sigma, dynamic temperature, Mirostat and the chain's order (`--samplers`, `--sampler-seq`).

A value out of range is an argparse error naming the option; what the sampler itself checks
(core/verify/sampling_checks.py) holds too.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from spekula.core.errors import ConfigError
from spekula.core.params import SamplingParams
from spekula.core.verify.sampler_chain import samplers_from_chars, samplers_from_names


def _ranged(kind: type, lo: float, hi: float) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not lo <= value <= hi:  # NaN fails too
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}], got {text}")
        return value

    return parse


def _chain(parse: Callable[[str], tuple[str, ...]]) -> Callable[[str], tuple[str, ...]]:
    def run(text: str) -> tuple[str, ...]:
        try:
            return parse(text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return run


def add_sampler_stage_options(g: argparse._ArgumentGroup, d: SamplingParams) -> None:
    i32 = 2**31 - 1
    g.add_argument("--dry-multiplier", type=_ranged(float, 0.0, 1e6), default=d.dry_multiplier,
                   help=f"DRY: penalty multiplier (default: {d.dry_multiplier}; 0: off)")
    g.add_argument("--dry-base", type=_ranged(float, 1.0, 1e6), default=d.dry_base,
                   help=f"DRY: base of the penalty's growth with the repeat's length (default: {d.dry_base})")
    g.add_argument("--dry-allowed-length", type=_ranged(int, 0, i32), default=d.dry_allowed_length,
                   help=f"DRY: repeats longer than this are penalised (default: {d.dry_allowed_length})")
    g.add_argument("--dry-penalty-last-n", type=_ranged(int, 0, i32), default=d.dry_penalty_last_n,
                   help=f"DRY: how many recent tokens to look back over (default: {d.dry_penalty_last_n}; 0: off)")
    g.add_argument("--dry-sequence-breaker", action="append", default=None, metavar="STRING",
                   help="DRY: a sequence breaker (repeatable; replaces the defaults \\n : \" *; 'none': no breakers)")
    g.add_argument("--xtc-probability", type=_ranged(float, 0.0, 1.0), default=d.xtc_probability,
                   help=f"XTC: chance of removing the top tokens (default: {d.xtc_probability}; 0: off)")
    g.add_argument("--xtc-threshold", type=_ranged(float, 0.0, 1.0), default=d.xtc_threshold,
                   help=f"XTC: tokens at or above this probability are removed (default: {d.xtc_threshold}; > 0.5: off)")
    g.add_argument("--typical", "--typical-p", dest="typical_p", type=_ranged(float, 0.0, 1.0), default=d.typical_p,
                   help=f"locally typical sampling, parameter p (default: {d.typical_p}; 1: off)")
    g.add_argument("--top-nsigma", "--top-n-sigma", dest="top_n_sigma", type=_ranged(float, -100.0, 100.0),
                   default=d.top_n_sigma, help=f"top-n-sigma sampling (default: {d.top_n_sigma}; <= 0: off)")
    g.add_argument("--dynatemp-range", type=_ranged(float, 0.0, 100.0), default=d.dynatemp_range,
                   help=f"dynamic temperature range (default: {d.dynatemp_range}; 0: off)")
    g.add_argument("--dynatemp-exp", dest="dynatemp_exponent", type=_ranged(float, 0.0, 100.0),
                   default=d.dynatemp_exponent, help=f"dynamic temperature exponent (default: {d.dynatemp_exponent})")
    g.add_argument("--mirostat", type=_ranged(int, 0, 2), default=d.mirostat,
                   help="Mirostat sampling: 0 off, 1 Mirostat, 2 Mirostat 2.0; replaces the sampler chain "
                        f"(default: {d.mirostat})")
    g.add_argument("--mirostat-lr", dest="mirostat_eta", type=_ranged(float, 0.0, 100.0), default=d.mirostat_eta,
                   help=f"Mirostat learning rate, eta (default: {d.mirostat_eta})")
    g.add_argument("--mirostat-ent", dest="mirostat_tau", type=_ranged(float, 0.0, 100.0), default=d.mirostat_tau,
                   help=f"Mirostat target entropy, tau (default: {d.mirostat_tau})")
    g.add_argument("--samplers", type=_chain(lambda v: samplers_from_names(v.split(";"))), default=None,
                   metavar="NAMES", help=f"the sampler chain, ';'-separated (default: {';'.join(d.samplers)})")
    g.add_argument("--sampler-seq", "--sampling-seq", dest="sampler_seq", type=_chain(samplers_from_chars),
                   default=None, metavar="CODES", help="the sampler chain as one-letter codes (default: edskypmxt)")


def sampler_stages_from_args(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {name: getattr(args, name) for name in (
        "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "xtc_probability", "xtc_threshold",
        "typical_p", "top_n_sigma", "dynatemp_range", "dynatemp_exponent", "mirostat", "mirostat_eta", "mirostat_tau")}
    breakers = args.dry_sequence_breaker
    if breakers is not None:
        out["dry_sequence_breakers"] = () if breakers == ["none"] else tuple(b for b in breakers if b != "none")
    chain = args.samplers if args.samplers is not None else args.sampler_seq
    if chain is not None:
        out["samplers"] = chain
    return out
