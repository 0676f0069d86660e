"""`spekula-server`: llama-server's command line over `spekula serve --port`.

It reads a llama-server command line (llama.cpp build 11434, common/arg.cpp: the same spellings,
short forms, `_` read as `-` in long names, and the LLAMA_ARG_* / LLAMA_API_KEY environment
variables, which the command line overrides) and runs spekula's own `serve` command in-process with
the equivalent arguments. Every llama-server option falls in one of three groups, each an explicit
table below:

- translated: spekula implements it, maybe under another name or with other units (`--ctx-size` is
  llama-server's total KV size shared by all slots; spekula's `-c` is per slot);
- accepted: it changes only speed, memory or logging, or selects what spekula always does
  (`-ngl`, `-fa`, `--ubatch-size`, `--cont-batching`, `--jinja`, ...); it is read and dropped;
- rejected: a llama-server feature spekula does not implement (`--lora`,
  `--grammar`, ...): a one-line error naming it, exit status 1. The adaptive-p
  sampler's options are accepted when their value is llama.cpp's "disabled" default (`--adaptive-target -1`).

Anything else is not a llama-server option at all: an error naming it, exit status 1 too.
The module is long because it holds that one table, all 268 options of the build, in one place
(a test checks it against llama.cpp's own option list).

Defaults follow llama-server where spekula's differ: the HTTP API on 127.0.0.1:8080 (spekula serve
needs `--port`), 4 slots sharing a unified context when `-np` is not given (llama-server's `-np -1`),
CORS origins `*`, and speculative drafts to the `--spec-draft-n-*` caps as llama-server does
(`--spec-adaptive off`). Extra `spekula serve` arguments, for what llama-server has no option for
(`--backend`, `--dtype`, ...), can be appended from $SPEKULA_SERVE_ARGS (shell syntax).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from spekula.core.drafting.registry import drafter_entries

PROG = "spekula-server"
LLAMA_BUILD = 11434
DEFAULT_PORT = 8080
AUTO_SLOTS = 4  # llama-server's -np -1 (the default): 4 slots over one unified KV cache
CTX_PAD = 256  # llama.cpp rounds the total and the per-slot context up to a multiple of this
EXTRA_ARGS_ENV = "SPEKULA_SERVE_ARGS"
_TRUTHY = {"on", "enabled", "true", "1"}  # common_arg_utils::is_truthy / is_falsey
_FALSEY = {"off", "disabled", "false", "0"}


@dataclass
class Translation:
    """What a llama-server command line asks for, in spekula terms."""

    args: list[str] = field(default_factory=list)  # `spekula serve` arguments, in order
    env: dict[str, str] = field(default_factory=dict)  # environment variables to set in-process
    errors: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)  # accepted options that change nothing in spekula
    notes: list[str] = field(default_factory=list)  # non-fatal remarks printed to stderr
    ctx: int | None = None  # llama-server -c: total KV size (0: the model's)
    parallel: int | None = None  # -np (-1: auto)
    kv_unified: bool | None = None
    kv_per_slot: int | None = None  # --kv-unified-per-slot
    slots: bool | None = None  # --slots / --no-slots
    cors_given: bool = False
    port_given: bool = False
    help: bool = False
    version: bool = False

    def serve_argv(self) -> list[str]:
        """The complete `spekula serve` argument list (without the `serve` itself)."""
        out = list(self.args)
        if not self.port_given:
            out += ["--port", str(DEFAULT_PORT)]
        if not self.cors_given:
            out += ["--cors-origins", "*"]
        n_slots, per_slot = slot_layout(self.ctx, self.parallel, self.kv_unified, self.kv_per_slot)
        out += ["-np", str(n_slots)]
        if per_slot is not None:
            out += ["-c", str(per_slot)]
        if self.slots is not None and "--slots" in serve_options():
            out.append("--slots" if self.slots else "--no-slots")
        if "--spec-adaptive" in serve_options():
            out += ["--spec-adaptive", "off"]
        return out


def _pad(n: int) -> int:
    return (n + CTX_PAD - 1) // CTX_PAD * CTX_PAD


def slot_layout(ctx: int | None, parallel: int | None, kv_unified: bool | None,
                kv_per_slot: int | None) -> tuple[int, int | None]:
    """(slots, per-slot context or None for spekula's default), as llama-server sizes them.

    llama-server's `-c` is the KV cache of all slots together: each slot gets `ctx / np`, both
    rounded up to a multiple of 256 (llama_context), or the whole `ctx` with `--kv-unified`; `-np -1`
    (the default) is 4 slots with a unified cache; `--kv-unified-per-slot N` caps each slot at N and,
    without `-c`, sizes the cache to `np * N`. `-c 0` (the model's training context) and no `-c` leave
    spekula's default per-slot context.
    """
    if parallel is None or parallel < 0:
        n_slots, unified = AUTO_SLOTS, True
    else:
        n_slots, unified = parallel, bool(kv_unified)
    if not ctx:
        return n_slots, kv_per_slot if kv_per_slot and kv_per_slot > 0 else None
    total = _pad(ctx)
    per_slot = total if unified else _pad(total // n_slots)
    if kv_per_slot and kv_per_slot > 0:
        per_slot = min(per_slot, kv_per_slot)
    return n_slots, per_slot


_SERVE_OPTIONS: set[str] = set()


def serve_options() -> set[str]:
    """Every option string `spekula serve` accepts (so options added to it later are used when present)."""
    if not _SERVE_OPTIONS:
        from spekula.frontends.cli import serve_options as serve_cli

        parser = argparse.ArgumentParser(add_help=False)
        serve_cli.add_arguments(parser)
        _SERVE_OPTIONS.update(s for action in parser._actions for s in action.option_strings)
    return _SERVE_OPTIONS


# ------------------------------------------------------------------------------------------------
# The option table

Handler = Callable[[Translation, str, list[str]], None]


@dataclass(frozen=True)
class Option:
    names: tuple[str, ...]
    nargs: int  # values it takes: 0 (a flag) or 1
    kind: str  # "translated" | "accepted" | "rejected"
    note: str  # translated: the spekula option; accepted: why it is harmless; rejected: the feature
    handle: Handler
    env: str | None = None  # LLAMA_ARG_* variable it is also read from
    env_sign: bool | None = None  # flags with a --no- form: True for the positive spelling, False for the negative


def _emit(target: str) -> Handler:
    def handle(tr: Translation, name: str, values: list[str]) -> None:
        if target.split()[0] not in serve_options():
            tr.errors.append(f"{name} needs `spekula serve {target.split()[0]}`, which this spekula does not have")
            return
        tr.args += [*target.split(), *values]
    return handle


def _ignore(tr: Translation, name: str, values: list[str]) -> None:
    tr.ignored.append(" ".join([name, *values]))


def _refuse(feature: str, noop: Iterable[str] = ()) -> Handler:
    allowed = tuple(noop)

    def handle(tr: Translation, name: str, values: list[str]) -> None:
        if values and _is_noop(values[0], allowed):
            tr.ignored.append(" ".join([name, *values]))
            return
        what = f"{name} {values[0]}" if values and allowed else name
        tr.errors.append(f"{what} ({feature}) is not implemented by spekula")
    return handle


def _is_noop(value: str, allowed: Sequence[str]) -> bool:
    for ok in allowed:
        if value.strip().lower() == ok.lower():
            return True
        try:
            if float(value) == float(ok):
                return True
        except ValueError:
            pass
    return False


TABLE: list[Option] = []


def _opt(names: str, nargs: int, kind: str, note: str, handle: Handler, env: str | None = None,
         env_sign: bool | None = None) -> None:
    TABLE.append(Option(tuple(names.split()), nargs, kind, note, handle, env, env_sign))


def translated(names: str, target: str, nargs: int = 1, env: str | None = None, env_sign: bool | None = None) -> None:
    _opt(names, nargs, "translated", target, _emit(target), env, env_sign)


def special(names: str, note: str, handle: Handler, nargs: int = 1, env: str | None = None,
            env_sign: bool | None = None) -> None:
    _opt(names, nargs, "translated", note, handle, env, env_sign)


def accepted(names: str, why: str, nargs: int = 0, env: str | None = None, env_sign: bool | None = None) -> None:
    _opt(names, nargs, "accepted", why, _ignore, env, env_sign)


def rejected(names: str, feature: str, nargs: int = 0, env: str | None = None, noop: Iterable[str] = (),
             env_sign: bool | None = None) -> None:
    _opt(names, nargs, "rejected", feature, _refuse(feature, noop), env, env_sign)


def _set(attr: str, convert: Callable[[str], object]) -> Handler:
    def handle(tr: Translation, name: str, values: list[str]) -> None:
        try:
            setattr(tr, attr, convert(values[0]) if values else True)
        except ValueError:
            tr.errors.append(f"{name}: expected a number, got {values[0]!r}")
    return handle


def _flag(attr: str, value: object) -> Handler:
    def handle(tr: Translation, name: str, values: list[str]) -> None:
        setattr(tr, attr, value)
    return handle


def _parallel(value: str) -> int:
    n = int(value)
    if n == 0:
        raise ValueError(value)
    return n


def _port(tr: Translation, name: str, values: list[str]) -> None:
    tr.port_given = True
    tr.args += ["--port", values[0]]


def _host(tr: Translation, name: str, values: list[str]) -> None:
    hosts = [h.strip() for h in values[0].split(",") if h.strip()]
    if not hosts:
        tr.errors.append("--host requires at least one address")
    elif len(hosts) > 1:
        tr.errors.append(f"--host {values[0]} (listening on several addresses) is not implemented by spekula")
    elif hosts[0].endswith(".sock"):
        tr.errors.append(f"--host {hosts[0]} (HTTP on a UNIX socket) is not implemented by spekula")
    else:
        tr.args += ["--host", hosts[0]]


def _alias(tr: Translation, name: str, values: list[str]) -> None:
    aliases = [a.strip() for a in values[0].split(",") if a.strip()]
    if aliases:  # spekula reports one model name: the first alias (requests' "model" is not checked)
        tr.args += ["--alias", aliases[0]]


def _api_key_file(tr: Translation, name: str, values: list[str]) -> None:
    """llama-server's reading: one key a line, empty lines and lines starting with '#' skipped."""
    try:
        with open(values[0], encoding="utf-8") as f:
            keys = [line.rstrip("\r\n") for line in f]
    except OSError as exc:
        tr.errors.append(f"{name} {values[0]}: cannot read it ({exc.strerror or exc})")
        return
    for key in keys:
        if not key or key.startswith("#"):
            continue
        if "," in key:  # spekula's --api-key splits on commas; llama-server's key file does not
            tr.errors.append(f"{name} {values[0]}: a key with a comma is not supported by spekula")
            return
        tr.args += ["--api-key", key]


def _cors(tr: Translation, name: str, values: list[str]) -> None:
    tr.cors_given = True
    tr.args += ["--cors-origins", values[0]]


def _device(target: str) -> Handler:
    """llama.cpp device lists (`none`, `CUDA0`, `CPU`) to spekula's `cpu` / `cuda:N`."""
    def handle(tr: Translation, name: str, values: list[str]) -> None:
        devices = [d.strip() for d in values[0].split(",") if d.strip()]
        if len(devices) != 1:
            tr.errors.append(f"{name} {values[0]} (splitting a model over several devices) is not implemented by spekula")
            return
        dev = devices[0].lower()
        if dev in ("none", "cpu"):
            tr.args += [target, "cpu"]
        elif dev.startswith("cuda") and dev[4:].isdigit():
            tr.args += [target, f"cuda:{dev[4:]}"]
        else:
            tr.errors.append(f"{name} {values[0]} (devices other than CPU and CUDAn) is not implemented by spekula")
    return handle


def _verbosity(tr: Translation, name: str, values: list[str]) -> None:
    try:
        level = int(values[0])
    except ValueError:
        tr.errors.append(f"{name}: expected a number, got {values[0]!r}")
        return
    if level >= 4:  # llama.cpp's LOG_LEVEL_DEBUG and above: spekula's debug logging
        tr.args.append("-v")
    else:
        tr.ignored.append(f"{name} {values[0]}")


def _env(var: str, value: str | None = None) -> Handler:
    def handle(tr: Translation, name: str, values: list[str]) -> None:
        tr.env[var] = values[0] if value is None else value
    return handle


def _kv_type(tr: Translation, name: str, values: list[str]) -> None:
    # Unquantized KV types only change precision below spekula's own (f32 or the backend dtype);
    # llama.cpp's quantized KV caches are a different, lossy cache that spekula does not have.
    if values[0].lower() in ("f16", "f32", "bf16"):
        tr.ignored.append(f"{name} {values[0]}")
    else:
        tr.errors.append(f"{name} {values[0]} (quantized KV cache) is not implemented by spekula")


def _help(tr: Translation, name: str, values: list[str]) -> None:
    tr.help = True


def _version(tr: Translation, name: str, values: list[str]) -> None:
    tr.version = True


def _removed(tr: Translation, name: str, values: list[str]) -> None:
    tr.errors.append(f"{name} has been removed from llama-server too; use the --spec-draft-* / --spec-ngram-* options")


# -- translated: spekula implements these --------------------------------------------------------
special("-h --help --usage", "this help", _help, nargs=0)
special("--version", "print the version", _version, nargs=0)
translated("-m --model", "-m", env="LLAMA_ARG_MODEL")
translated("-hf -hfr --hf-repo", "-hf", env="LLAMA_ARG_HF_REPO")
translated("-hff --hf-file", "-hff", env="LLAMA_ARG_HF_FILE")
special("-hft --hf-token", "sets HF_TOKEN for the download", _env("HF_TOKEN"))
special("--offline", "sets HF_HUB_OFFLINE=1: the hub cache only", _env("HF_HUB_OFFLINE", "1"), nargs=0,
        env="LLAMA_ARG_OFFLINE")
special("-c --ctx-size", "total context, divided among the slots: spekula -c per slot", _set("ctx", int),
        env="LLAMA_ARG_CTX_SIZE")
special("-np --parallel", "-np (-1: 4 slots, unified context)", _set("parallel", _parallel), env="LLAMA_ARG_N_PARALLEL")
special("-kvu --kv-unified", "each slot may use the whole -c", _flag("kv_unified", True), nargs=0,
        env="LLAMA_ARG_KV_UNIFIED", env_sign=True)
special("-no-kvu --no-kv-unified", "slots split -c", _flag("kv_unified", False), nargs=0,
        env="LLAMA_ARG_KV_UNIFIED", env_sign=False)
special("--kv-unified-per-slot", "caps each slot's context", _set("kv_per_slot", int),
        env="LLAMA_ARG_KV_UNIFIED_PER_SLOT")
translated("-b --batch-size", "-b", env="LLAMA_ARG_BATCH")
translated("-t --threads", "-t", env="LLAMA_ARG_THREADS")
special("-dev --device", "--device cpu|cuda:N (from none/CPU/CUDAn)", _device("--device"), env="LLAMA_ARG_DEVICE")
translated("-n --predict --n-predict", "-n", env="LLAMA_ARG_N_PREDICT")
translated("-s --seed", "-s")
translated("--temp --temperature", "--temp", env="LLAMA_ARG_TEMPERATURE")
translated("--top-k", "--top-k", env="LLAMA_ARG_TOP_K")
translated("--top-p", "--top-p", env="LLAMA_ARG_TOP_P")
translated("--min-p", "--min-p", env="LLAMA_ARG_MIN_P")
translated("--repeat-last-n", "--repeat-last-n")
translated("--repeat-penalty", "--repeat-penalty", env="LLAMA_ARG_REPEAT_PENALTY")
translated("--presence-penalty", "--presence-penalty", env="LLAMA_ARG_PRESENCE_PENALTY")
translated("--frequency-penalty", "--frequency-penalty", env="LLAMA_ARG_FREQUENCY_PENALTY")
translated("-l --logit-bias", "--logit-bias")
special("--host", "--host (one address)", _host, env="LLAMA_ARG_HOST")
special("--port", "--port (default 8080)", _port, env="LLAMA_ARG_PORT")
translated("--api-key", "--api-key", env="LLAMA_API_KEY")
special("--api-key-file", "--api-key for each line ('#' lines are comments)", _api_key_file,
        env="LLAMA_ARG_API_KEY_FILE")
translated("--metrics", "--metrics", nargs=0, env="LLAMA_ARG_ENDPOINT_METRICS")
translated("--embedding --embeddings", "--embedding", nargs=0, env="LLAMA_ARG_EMBEDDINGS")
translated("--rerank --reranking", "--reranking", nargs=0, env="LLAMA_ARG_RERANKING")
translated("--pooling", "--pooling", env="LLAMA_ARG_POOLING")
translated("--embd-normalize", "--embd-normalize")
special("--slots", "--slots", _flag("slots", True), nargs=0, env="LLAMA_ARG_ENDPOINT_SLOTS", env_sign=True)
special("--no-slots", "--no-slots", _flag("slots", False), nargs=0, env="LLAMA_ARG_ENDPOINT_SLOTS", env_sign=False)
special("-a --alias", "--alias (the first of a comma-separated list)", _alias, env="LLAMA_ARG_ALIAS")
special("--cors-origins", "--cors-origins (default *)", _cors, env="LLAMA_ARG_CORS_ORIGINS")
translated("-sps --slot-prompt-similarity", "-sps")
translated("--context-shift", "--context-shift", nargs=0, env="LLAMA_ARG_CONTEXT_SHIFT", env_sign=True)
translated("--no-context-shift", "--no-context-shift", nargs=0, env="LLAMA_ARG_CONTEXT_SHIFT", env_sign=False)
translated("--keep", "--keep")
# llama-server's read/write timeout; spekula's --timeout is the idle keep-alive time (5 s, as httplib's).
translated("-to --timeout", "--write-timeout", env="LLAMA_ARG_TIMEOUT")
translated("-v --verbose --log-verbose", "-v", nargs=0)
special("-lv --verbosity --log-verbosity", "-v when >= 4 (debug)", _verbosity, env="LLAMA_ARG_LOG_VERBOSITY")
translated("--log-jsonl", "--log-format json", nargs=0, env="LLAMA_ARG_LOG_JSONL", env_sign=True)
translated("--spec-type", "--spec-type", env="LLAMA_ARG_SPEC_TYPE")
translated("--spec-default", "--spec-default", nargs=0)
translated("--spec-draft-model -md --model-draft", "-md", env="LLAMA_ARG_SPEC_DRAFT_MODEL")
translated("--spec-draft-hf -hfd -hfrd --hf-repo-draft", "-hfd", env="LLAMA_ARG_SPEC_DRAFT_HF_REPO")
special("--spec-draft-device -devd --device-draft", "--spec-draft-device cpu|cuda:N", _device("--spec-draft-device"))
translated("--spec-draft-threads -td --threads-draft", "--spec-draft-threads")
translated("--spec-draft-n-max", "--spec-draft-n-max", env="LLAMA_ARG_SPEC_DRAFT_N_MAX")
translated("--spec-draft-n-min", "--spec-draft-n-min", env="LLAMA_ARG_SPEC_DRAFT_N_MIN")
translated("--spec-draft-p-min --draft-p-min", "--spec-draft-p-min", env="LLAMA_ARG_SPEC_DRAFT_P_MIN")
translated("--spec-draft-sampling", "--spec-draft-sampling", env="LLAMA_ARG_SPEC_DRAFT_SAMPLING")
translated("--spec-synth-len", "--spec-synth-len", env="LLAMA_ARG_SPEC_SYNTH_LEN")
translated("--spec-synth-rates", "--spec-synth-rates", env="LLAMA_ARG_SPEC_SYNTH_RATES")
# Per-drafter options: those the installed drafters declare under llama-server's own spellings.
for _entry in drafter_entries():
    for _option in _entry.description.options:
        if _option.llama_cpp:
            translated(" ".join(_option.spellings), _option.flag, env=_option.env)
special("--draft --draft-n --draft-max", "removed in llama-server too", _removed, env="LLAMA_ARG_DRAFT_MAX")
special("--draft-min --draft-n-min", "removed in llama-server too", _removed, env="LLAMA_ARG_DRAFT_MIN")
special("--spec-ngram-size-n --spec-ngram-size-m --spec-ngram-min-hits", "removed in llama-server too", _removed)

# -- accepted: speed, memory, logging, or what spekula always does ---------------------------------
_CPU = "CPU affinity, priority and polling: thread scheduling only"
for _names in ("-tb --threads-batch", "-C --cpu-mask", "-Cr --cpu-range", "--cpu-strict", "--prio", "--poll",
               "-Cb --cpu-mask-batch", "-Crb --cpu-range-batch", "--cpu-strict-batch", "--prio-batch",
               "--poll-batch", "--spec-draft-threads-batch -tbd --threads-batch-draft",
               "--spec-draft-cpu-mask -Cd --cpu-mask-draft", "--spec-draft-cpu-range -Crd --cpu-range-draft",
               "--spec-draft-cpu-strict --cpu-strict-draft", "--spec-draft-prio --prio-draft",
               "--spec-draft-poll --poll-draft", "--spec-draft-cpu-mask-batch -Cbd --cpu-mask-batch-draft",
               "--spec-draft-cpu-range-batch -Crbd --cpu-range-batch-draft",
               "--spec-draft-cpu-strict-batch --cpu-strict-batch-draft", "--spec-draft-prio-batch --prio-batch-draft",
               "--spec-draft-poll-batch --poll-batch-draft"):
    accepted(_names, _CPU, nargs=1)
_PLACE = "where weights and KV live (GPU offload, tensor split, mmap): speed and memory only"
for _names, _env_name in (("-ngl --gpu-layers --n-gpu-layers", "LLAMA_ARG_N_GPU_LAYERS"),
                          ("-sm --split-mode", "LLAMA_ARG_SPLIT_MODE"), ("-ts --tensor-split", "LLAMA_ARG_TENSOR_SPLIT"),
                          ("-mg --main-gpu", "LLAMA_ARG_MAIN_GPU"), ("-ot --override-tensor", "LLAMA_ARG_OVERRIDE_TENSOR"),
                          ("-ncmoe --n-cpu-moe", "LLAMA_ARG_N_CPU_MOE"), ("-ncffn --n-cpu-ffn", "LLAMA_ARG_N_CPU_FFN"),
                          ("-fit --fit", "LLAMA_ARG_FIT"), ("-fitt --fit-target", "LLAMA_ARG_FIT_TARGET"),
                          ("-fitc --fit-ctx", "LLAMA_ARG_FIT_CTX"), ("-lm --load-mode", "LLAMA_ARG_LOAD_MODE"),
                          ("-lzm --lazy-mode", "LLAMA_ARG_LAZY_MODE"), ("--numa", "LLAMA_ARG_NUMA"),
                          ("--spec-draft-ngl -ngld --gpu-layers-draft --n-gpu-layers-draft", "LLAMA_ARG_N_GPU_LAYERS_DRAFT"),
                          ("--spec-draft-override-tensor -otd --override-tensor-draft", None),
                          ("--spec-draft-n-cpu-moe --spec-draft-ncmoe -ncmoed --n-cpu-moe-draft",
                           "LLAMA_ARG_SPEC_DRAFT_N_CPU_MOE")):
    accepted(_names, _PLACE, nargs=1, env=_env_name)
accepted("-cmoe --cpu-moe", _PLACE, env="LLAMA_ARG_CPU_MOE")
accepted("--spec-draft-cpu-moe -cmoed --cpu-moe-draft", _PLACE, env="LLAMA_ARG_SPEC_DRAFT_CPU_MOE")
accepted("--no-host", _PLACE, env="LLAMA_ARG_NO_HOST")
accepted("--check-tensors", "validates tensor data at load: nothing at run time")
accepted("--op-offload", _PLACE, env_sign=True)
accepted("--no-op-offload", _PLACE, env_sign=False)
accepted("-kvo --kv-offload", _PLACE, env="LLAMA_ARG_KV_OFFLOAD", env_sign=True)
accepted("-nkvo --no-kv-offload", _PLACE, env="LLAMA_ARG_KV_OFFLOAD", env_sign=False)
accepted("--repack", _PLACE, env="LLAMA_ARG_REPACK", env_sign=True)
accepted("-nr --no-repack", _PLACE, env="LLAMA_ARG_REPACK", env_sign=False)
accepted("-fa --flash-attn", "attention kernel choice: speed only", nargs=1, env="LLAMA_ARG_FLASH_ATTN")
accepted("-ub --ubatch-size", "physical batch inside -b: speed and memory only", nargs=1, env="LLAMA_ARG_UBATCH")
accepted("-cb --cont-batching", "spekula always batches the slots continuously", env="LLAMA_ARG_CONT_BATCHING",
         env_sign=True)
accepted("-nocb --no-cont-batching", "turning continuous batching off only slows concurrent requests",
         env="LLAMA_ARG_CONT_BATCHING", env_sign=False)
accepted("--swa-full", "full-size KV for sliding-window models: memory only, outputs unchanged", env="LLAMA_ARG_SWA_FULL")
accepted("-ctxcp --ctx-checkpoints --swa-checkpoints", "llama.cpp's prompt-cache checkpoints: cache speed only",
         nargs=1, env="LLAMA_ARG_CTX_CHECKPOINTS")
accepted("-cms --checkpoint-min-step", "llama.cpp's prompt-cache checkpoints: cache speed only", nargs=1,
         env="LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT")
accepted("-cram --cache-ram", "host-RAM prompt cache size: only how much prefix reuse survives (speed)", nargs=1,
         env="LLAMA_ARG_CACHE_RAM")
accepted("--cache-idle-slots", "host-RAM prompt cache policy: speed only", env="LLAMA_ARG_CACHE_IDLE_SLOTS",
         env_sign=True)
accepted("--no-cache-idle-slots", "host-RAM prompt cache policy: speed only", env="LLAMA_ARG_CACHE_IDLE_SLOTS",
         env_sign=False)
accepted("--cache-reuse", "KV chunk reuse by shifting: speed only", nargs=1, env="LLAMA_ARG_CACHE_REUSE")
accepted("--cache-prompt", "spekula always reuses a slot's cached prompt prefix (per request: cache_prompt)",
         env="LLAMA_ARG_CACHE_PROMPT", env_sign=True)
for _names, _env_name in (("-ctk --cache-type-k", "LLAMA_ARG_CACHE_TYPE_K"), ("-ctv --cache-type-v", "LLAMA_ARG_CACHE_TYPE_V"),
                          ("--spec-draft-type-k -ctkd --cache-type-k-draft", "LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_K"),
                          ("--spec-draft-type-v -ctvd --cache-type-v-draft", "LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V")):
    _opt(_names, 1, "accepted", "f32, f16 or bf16 only: KV precision", _kv_type, _env_name)
accepted("-dt --defrag-thold", "deprecated no-op in llama.cpp", nargs=1, env="LLAMA_ARG_DEFRAG_THOLD")
accepted("--warmup", "an empty warm-up decode at start: speed only", env_sign=True)
accepted("--no-warmup", "an empty warm-up decode at start: speed only", env_sign=False)
accepted("-bs --backend-sampling", "sampling on the GPU backend instead of the CPU: speed only",
         env="LLAMA_ARG_BACKEND_SAMPLING")
accepted("--spec-draft-backend-sampling", "draft sampling on the backend: speed only",
         env="LLAMA_ARG_SPEC_DRAFT_BACKEND_SAMPLING", env_sign=True)
accepted("--no-spec-draft-backend-sampling", "draft sampling on the backend: speed only",
         env="LLAMA_ARG_SPEC_DRAFT_BACKEND_SAMPLING", env_sign=False)
accepted("--perf", "llama.cpp's internal timing logs", env="LLAMA_ARG_PERF", env_sign=True)
accepted("--no-perf", "llama.cpp's internal timing logs", env="LLAMA_ARG_PERF", env_sign=False)
accepted("-e --escape", "escape sequences in CLI prompts: the server has none", env_sign=True)
accepted("--no-escape", "escape sequences in CLI prompts: the server has none", env_sign=False)
accepted("--jinja", "spekula renders chat through the model's Jinja template", env="LLAMA_ARG_JINJA", env_sign=True)
accepted("--no-jinja", "llama.cpp's built-in copies of the common templates render as the model's Jinja one",
         env="LLAMA_ARG_JINJA", env_sign=False)
accepted("--prefill-assistant", "llama-server's default, and spekula's: a trailing assistant message is continued",
         env="LLAMA_ARG_PREFILL_ASSISTANT", env_sign=True)
accepted("--skip-chat-parsing", "spekula returns the reply text as generated (no tool-call/reasoning parsing)",
         env="LLAMA_ARG_SKIP_CHAT_PARSING", env_sign=True)
accepted("--cors-credentials", "spekula allows credentials for every origin it reflects",
         env="LLAMA_ARG_CORS_CREDENTIALS", env_sign=True)
accepted("--no-mmproj --no-mmproj-auto", "spekula loads no multimodal projector anyway", env="LLAMA_ARG_MMPROJ_AUTO",
         env_sign=False)
accepted("--ui --webui", "spekula serves no web UI; the API is the same", env="LLAMA_ARG_UI", env_sign=True)
accepted("--no-ui --no-webui", "spekula serves no web UI", env="LLAMA_ARG_UI", env_sign=False)
accepted("--ui-config --webui-config", "web UI settings: no web UI", nargs=1, env="LLAMA_ARG_UI_CONFIG")
accepted("--ui-config-file --webui-config-file", "web UI settings: no web UI", nargs=1, env="LLAMA_ARG_UI_CONFIG_FILE")
accepted("--no-ui-mcp-proxy --no-webui-mcp-proxy", "the MCP proxy is off (the default)", env="LLAMA_ARG_UI_MCP_PROXY",
         env_sign=False)
accepted("-no-ag --no-agent", "the agent tools are off (the default)", env="LLAMA_ARG_AGENT", env_sign=False)
accepted("--props", "GET /props is always served", env="LLAMA_ARG_ENDPOINT_PROPS")
accepted("--sse-ping-interval", "keep-alive comments in SSE streams, which clients skip", nargs=1,
         env="LLAMA_ARG_SSE_PING_INTERVAL")
accepted("--threads-http", "HTTP worker threads: spekula's server is asynchronous", nargs=1,
         env="LLAMA_ARG_THREADS_HTTP")
accepted("--models-autoload", "router mode only (--models-dir is rejected)", env="LLAMA_ARG_MODELS_AUTOLOAD",
         env_sign=True)
accepted("--no-models-autoload", "router mode only (--models-dir is rejected)", env="LLAMA_ARG_MODELS_AUTOLOAD",
         env_sign=False)
accepted("--log-disable", "logging only")
accepted("--no-log-jsonl", "logging only (text logs, spekula's default)", env="LLAMA_ARG_LOG_JSONL", env_sign=False)
accepted("--log-file", "logging only: spekula logs to stderr", nargs=1, env="LLAMA_ARG_LOG_FILE")
accepted("--log-prompts-dir", "logging only", nargs=1)
accepted("--log-colors", "logging only", nargs=1, env="LLAMA_ARG_LOG_COLORS")
accepted("--log-prefix", "logging only", env="LLAMA_ARG_LOG_PREFIX", env_sign=True)
accepted("--no-log-prefix", "logging only", env="LLAMA_ARG_LOG_PREFIX", env_sign=False)
accepted("--log-timestamps", "logging only", env="LLAMA_ARG_LOG_TIMESTAMPS", env_sign=True)
accepted("--no-log-timestamps", "logging only", env="LLAMA_ARG_LOG_TIMESTAMPS", env_sign=False)

# -- rejected: llama-server features spekula does not implement -----------------------------------
rejected("--lora --lora-scaled", "LoRA adapters", nargs=1)
rejected("--lora-init-without-apply", "LoRA adapters")
rejected("--control-vector --control-vector-scaled", "control vectors", nargs=1)
rejected("--control-vector-layer-range", "control vectors", nargs=2)
rejected("--no-cache-prompt", "turning prompt caching off server-wide", env="LLAMA_ARG_CACHE_PROMPT", env_sign=False)
rejected("-gan --grp-attn-n -gaw --grp-attn-w", "group attention / self-extend", nargs=1)
for _names, _env_name in (("--rope-scaling", "LLAMA_ARG_ROPE_SCALING_TYPE"), ("--rope-scale", "LLAMA_ARG_ROPE_SCALE"),
                          ("--rope-freq-base", "LLAMA_ARG_ROPE_FREQ_BASE"),
                          ("--rope-freq-scale", "LLAMA_ARG_ROPE_FREQ_SCALE"),
                          ("--yarn-orig-ctx", "LLAMA_ARG_YARN_ORIG_CTX"), ("--yarn-ext-factor", "LLAMA_ARG_YARN_EXT_FACTOR"),
                          ("--yarn-attn-factor", "LLAMA_ARG_YARN_ATTN_FACTOR"),
                          ("--yarn-beta-slow", "LLAMA_ARG_YARN_BETA_SLOW"), ("--yarn-beta-fast", "LLAMA_ARG_YARN_BETA_FAST")):
    rejected(_names, "RoPE/YaRN overrides", nargs=1, env=_env_name)
rejected("--override-kv", "model metadata overrides", nargs=1)
for _names, _env_name in (("-mm --mmproj", "LLAMA_ARG_MMPROJ"), ("-mmu --mmproj-url", "LLAMA_ARG_MMPROJ_URL"),
                          ("-mmdev --mmproj-device", "MTMD_BACKEND_DEVICE"),
                          ("--image-min-tokens", "LLAMA_ARG_IMAGE_MIN_TOKENS"),
                          ("--image-max-tokens", "LLAMA_ARG_IMAGE_MAX_TOKENS"),
                          ("--mtmd-batch-max-tokens", "LLAMA_ARG_MTMD_BATCH_MAX_TOKENS"),
                          ("--video-fps", "LLAMA_ARG_VIDEO_FPS"),
                          ("--video-timestamp-interval", "LLAMA_ARG_VIDEO_TIMESTAMP_INTERVAL"),
                          ("--video-ffmpeg-dir", "LLAMA_ARG_VIDEO_FFMPEG_DIR"), ("--media-path", None)):
    rejected(_names, "multimodal input", nargs=1, env=_env_name)
rejected("--mmproj-auto", "multimodal input", env="LLAMA_ARG_MMPROJ_AUTO", env_sign=True)
rejected("--mmproj-offload", "multimodal input", env="LLAMA_ARG_MMPROJ_OFFLOAD", env_sign=True)
rejected("--no-mmproj-offload", "multimodal input", env="LLAMA_ARG_MMPROJ_OFFLOAD", env_sign=False)
translated("--chat-template", "--chat-template", env="LLAMA_ARG_CHAT_TEMPLATE")
translated("--chat-template-file", "--chat-template-file", env="LLAMA_ARG_CHAT_TEMPLATE_FILE")
translated("--chat-template-kwargs", "--chat-template-kwargs", env="LLAMA_ARG_CHAT_TEMPLATE_KWARGS")
rejected("--no-skip-chat-parsing", "tool-call and reasoning parsing of replies", env="LLAMA_ARG_SKIP_CHAT_PARSING",
         env_sign=False)
translated("--no-prefill-assistant", "--no-prefill-assistant", nargs=0, env="LLAMA_ARG_PREFILL_ASSISTANT", env_sign=False)
translated("--reasoning-format", "--reasoning-format", env="LLAMA_ARG_THINK")
translated("-rea --reasoning", "--reasoning", env="LLAMA_ARG_REASONING")
translated("--reasoning-effort", "--reasoning-effort", env="LLAMA_ARG_REASONING_EFFORT")
translated("--reasoning-budget", "--reasoning-budget", env="LLAMA_ARG_THINK_BUDGET")
translated("--reasoning-budget-message", "--reasoning-budget-message", env="LLAMA_ARG_THINK_BUDGET_MESSAGE")
rejected("--reasoning-preserve", "reasoning history control", env="LLAMA_ARG_REASONING_PRESERVE", env_sign=True)
rejected("--no-reasoning-preserve", "reasoning history control", env="LLAMA_ARG_REASONING_PRESERVE", env_sign=False)
rejected("--grammar --grammar-file", "server-wide grammar", nargs=1)
rejected("-j --json-schema -jf --json-schema-file", "server-wide JSON schema", nargs=1)
rejected("--ignore-eos", "server-wide ignore_eos")
rejected("--spec-draft-p-split --draft-p-split", "the draft-tree split probability: spekula drafts one sequence",
         nargs=1, env="LLAMA_ARG_SPEC_DRAFT_P_SPLIT")
translated("--samplers", "--samplers")
translated("--sampler-seq --sampling-seq", "--sampler-seq")
translated("--top-nsigma --top-n-sigma", "--top-n-sigma")
translated("--xtc-probability", "--xtc-probability")
translated("--xtc-threshold", "--xtc-threshold")
translated("--typical --typical-p", "--typical-p")
translated("--dry-multiplier", "--dry-multiplier")
translated("--dry-base", "--dry-base")
translated("--dry-allowed-length", "--dry-allowed-length")
translated("--dry-penalty-last-n", "--dry-penalty-last-n")
translated("--dry-sequence-breaker", "--dry-sequence-breaker")
translated("--dynatemp-range", "--dynatemp-range")
translated("--dynatemp-exp", "--dynatemp-exp")
translated("--mirostat", "--mirostat")
translated("--mirostat-lr", "--mirostat-lr")
translated("--mirostat-ent", "--mirostat-ent")
# The adaptive-p sampler spekula does not have: fine at llama.cpp's value that disables it.
for _names, _noop in (("--adaptive-target", "-1"), ("--adaptive-decay", "0.9")):
    rejected(_names, "the adaptive-p sampler", nargs=1, noop=(_noop,))
rejected("-r --reverse-prompt", "server-wide stop strings", nargs=1)
rejected("-sp --special", "special tokens in the output text")
translated("--spm-infill", "--spm-infill", nargs=0)
rejected("--tags", "model tags in /v1/models", nargs=1, env="LLAMA_ARG_TAGS")
rejected("-mu --model-url", "downloading a model from a URL", nargs=1, env="LLAMA_ARG_MODEL_URL")
rejected("-dr --docker-repo", "Docker Hub models", nargs=1, env="LLAMA_ARG_DOCKER_REPO")
rejected("--rpc", "RPC backends", nargs=1, env="LLAMA_ARG_RPC")
rejected("--list-devices", "device listing")
rejected("-cl --cache-list", "model cache listing")
rejected("--completion-bash", "bash completion")
rejected("--reuse-port", "SO_REUSEPORT", env="LLAMA_ARG_REUSE_PORT")
rejected("--path", "static files", nargs=1, env="LLAMA_ARG_STATIC_PATH")
rejected("--api-prefix", "an API path prefix", nargs=1, env="LLAMA_ARG_API_PREFIX")
rejected("--cors-methods", "custom CORS methods", nargs=1, env="LLAMA_ARG_CORS_METHODS")
rejected("--cors-headers", "custom CORS headers", nargs=1, env="LLAMA_ARG_CORS_HEADERS")
rejected("--no-cors-credentials", "CORS without credentials", env="LLAMA_ARG_CORS_CREDENTIALS", env_sign=False)
rejected("--ui-mcp-proxy --webui-mcp-proxy", "the web UI's MCP CORS proxy", env="LLAMA_ARG_UI_MCP_PROXY",
         env_sign=True)
rejected("--tools", "llama-server built-in tools", nargs=1, env="LLAMA_ARG_TOOLS")
rejected("--tools-runtime", "llama-server built-in tools", nargs=1, env="LLAMA_ARG_TOOLS_RUNTIME")
rejected("--mcp-servers-config", "MCP servers", nargs=1, env="LLAMA_ARG_MCP_SERVERS_CONFIG")
rejected("--mcp-servers-json", "MCP servers", nargs=1, env="LLAMA_ARG_MCP_SERVERS_JSON")
rejected("-ag --agent", "llama-server agent mode", env="LLAMA_ARG_AGENT", env_sign=True)
rejected("--ssl-key-file", "HTTPS", nargs=1, env="LLAMA_ARG_SSL_KEY_FILE")
rejected("--ssl-cert-file", "HTTPS", nargs=1, env="LLAMA_ARG_SSL_CERT_FILE")
translated("--slot-save-path", "--slot-save-path")
rejected("--models-dir", "router mode (several models)", nargs=1, env="LLAMA_ARG_MODELS_DIR")
rejected("--models-preset", "router mode (several models)", nargs=1, env="LLAMA_ARG_MODELS_PRESET")
rejected("--models-max", "router mode (several models)", nargs=1, env="LLAMA_ARG_MODELS_MAX")
rejected("--sleep-idle-seconds", "sleeping when idle", nargs=1)
rejected("--embd-gemma-default --fim-qwen-1.5b-default --fim-qwen-3b-default --fim-qwen-7b-default "
         "--fim-qwen-7b-spec --fim-qwen-14b-spec --fim-qwen-30b-default --gpt-oss-20b-default "
         "--gpt-oss-120b-default --vision-gemma-4b-default --vision-gemma-12b-default",
         "llama-server's downloadable model presets")

BY_NAME: dict[str, Option] = {name: opt for opt in TABLE for name in opt.names}


# ------------------------------------------------------------------------------------------------
# Parsing

def _normalize(arg: str) -> str:
    """llama.cpp reads `_` as `-` in long option names (arg.cpp: `std::replace(..., '_', '-')`)."""
    return arg.replace("_", "-") if arg.startswith("--") else arg


def translate(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Translation:
    """Read a llama-server command line (and its environment variables) into a Translation."""
    environ = os.environ if environ is None else environ
    tr = Translation()
    given: list[tuple[Option, str, list[str]]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        inline: str | None = None
        if arg.startswith("--") and "=" in arg:  # a convenience llama-server lacks: --port=8080
            arg, inline = arg.split("=", 1)
        name = _normalize(arg)
        opt = BY_NAME.get(name)
        if opt is None:  # llama.cpp stops at the first one too: what follows may be its value
            what = f"argument {arg!r}" if not arg.startswith("-") else f"option {arg}"
            tr.errors.append(f"unknown {what}: not a llama-server option (see '{PROG} --help')")
            break
        if opt.nargs == 0:
            if inline is not None:
                tr.errors.append(f"{name} takes no value")
                continue
            values: list[str] = []
        elif inline is not None:
            values = [inline]
        else:
            if i + opt.nargs > len(argv):
                tr.errors.append(f"{name} expects a value")
                break
            values = list(argv[i:i + opt.nargs])
            i += opt.nargs
        given.append((opt, name, values))
    on_command_line = {o.env for o, _, _ in given if o.env}
    for opt, name, values in _from_environment(environ, on_command_line, tr):
        opt.handle(tr, name, values)
    for opt, name, values in given:
        opt.handle(tr, name, values)
    if "LLAMA_CACHE" in environ and "HF_HUB_CACHE" not in tr.env:
        # llama.cpp keeps -hf downloads in the hub layout under $LLAMA_CACHE before $HF_HUB_CACHE.
        tr.env["HF_HUB_CACHE"] = environ["LLAMA_CACHE"]
    return tr


def _from_environment(environ: Mapping[str, str], skip: set[str],
                      tr: Translation) -> list[tuple[Option, str, list[str]]]:
    """The options set by LLAMA_ARG_* variables, as llama.cpp reads them (before the command line,
    which overrides them): a flag applies when its variable is truthy; a flag with a --no- form reads
    the variable as a boolean, and LLAMA_ARG_NO_X as its negative form."""
    out: list[tuple[Option, str, list[str]]] = []
    for opt in TABLE:
        if opt.env is None or opt.env in skip:
            continue
        label = f"${opt.env}"
        if opt.env_sign is not None:
            neg = opt.env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1)
            if neg in environ:
                if not opt.env_sign:
                    out.append((opt, f"${neg}", []))
                continue
            if opt.env not in environ:
                continue
            value = environ[opt.env].strip().lower()
            if value not in _TRUTHY | _FALSEY:
                if opt.env_sign:  # report once, from the positive spelling
                    tr.errors.append(f"{label}={environ[opt.env]!r}: invalid boolean value")
                continue
            if (value in _TRUTHY) == opt.env_sign:
                out.append((opt, label, []))
        elif opt.env in environ:
            if opt.nargs == 0:
                if environ[opt.env].strip().lower() in _TRUTHY:
                    out.append((opt, label, []))
            else:
                out.append((opt, label, [environ[opt.env]]))
    return out


# ------------------------------------------------------------------------------------------------
# Help and main

def usage() -> str:
    def rows(kind: str) -> list[str]:
        out = []
        for opt in TABLE:
            if opt.kind != kind:
                continue
            spelled = ", ".join(opt.names) + (" X" * opt.nargs)
            out.append(f"  {spelled:<44} {opt.note}" if len(spelled) <= 44 else f"  {spelled}\n  {'':<44} {opt.note}")
        return out

    rejected_names = sorted({o.names[-1] for o in TABLE if o.kind == "rejected"})
    return "\n".join([
        f"usage: {PROG} [llama-server options]",
        "",
        f"Runs `spekula serve --port` from a llama-server command line (llama.cpp build {LLAMA_BUILD}).",
        "Long option names may use '_' for '-'; LLAMA_ARG_* and LLAMA_API_KEY are read as llama-server",
        "reads them. Defaults follow llama-server: 127.0.0.1:8080, 4 slots sharing -c when -np is not",
        "given, CORS origins *, drafts to the --spec-draft-n-* caps. Without -m/-hf spekula's embedded",
        f"SmolLM2 model is served. ${EXTRA_ARGS_ENV}: more `spekula serve` arguments (e.g. --backend torch).",
        "",
        "translated:",
        *rows("translated"),
        "",
        "accepted, no effect in spekula:",
        *rows("accepted"),
        "",
        "rejected (features spekula does not implement): " + " ".join(rejected_names),
        "the adaptive-p sampler's options are accepted at llama.cpp's disabled value, e.g. --adaptive-target -1.",
    ])


def _shown(argv: Sequence[str]) -> str:
    out, hide = [], False
    for arg in argv:
        out.append("***" if hide else arg)
        hide = arg == "--api-key"
    return shlex.join(out)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    tr = translate(args)
    if tr.help:
        with contextlib.suppress(BrokenPipeError):  # `spekula-server --help | head`
            print(usage())
        return 0
    if tr.version:
        from importlib.metadata import PackageNotFoundError, version

        try:
            own = version("spekula")
        except PackageNotFoundError:
            own = "unknown"
        print(f"{PROG} (spekula {own}), llama-server command line of build {LLAMA_BUILD}")
        return 0
    if tr.errors:
        for message in dict.fromkeys(tr.errors):
            print(f"{PROG}: {message}", file=sys.stderr)
        return 1
    serve = ["serve", *tr.serve_argv(), *shlex.split(os.environ.get(EXTRA_ARGS_ENV, ""))]
    os.environ.update(tr.env)
    print(f"{PROG}: spekula {_shown(serve)}", file=sys.stderr, flush=True)
    if tr.ignored:
        print(f"{PROG}: no effect in spekula: {' '.join(tr.ignored)}", file=sys.stderr, flush=True)
    from spekula.frontends.cli.main import main as spekula_main

    return spekula_main(serve)


if __name__ == "__main__":
    raise SystemExit(main())
