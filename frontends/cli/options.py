"""Shared CLI options (model, backend, sampling, speculation) with llama.cpp's names and defaults,
and `build_engine(args)`, which turns parsed options into a ready Engine.

Speculation options follow docs/semantics.md §6: `--spec-type` accumulates, every per-drafter
option lands in `SpecParams.drafter_options` under its name without the leading dashes, and the
options llama.cpp removed fail with its "argument has been removed" message. The per-drafter options
are the ones the installed drafters declare (core/drafting/description.py), plugins' included.

Over 400 lines: the options and the functions that read them back into settings and an engine change
together, one option at a time.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import structlog

from spekula.backends.gguf.encoder import is_encoder
from spekula.core.backend import BACKEND_NAMES, BackendOptions, backend_class, resolve_backend_name
from spekula.core.drafting.registry import (
    DrafterEntry,
    available_drafters,
    drafter_entries,
    parse_spec_types,
    priority_key,
)
from spekula.core.engine.engine import Engine, EngineConfig
from spekula.core.errors import ConfigError, ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.core.verify.sampling import check_bias_tokens
from spekula.frontends.cli.deferred_options import add_when_used
from spekula.frontends.cli.embedding_options import serving_pooling
from spekula.frontends.cli.in_thread import BackendLoad
from spekula.frontends.cli.sampler_options import add_sampler_stage_options, sampler_stages_from_args

log = structlog.get_logger("spekula.options")

REMOVED_OPTIONS = ("--draft", "--draft-n", "--draft-max", "--draft-min", "--draft-n-min",
                   "--spec-ngram-size-n", "--spec-ngram-size-m", "--spec-ngram-min-hits")
# llama.cpp options that spekula reads but does not implement: refused by name, never silently dropped.
UNSUPPORTED_OPTIONS: dict[tuple[str, ...], str] = {
    ("--spec-draft-p-split", "--draft-p-split"): "llama.cpp's draft-tree split probability; spekula drafts one "
                                                 "sequence per round, so it has nothing to split",
}


class _Removed(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        raise argparse.ArgumentError(self, "argument has been removed")


def _unsupported(why: str) -> type[argparse.Action]:
    """An option llama.cpp has and spekula does not implement: an error that names it and says why."""

    class Unsupported(argparse.Action):
        def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                     option_string: str | None = None) -> None:
            raise argparse.ArgumentError(self, f"not implemented by spekula ({why})")

    return Unsupported


def _dest(option: str) -> str:
    return option.replace("-", "_")


def _rates(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a probability in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a probability in [0, 1], got {text}")
    return value


# The engine needs a few positions beyond the prompt; below this no request can run.
MIN_CTX = 4


def _ctx_size(text: str) -> int:
    value = int(text)
    if value == 0:
        # llama.cpp reads -c 0 as "the model's training context"; spekula needs an explicit size.
        raise argparse.ArgumentTypeError("0 (the model's training context in llama.cpp) is not supported; "
                                          f"give a size of at least {MIN_CTX} tokens, e.g. -c 4096")
    if value < MIN_CTX:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_CTX} tokens, got {value}")
    return value


def _n_keep(text: str) -> int:
    value = int(text)
    if value < -1:
        raise argparse.ArgumentTypeError(f"must be -1 (the whole prompt) or a count of tokens, got {value}")
    return value


def _n_slots(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 slot, got {value}")
    return value


def installed_spec_types() -> list[str]:
    """Drafter names declared through entry points, by priority."""
    return sorted(available_drafters(), key=lambda n: priority_key(n, False))


def add_model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and backend")
    g.add_argument("-m", "--model", help="target GGUF model (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    g.add_argument("-hf", "-hfr", "--hf-repo", dest="hf_repo", metavar="REPO",
                   help="target GGUF from Hugging Face repo <user>/<repo>[:quant], as llama.cpp: the hub cache "
                        "first, else a download (not with HF_HUB_OFFLINE=1); quant e.g. Q8_0 (default: "
                        "Q4_K_M, then Q8_0, then the first GGUF)")
    g.add_argument("-hff", "--hf-file", dest="hf_file", metavar="FILE",
                   help="the file to take from the -hf repo (overrides its :quant)")
    g.add_argument("--chat-template", metavar="NAME|JINJA", default=None,
                   help="chat template instead of the model's: the Jinja source itself, or the name of a "
                        "format llama.cpp builds in (chatml, llama2, llama3, mistral-v7, gemma, phi3, "
                        "command-r, ...: the full list in docs/http.md)")
    g.add_argument("--chat-template-file", metavar="FILE", default=None,
                   help="chat template instead of the model's, from a Jinja file")
    g.add_argument("--chat-template-kwargs", metavar="JSON", default=None,
                   help='extra variables for the chat template, a JSON object, e.g. \'{"enable_thinking": false}\' '
                        "(a request's chat_template_kwargs add to them)")
    g.add_argument("-rea", "--reasoning", type=_reasoning, default="auto", metavar="on|off|auto",
                   help="thinking in chat templates that switch it (enable_thinking, e.g. Qwen3's): on, off, or "
                        "auto to keep the template's default (default: auto)")
    g.add_argument("--reasoning-effort", default="default", metavar="LEVEL",
                   help="reasoning_effort given to the chat template (e.g. low, medium, high for gpt-oss); "
                        "default keeps the template's own (default: default)")
    g.add_argument("-c", "--ctx-size", type=_ctx_size, default=4096, help="context size per slot (default: 4096)")
    g.add_argument("-np", "--parallel", type=_n_slots, default=1, help="number of slots (default: 1)")
    g.add_argument("-b", "--batch-size", type=int, default=512, help="max tokens per forward (default: 512)")
    g.add_argument("--context-shift", action=argparse.BooleanOptionalAction, default=False,
                   help="when a generating slot's context fills, keep the first --keep tokens, drop half of the rest "
                        "and go on, instead of stopping with finish reason length (default: off, as llama-server)")
    g.add_argument("-sps", "--slot-prompt-similarity", type=_probability, default=0.1, metavar="F",
                   help="a request goes to the idle slot whose cached prompt prefix covers more than F of its "
                        "prompt (0: least recently used slot only; default: %(default)s)")
    g.add_argument("--backend", choices=BACKEND_NAMES, default="auto",
                   help="runtime: auto (native kernels over the GGUF blocks on CPU, torch on CUDA), native, "
                        "torch, onnx (default: auto)")
    g.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (default: cpu)")
    g.add_argument("--dtype", choices=("auto", "f32", "f16", "bf16", "q4"), default="auto",
                   help="auto = the GGUF's own blocks on CPU (native backend), bf16 on CUDA; f32/f16/bf16 pick torch; "
                        "q4 (onnx only): GGUF Q4/Q8 blocks through "
                        "MatMulNBits, faster but lossy against f32")
    g.add_argument("-t", "--threads", type=int, default=0, help="CPU threads (<= 0: runtime default)")
    g.add_argument("--ort-provider", choices=("auto", "cuda", "cpu"), default="auto",
                   help="onnxruntime execution provider (onnx backend)")
    g.add_argument("-v", "--verbose", action="store_true",
                   help="debug logging: structured events, per-position acceptance and the histogram too")
    g.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="text: llama.cpp-style lines only; json: also every structured event as one JSON "
                        "object per line (default: text)")


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    d = SamplingParams()
    g = p.add_argument_group("sampling")
    g.add_argument("-n", "--n-predict", type=int, default=-1, help="tokens to generate (-1: until EOS/context)")
    g.add_argument("--keep", type=_n_keep, default=0, metavar="N",
                   help="tokens of the prompt a context shift keeps (-1: all; default: 0; per request: n_keep)")
    g.add_argument("--temp", type=float, default=d.temperature, help=f"temperature (default: {d.temperature}; <= 0 greedy)")
    g.add_argument("--top-k", type=int, default=d.top_k, help=f"(default: {d.top_k})")
    g.add_argument("--top-p", type=float, default=d.top_p, help=f"(default: {d.top_p})")
    g.add_argument("--min-p", type=float, default=d.min_p, help=f"(default: {d.min_p})")
    g.add_argument("--repeat-penalty", type=float, default=d.repeat_penalty, help=f"(default: {d.repeat_penalty})")
    g.add_argument("--repeat-last-n", type=int, default=d.repeat_last_n, help=f"(default: {d.repeat_last_n})")
    g.add_argument("--presence-penalty", type=float, default=d.presence_penalty,
                   help=f"subtracted once from every token in the last --repeat-last-n (default: {d.presence_penalty})")
    g.add_argument("--frequency-penalty", type=float, default=d.frequency_penalty,
                   help=f"subtracted per occurrence in the last --repeat-last-n (default: {d.frequency_penalty})")
    g.add_argument("-s", "--seed", type=int, default=-1, help="RNG seed (-1: random)")
    g.add_argument("-l", "--logit-bias", action="append", default=[], type=logit_bias_arg, metavar="TOKEN_ID(+/-)BIAS",
                   help="add BIAS to a token's logit, e.g. 15043+1 or 15043-1; 15043-inf bans the token "
                        "(repeatable; a server's default for requests that give no logit_bias)")
    add_sampler_stage_options(g, d)
    g.add_argument("--jinja", "--chat", dest="chat", action="store_true",
                   help="render the prompt as a user message through the model's chat template")


def add_spec_options(p: argparse.ArgumentParser) -> None:
    """The speculation options. The drafters' own options (and the list of installed types in --spec-type's
    help) need every drafter class loaded: on the CLI's parser they are added only when the command line
    touches this group, gives an option unknown without them, or asks for help (deferred_options.py)."""
    g = p.add_argument_group("speculative decoding (llama.cpp names)")
    spec_type = g.add_argument("--spec-type", action="append", default=[], metavar="LIST",
                               help="comma-separated drafter types, accumulating")
    g.add_argument("--spec-default", action="store_true", help="append ngram-mod with n_match 24, n_min 48, n_max 64")
    g.add_argument("--spec-draft-n-max", type=_non_negative, default=3, help="draft-model cap (default: 3)")
    g.add_argument("--spec-draft-n-min", type=int, default=0, help="draft-model minimum (default: 0)")
    g.add_argument("--spec-adaptive", choices=("on", "off"), default="on",
                   help="on: the cost model picks each round's draft length within the caps (0 when "
                        "nothing pays); off: draft to the caps, as llama.cpp does (default: on)")
    g.add_argument("--spec-draft-p-min", "--draft-p-min", type=_probability, default=0.0,
                   help="stop drafting when top-1 p < P (default: 0.0)")
    g.add_argument("--spec-draft-sampling", choices=("greedy", "probabilistic"), default="greedy",
                   help="probabilistic: sample drafts and verify by rejection sampling when temp > 0")
    g.add_argument("--spec-synth-rates", type=_rates, default=None, metavar="P0,...",
                   help="benchmark only: unconditional per-position acceptance rates")
    g.add_argument("--spec-synth-len", type=float, default=None, metavar="L",
                   help="benchmark only: mean acceptance length (target token included)")
    g.add_argument("-md", "--spec-draft-model", "--model-draft", dest="spec_draft_model", help="draft GGUF model")
    g.add_argument("-hfd", "--spec-draft-hf", "-hfrd", "--hf-repo-draft", dest="spec_draft_hf",
                   metavar="REPO", help="draft GGUF from Hugging Face repo <user>/<repo>[:quant], found as -hf "
                                        "finds it, then used as -md")
    g.add_argument("-devd", "--spec-draft-device", "--device-draft", dest="spec_draft_device",
                   help="draft device (default: follows --device)")
    g.add_argument("--spec-draft-dtype", choices=("auto", "f32", "f16", "bf16"), default=None,
                   help="draft dtype (default: follows --dtype)")
    g.add_argument("-td", "--spec-draft-threads", "--threads-draft", dest="spec_draft_threads", type=int,
                   default=None, help="draft threads (default: follows --threads)")
    for option in REMOVED_OPTIONS:
        g.add_argument(option, action=_Removed, nargs="?", help=argparse.SUPPRESS)
    for spellings, why in UNSUPPORTED_OPTIONS.items():
        g.add_argument(*spellings, action=_unsupported(why), nargs="?", help=argparse.SUPPRESS)

    def add_installed_drafters() -> None:
        spec_type.help = f"{spec_type.help}: " + ", ".join(["none", *installed_spec_types()])
        entries = drafter_entries()
        for entry in entries:
            _add_drafter_options(g, entry)
        # what spec_params_from_args reads back (a command line that never added them has none)
        p.set_defaults(drafter_option_names=tuple(o.name for e in entries for o in e.description.options))

    add_when_used(p, [s for a in g._group_actions for s in a.option_strings], add_installed_drafters)


def _add_drafter_options(g: argparse._ArgumentGroup, entry: DrafterEntry) -> None:
    """The options a drafter declares. A plugin's option that another one already spells is left out,
    with a warning, rather than breaking every command."""
    for opt in entry.description.options:
        bounds = opt.range_text()
        default = "none" if opt.default is None else opt.default
        text = f"{entry.name}: {opt.help} (default: {default}{'; ' + bounds if bounds else ''})"
        try:
            g.add_argument(*opt.spellings, dest=_dest(opt.name), type=opt.type, default=opt.default,
                           metavar=opt.metavar, help=text.replace("%", "%%"))
        except argparse.ArgumentError as exc:
            log.warning("drafter_option_skipped", drafter=entry.name, option=opt.flag, reason=str(exc))


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """Everything a command that builds an Engine needs."""
    add_model_options(p)
    add_sampling_options(p)
    add_spec_options(p)


def spec_params_from_args(args: argparse.Namespace) -> SpecParams:
    values = list(args.spec_type)
    options: dict[str, Any] = {}
    for name in getattr(args, "drafter_option_names", ()):
        value = getattr(args, _dest(name), None)
        if value is not None:
            options[name] = value
    if args.spec_default:  # llama.cpp's preset: the drafter(s) that declare it, their options at their defaults
        for entry in drafter_entries():
            if entry.description.spec_default:
                values.append(entry.name)
                options.update({o.name: o.default for o in entry.description.options if o.default is not None})
    return SpecParams(types=parse_spec_types(values), n_max=args.spec_draft_n_max, n_min=args.spec_draft_n_min,
                      p_min=args.spec_draft_p_min, draft_sampling=args.spec_draft_sampling,
                      synth_rates=args.spec_synth_rates, synth_len=args.spec_synth_len, drafter_options=options,
                      adaptive=args.spec_adaptive == "on")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n, seed=args.seed,
                          logit_bias=tuple(args.logit_bias), presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, **sampler_stages_from_args(args))


_LOGIT_BIAS_ARG = re.compile(r"(\d+)([+-])(inf|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)")


def logit_bias_arg(value: str) -> tuple[int, float]:
    """llama.cpp's TOKEN_ID(+/-)BIAS: 15043+1, 15043-0.5, 15043-inf (a ban)."""
    m = _LOGIT_BIAS_ARG.fullmatch(value.strip())
    if m is None or (m.group(2) == "+" and m.group(3) == "inf"):
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID(+/-)BIAS such as 15043+1 or 15043-inf, got {value!r}")
    bias = float(m.group(3))
    return int(m.group(1)), -bias if m.group(2) == "-" else bias


def _infer_draft_type(path: str) -> tuple[str, ...]:
    """llama.cpp infers a type from the draft GGUF only for some files (DFlash/DSpark, MTP: docs/semantics.md
    §3); the drafters that claim such files say so in their description. None claims it: no type."""
    f = GGUFFile(path)
    return tuple(e.name for e in drafter_entries() if e.description.implied_by and e.description.implied_by(f))


def _check_model_sources(args: argparse.Namespace) -> None:
    """Conflicting model options fail before anything is loaded or downloaded."""
    if args.model and getattr(args, "hf_repo", None):
        raise ConfigError("give either -m/--model or -hf/--hf-repo, not both")
    if getattr(args, "hf_file", None) and not getattr(args, "hf_repo", None):
        raise ConfigError("-hff/--hf-file names a file in the -hf/--hf-repo repository; give -hf too")
    if args.spec_draft_model and getattr(args, "spec_draft_hf", None):
        raise ConfigError("give either -md/--spec-draft-model or -hfd/--spec-draft-hf, not both")


def resolve_model_path(args: argparse.Namespace) -> str:
    """-m as given, else the -hf repo's GGUF (hub cache, else download), else the embedded default."""
    _check_model_sources(args)
    if args.model:
        return str(args.model)
    if getattr(args, "hf_repo", None):
        from spekula.backends.gguf.hf_models import parse_hf_repo, resolve_hf_model

        return str(resolve_hf_model(parse_hf_repo(args.hf_repo, filename=getattr(args, "hf_file", None))))
    from spekula.backends.gguf.default_model import ensure_default_model

    return str(ensure_default_model())


def resolve_draft_path(args: argparse.Namespace) -> str | None:
    """-md as given, else the -hfd repo's GGUF, resolved like -hf; None without a draft model."""
    _check_model_sources(args)
    if getattr(args, "spec_draft_hf", None):
        from spekula.backends.gguf.hf_models import parse_hf_repo, resolve_hf_model

        spec = parse_hf_repo(args.spec_draft_hf, option="-hfd", local_option="-md")
        return str(resolve_hf_model(spec))
    return str(args.spec_draft_model) if args.spec_draft_model else None


def _checked_spec(args: argparse.Namespace) -> tuple[SpecParams, str | None]:
    """The options' speculation settings and the draft model's path, checked (no weights loaded)."""
    _check_model_sources(args)
    if args.parallel < 1:
        raise ConfigError(f"--parallel must be >= 1; got {args.parallel}")
    spec = spec_params_from_args(args)
    draft_path = resolve_draft_path(args)  # -hfd: from the hub cache or downloaded, then exactly like -md
    if draft_path and not spec.types and not args.spec_type:
        spec = spec.with_(types=_infer_draft_type(draft_path))
    if draft_path and not spec.types:
        # llama.cpp loads nothing for a plain -md either; say so instead of silently drafting nothing.
        log.warning("draft_model_unused", draft_model=draft_path,
                    hint="; ".join(f"{e.name} must be enabled with --spec-type {e.name}" for e in drafter_entries()
                                   if e.description.draft_model == "required"))
    return spec, draft_path


_TRUTHY, _FALSEY, _AUTO = ("on", "enabled", "true", "1"), ("off", "disabled", "false", "0"), ("auto", "-1")


def _reasoning(value: str) -> str:
    """llama.cpp's spellings of on, off and auto."""
    for canonical, spellings in (("on", _TRUTHY), ("off", _FALSEY), ("auto", _AUTO)):
        if value in spellings:
            return canonical
    raise argparse.ArgumentTypeError(f"expected on, off or auto, got {value!r}")


def _reasoning_variables(args: argparse.Namespace) -> dict[str, Any]:
    """The template variables --reasoning and --reasoning-effort stand for."""
    out: dict[str, Any] = {}
    reasoning = getattr(args, "reasoning", "auto")
    if reasoning != "auto":
        out["enable_thinking"] = reasoning == "on"
    effort = getattr(args, "reasoning_effort", "default")
    if effort != "default":
        out["reasoning_effort"] = effort
    return out


def target_tokenizer(args: argparse.Namespace, model_file: GGUFFile) -> Any:
    """The target's tokenizer, with --chat-template / --chat-template-file in place of the model's template
    and --chat-template-kwargs as its default variables."""
    from spekula.core.modelfile.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(model_file)
    template, template_file = getattr(args, "chat_template", None), getattr(args, "chat_template_file", None)
    kwargs_text = getattr(args, "chat_template_kwargs", None)
    if not template and not template_file and kwargs_text is None:
        # the model's own template, no variables to check: chat_template (and its named formats) not imported
        tokenizer.chat_template_kwargs = _reasoning_variables(args)
        return tokenizer
    from spekula.core.modelfile.chat_template import ChatTemplateError, template_override, template_variables

    try:
        override = template_override(template, template_file)
        try:
            kwargs = json.loads(kwargs_text) if kwargs_text is not None else None
        except json.JSONDecodeError as exc:
            raise ChatTemplateError(f"--chat-template-kwargs is not JSON: {exc}") from None
        # --chat-template-kwargs names a variable explicitly, so it wins over --reasoning's default
        tokenizer.chat_template_kwargs = {**_reasoning_variables(args),
                                          **template_variables(kwargs, "--chat-template-kwargs")}
    except ChatTemplateError as exc:
        raise ConfigError(str(exc)) from None
    if override is not None:
        tokenizer.chat_template = override
    return tokenizer


@contextmanager
def _default_model_advice(args: argparse.Namespace) -> Iterator[None]:
    """A ModelFileError of the embedded default model becomes the "damaged, fetch it again" advice; one of
    a model the user named stays as it is."""
    try:
        yield
    except ModelFileError as exc:
        if args.model or getattr(args, "hf_repo", None):
            raise
        from spekula.backends.gguf.default_model import damaged_default_model

        raise damaged_default_model(exc) from None


def _open_target_file(args: argparse.Namespace) -> tuple[str, GGUFFile]:
    """The target's path and its GGUF opened (headers and metadata, no weights)."""
    path = resolve_model_path(args)
    with _default_model_advice(args):
        return path, GGUFFile.shared(path)  # a corrupt or truncated file fails here, with the path in the message


def _open_target(args: argparse.Namespace) -> tuple[str, Any]:
    """The target's path and its tokenizer, its GGUF opened on the way."""
    path, model_file = _open_target_file(args)
    with _default_model_advice(args):
        return path, target_tokenizer(args, model_file)


def preflight(args: argparse.Namespace) -> None:
    """The checks `build_engine` starts with, without loading weights: the options, the drafters,
    and that the model (and draft model) files are readable GGUFs with a tokenizer. For a process
    that hands the loading to others (Ray replicas), so a bad file is one clear error up front."""
    spec, draft_path = _checked_spec(args)
    target_path, _ = _open_target(args)
    if draft_path:
        GGUFFile.shared(draft_path)
    for entry in drafter_entries():  # e.g. MTP heads must exist and fit: read from the headers alone
        if entry.name in spec.types and entry.description.check_files is not None:
            entry.description.check_files(target_path, draft_path)


def build_engine(args: argparse.Namespace, *, drafters: list[Any] | None = None) -> Engine:
    """Load the target backend and tokenizer and create the drafters; any problem is a SpekulaError."""
    spec, draft_path = _checked_spec(args)
    path, model_file = _open_target_file(args)
    pooling = serving_pooling(args, model_file)
    opts = BackendOptions(device=args.device, dtype=args.dtype, n_ctx=args.ctx_size, n_seq_max=args.parallel,
                          threads=args.threads, ort_provider=args.ort_provider)
    draft_opts = BackendOptions(device=args.spec_draft_device or args.device, dtype=args.spec_draft_dtype or args.dtype,
                                n_ctx=args.ctx_size, n_seq_max=args.parallel,
                                threads=args.threads if args.spec_draft_threads is None else args.spec_draft_threads,
                                ort_provider=args.ort_provider)
    backend_name = resolve_backend_name(args.backend, opts)
    encoder = is_encoder(model_file)
    if encoder:
        if spec.types or draft_path:
            raise ConfigError(f"{path}: an encoder model generates nothing, so there is nothing to speculate on: "
                              "--spec-type and draft models do not apply (it serves embeddings only)")
        if args.backend == "auto":
            backend_name = "torch"  # encoders run on torch only (backends/torch/encoder.py)
    # The backend loads in a thread while the tokenizer is built here, which starts once the load's setup is
    # done (in_thread.BackendLoad says why, and why a large vocabulary's output head waits for it); a failure
    # here is reported before the backend's own, as when they ran one after the other. Its module is imported
    # first, here: the thread then holds the GIL only for its setup.
    make_backend = backend_class(backend_name, opts)
    load = BackendLoad(lambda o: make_backend(path, o), opts, model_file.metadata, "spekula-backend-load")
    try:
        with _default_model_advice(args):
            tokenizer = load.beside(lambda: target_tokenizer(args, model_file))
        check_bias_tokens(tuple(getattr(args, "logit_bias", ())), tokenizer.n_vocab)  # --logit-bias, at start
    except BaseException:
        load.discard(lambda b: b.close())
        raise
    backend = load.result()
    config = EngineConfig(n_slots=args.parallel, n_ctx=args.ctx_size, n_batch=args.batch_size, spec=spec,
                          slot_prompt_similarity=args.slot_prompt_similarity, pooling=pooling,
                          context_shift=bool(getattr(args, "context_shift", False)), embeddings_only=encoder)
    try:
        return Engine(backend, tokenizer, config, drafters=drafters, backend_name=backend_name,
                      draft_model_path=draft_path, draft_backend_options=draft_opts)
    except BaseException:
        backend.close()
        raise


def completion_request(args: argparse.Namespace, prompt: list[int], **kw: Any) -> CompletionRequest:
    return CompletionRequest(prompt=prompt, n_predict=args.n_predict, sampling=sampling_from_args(args),
                             n_keep=int(getattr(args, "keep", 0)), **kw)
