"""`spekula serve`'s options, and the server settings read from them: shared by the command and by
the Ray Serve application (frontends/ray/app.py), which takes the same options."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from spekula.core.embedding import EUCLIDEAN, Pooling
from spekula.core.errors import ConfigError
from spekula.frontends.cli.options import add_engine_options, sampling_from_args
from spekula.frontends.http.fields import MAX_BODY_DEFAULT
from spekula.frontends.http.guarded_protocol import DEFAULT_HEADER_TIMEOUT
from spekula.frontends.rpc.framing import DEFAULT_MAX_LINE_BYTES, DEFAULT_WRITE_TIMEOUT
from spekula.frontends.rpc.server import DEFAULT_MAX_CONNECTIONS
from spekula.frontends.rpc.socket_identity import default_socket_path
from spekula.frontends.schema.completion import ServerDefaults
from spekula.frontends.schema.reasoning_budget import ReasoningBudgetError, read_budget

if TYPE_CHECKING:
    from spekula.frontends.http.state import HttpState

DEFAULT_BODY_TIMEOUT = 60.0
# The smallest useful request line: a completion call with a short prompt and a few fields takes a
# few hundred bytes, so a lower limit would reject every real request (a negative one all of them).
MIN_LINE_BYTES = 1024


def _line_bytes(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of bytes, got {text!r}") from None
    if value < MIN_LINE_BYTES:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_LINE_BYTES} bytes, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def _reasoning_budget(text: str) -> int:
    try:
        return read_budget(int(text), "--reasoning-budget")
    except ValueError as exc:  # not an integer, or a budget that is not built
        raise argparse.ArgumentTypeError(str(exc) if isinstance(exc, ReasoningBudgetError) else
                                         f"expected an integer, got {text!r}") from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _embd_norm(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < -1:
        raise argparse.ArgumentTypeError(f"must be >= -1, got {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--socket", default=None, metavar="PATH",
                   help="Unix socket path, created with mode 0600 (default without --port: "
                        f"{default_socket_path()}; with --port: no socket unless given)")
    g.add_argument("--max-line-bytes", type=_line_bytes, default=DEFAULT_MAX_LINE_BYTES, metavar="N",
                   help="longest accepted request line; longer ones get an error reply (default: 8 MiB)")
    g.add_argument("--no-prefill-assistant", dest="prefill_assistant", action="store_false", default=True,
                   help="a chat that ends with an assistant message gets a new assistant turn after it, instead "
                        "of that message being continued (a prefill, the default)")
    g.add_argument("--reasoning-format", choices=("auto", "deepseek", "none"), default="auto",
                   help="chat replies of templates that think: <think> text into reasoning_content (auto, "
                        "deepseek: llama-server's default) or left in the content (none); a request's "
                        "reasoning_format overrides it")
    g.add_argument("--reasoning-budget", type=_reasoning_budget, default=-1, metavar="N",
                   help="chat reasoning: -1 unlimited, 0 none (the template asked for none, a prompt that opens "
                        "reasoning closed), N > 0: N tokens of reasoning, then its end tag forced (default: -1); "
                        "a request's reasoning_budget_tokens overrides it")
    g.add_argument("--reasoning-budget-message", default="", metavar="MESSAGE",
                   help="text forced before the end-of-reasoning tag when a reasoning budget runs out "
                        "(default: none); a request's reasoning_budget_message overrides it")
    g.add_argument("--spm-infill", action="store_true",
                   help="/infill: the suffix before the prefix, for models trained that way (default: prefix first)")
    g.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM/SIGINT, seconds to let in-flight requests finish (default: 30)")
    g.add_argument("--max-connections", type=_positive, default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                   help="open connections at most, on the socket and over HTTP each; more are told so and closed "
                        "(default: %(default)s)")
    g.add_argument("--write-timeout", type=float, default=DEFAULT_WRITE_TIMEOUT, metavar="S",
                   help="disconnect a client that reads nothing for S seconds while replies wait (default: %(default)s)")
    e = p.add_argument_group("embeddings and reranking")
    e.add_argument("--embedding", "--embeddings", dest="embedding", action="store_true",
                   help="serve /embedding, /embeddings and /v1/embeddings: the model's final hidden states, pooled "
                        "(completions are still served)")
    e.add_argument("--pooling", choices=[p.value for p in Pooling], default=None,
                   help="how --embedding pools a sequence: none (a vector per token), mean, cls (first token), last, "
                        "rank (a reranker's score) (default: the model file's pooling_type, else none)")
    e.add_argument("--rerank", "--reranking", dest="reranking", action="store_true",
                   help="serve /rerank (and /v1/rerank, /v1/reranking): --embedding with rank pooling; needs a "
                        "reranker GGUF (a Qwen3 reranker's cls.output head)")
    e.add_argument("--embd-normalize", type=_embd_norm, default=EUCLIDEAN, metavar="N",
                   help="normalisation of pooled embeddings: -1 none, 0 max-absolute (int16 range), 1 taxicab, "
                        "2 euclidean, p > 2 p-norm (default: %(default)s); a request's embd_normalize overrides it")
    h = p.add_argument_group("HTTP (llama-server / OpenAI API)")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    h.add_argument("--port", type=_port, default=None,
                   help="serve the HTTP API on this port (0: any free port; default: no HTTP server)")
    h.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (comma-separated "
                        "or repeated for several keys)")
    h.add_argument("--api-key-file", action="append", default=[], metavar="FILE",
                   help="file with one API key per line ('#' lines are comments)")
    h.add_argument("--metrics", action="store_true", help="enable /metrics (Prometheus text format)")
    h.add_argument("-a", "--alias", default=None, help="model name reported by the API (default: the file name)")
    h.add_argument("--cors-origins", default="*",
                   help="origins allowed by CORS: * (any, reflected with credentials, as llama-server does), "
                        "localhost, or a comma-separated list (default: %(default)s)")
    h.add_argument("--slots", dest="slots_endpoint", action="store_true", default=True,
                   help="enable GET /slots (default)")
    h.add_argument("--no-slots", dest="slots_endpoint", action="store_false", help="disable GET /slots")
    h.add_argument("--slot-save-path", default=None, metavar="DIR",
                   help="enable POST /slots/{id}?action=save|restore|erase, with slot files in DIR (created if "
                        "missing)")
    h.add_argument("--max-body-bytes", type=_line_bytes, default=MAX_BODY_DEFAULT, metavar="N",
                   help="largest accepted request body; larger ones get 413 (default: 32 MiB)")
    h.add_argument("--path", dest="static_path", default=None, metavar="DIR",
                   help="serve static files from DIR at / (e.g. a build of llama.cpp's web UI); no API key "
                        "is needed for them, as with llama-server's UI")
    h.add_argument("--timeout", dest="keep_alive_timeout", type=_positive, default=5, metavar="S",
                   help="seconds an idle keep-alive connection stays open (default: %(default)s)")
    h.add_argument("--header-timeout", type=_seconds, default=DEFAULT_HEADER_TIMEOUT, metavar="S",
                   help="a request's head must arrive within S seconds of the connection (or of the previous "
                        "response); slower connections are closed (default: %(default)g)")
    h.add_argument("--body-timeout", type=_seconds, default=DEFAULT_BODY_TIMEOUT, metavar="S",
                   help="a request's body must arrive within S seconds of its head; slower ones get 408 "
                        "(default: %(default)g)")
    r = p.add_argument_group("Ray Serve (several engine replicas behind one HTTP endpoint)")
    r.add_argument("--ray", action="store_true",
                   help="serve the HTTP API from Ray Serve: an ingress routing by prompt prefix to --replicas "
                        "engines (needs `pip install spekula[ray]`; --port defaults to 8000 here)")
    r.add_argument("--replicas", type=_positive, default=1, metavar="N",
                   help="engine replicas, each with its own slots (-np), threads (-t) and device (default: 1)")
    r.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (e.g. 127.0.0.1:6379 after `ray start --head`); "
                        "default: start a local one for this process")
    add_engine_options(p)


def serve_parser() -> argparse.ArgumentParser:
    """`spekula serve`'s options on a parser of their own (for a Ray Serve application's args)."""
    parser = argparse.ArgumentParser(prog="spekula serve")
    add_arguments(parser)
    return parser


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {value}")
    return value


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    keys = [k.strip() for arg in args.api_key for k in arg.split(",") if k.strip()]
    for path in args.api_key_file:
        try:
            with open(path, encoding="utf-8") as f:
                # one key per line; '#' starts a comment line, as in llama-server's key files
                keys.extend(line.strip() for line in f if line.strip() and not line.lstrip().startswith("#"))
        except OSError as exc:
            raise ConfigError(f"cannot read --api-key-file {path}: {exc.strerror or exc}") from None
    return tuple(keys)


def _static_dir(path: str | None) -> str | None:
    if path is None:
        return None
    if not os.path.isdir(path):
        raise ConfigError(f"--path {path} is not a directory")
    return os.path.abspath(path)


def _slot_save_dir(path: str | None) -> str | None:
    """--slot-save-path, created if missing (as llama-server does); a path that cannot be a directory is refused."""
    if path is None:
        return None
    if not path:
        raise ConfigError("--slot-save-path needs a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--slot-save-path {path}: cannot create the directory: {exc.strerror or exc}") from None
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"--slot-save-path {path} is not a writable directory")
    return os.path.abspath(path)


def http_state(args: argparse.Namespace) -> HttpState:
    """The HTTP frontend's settings from the command line (no engine yet)."""
    from spekula.frontends.http.state import HttpState

    # llama-server's default model name: the file name, or the repo given with -hf
    if args.model:
        model_name = os.path.basename(args.model)
    elif getattr(args, "hf_repo", None):
        model_name = str(args.hf_repo)
    else:
        model_name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    return HttpState(api_keys=api_keys(args), metrics=args.metrics, max_body_bytes=args.max_body_bytes,
                     model_alias=args.alias or model_name, model_path=args.model or args.hf_repo or "",
                     write_timeout=args.write_timeout, body_timeout=args.body_timeout,
                     cors_origins=args.cors_origins,
                     slots_endpoint=args.slots_endpoint, static_dir=_static_dir(args.static_path),
                     slot_save_path=_slot_save_dir(args.slot_save_path),
                     verbose=bool(getattr(args, "verbose", False)), spm_infill=args.spm_infill,
                     embd_normalize=args.embd_normalize)


def server_defaults(args: argparse.Namespace) -> ServerDefaults:
    return ServerDefaults(sampling=sampling_from_args(args), n_predict=args.n_predict,
                          prefill_assistant=args.prefill_assistant, reasoning_format=args.reasoning_format,
                          n_keep=args.keep, reasoning_budget=args.reasoning_budget,
                          reasoning_budget_message=args.reasoning_budget_message)
