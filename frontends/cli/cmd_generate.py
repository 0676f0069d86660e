"""`spekula generate`: one prompt through the Engine, text streamed to stdout.

stdout carries only the generated text (or, with --json, one llama-server /completion object);
timings and llama.cpp's speculation statistics go to stderr as llama.cpp prints them; the same
numbers as structured events only with -v or --log-format json. A request rejected before generating (bad prompt, context) prints nothing to stdout in text
mode. When the reader of stdout goes away (`spekula generate ... | head -c1`), generation is cancelled
and the command exits quietly with 141, the status of a process killed by SIGPIPE.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any

import anyio
import structlog

from spekula.core.engine.engine import Engine
from spekula.core.errors import ConfigError
from spekula.core.events import FinalEvent, PieceEvent
from spekula.core.modelfile.constraint import ConstraintError, GrammarSpec
from spekula.core.verify.sampling import banning_end_of_generation
from spekula.frontends.cli.main import EXIT_BROKEN_PIPE, collector_paused, silence_stdout
from spekula.frontends.cli.options import add_engine_options, build_engine, completion_request
from spekula.frontends.logging_setup import configure_logging

HELP = "Generate text from a prompt (optionally with speculative decoding)"

log = structlog.get_logger("spekula.generate")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-p", "--prompt", help="prompt text")
    p.add_argument("-f", "--file", help="read the prompt from a file")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="never end at an end-of-generation token: they are banned (a -inf bias), as in llama.cpp")
    p.add_argument("--json", action="store_true", help="print one JSON object (llama-server /completion fields)")
    g = p.add_argument_group("constrained output (llama.cpp names)")
    g.add_argument("--grammar", default=None, metavar="GBNF", help="constrain the output to a GBNF grammar")
    g.add_argument("--grammar-file", default=None, metavar="FILE", help="read the GBNF grammar from FILE")
    g.add_argument("-j", "--json-schema", default=None, metavar="SCHEMA",
                   help="constrain the output to a JSON schema, e.g. '{\"type\": \"object\"}'")
    g.add_argument("-jf", "--json-schema-file", default=None, metavar="FILE", help="read the JSON schema from FILE")
    add_engine_options(p)


def grammar_from_args(args: argparse.Namespace) -> GrammarSpec | None:
    """The one constraint the options give (at most one of them), read but not yet compiled."""
    given = [o for o in ("grammar", "grammar_file", "json_schema", "json_schema_file") if getattr(args, o)]
    if len(given) > 1:
        raise ConfigError("give one of --grammar, --grammar-file, --json-schema, --json-schema-file")
    if not given:
        return None
    option, value = given[0], getattr(args, given[0])
    if option.endswith("_file"):
        try:
            with open(value, encoding="utf-8") as fh:
                value = fh.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read --{option.replace('_', '-')} {value}: {exc}") from None
    if option.startswith("grammar"):
        return GrammarSpec("gbnf", value)
    try:
        schema = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--{option.replace('_', '-')}: not JSON: {exc}") from None
    return GrammarSpec("json_schema", json.dumps(schema))


def _prompt_text(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.file:
        raise ConfigError("give either -p/--prompt or -f/--file, not both")
    if args.file:
        try:
            with open(args.file, encoding="utf-8") as fh:
                return fh.read()
        except OSError as exc:
            raise ConfigError(f"cannot read prompt file {args.file}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"prompt file {args.file} is not UTF-8 text (invalid byte 0x{exc.object[exc.start]:02x} "
                              f"at offset {exc.start}); convert it, e.g. with iconv -t UTF-8") from None
    if args.prompt is None:
        raise ConfigError("no prompt: pass -p TEXT or -f FILE")
    return str(args.prompt)


def statistics_lines(engine: Engine, final: FinalEvent, *, verbose: bool = False) -> list[str]:
    """llama.cpp's per-drafter `statistics` lines and the slot's `draft acceptance` line; with
    `verbose`, the per-position acceptance line and a histogram too."""
    lines = engine.spec_stats.lines(prefix=True)
    entry = engine.request_stats.get(final.request_id)
    if entry is not None and entry["spec"].n_draft_tokens > 0:
        spec = entry["spec"]
        lines.append(spec.format_line(entry["slot"], 0))
        if verbose:
            lines.append(spec.format_per_pos_line(entry["slot"], 0))
            hist = ", ".join(f"{n}:{c}" for n, c in enumerate(spec.histogram))
            lines.append(f"acceptance histogram (accepted drafts per round: rounds) = {{{hist}}}")
    return lines


def _timing_lines(t: dict[str, Any]) -> list[str]:
    return [
        f"prompt eval time = {t['prompt_ms']:10.2f} ms / {t['prompt_n']:5d} tokens "
        f"({t['prompt_per_token_ms']:8.2f} ms per token, {t['prompt_per_second']:8.2f} tokens per second)",
        f"       eval time = {t['predicted_ms']:10.2f} ms / {t['predicted_n']:5d} tokens "
        f"({t['predicted_per_token_ms']:8.2f} ms per token, {t['predicted_per_second']:8.2f} tokens per second)",
    ]


class _Stdout:
    """stdout that notices its reader going away instead of raising from inside the task group."""

    def __init__(self) -> None:
        self.wrote = False  # any text at all (decides the trailing newline)
        self.gone = False
        self.interrupted = False  # Ctrl-C during generation

    def write(self, text: str) -> bool:
        if self.gone:
            return False
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError:
            self.gone = True
            silence_stdout()
            return False
        self.wrote = self.wrote or bool(text)
        return True


async def _generate(engine: Engine, args: argparse.Namespace, prompt: list[int], out: _Stdout) -> FinalEvent:
    req = completion_request(args, prompt, stop=list(args.stop), ignore_eos=args.ignore_eos,
                             grammar=grammar_from_args(args))
    if req.ignore_eos and req.grammar is None:
        req.sampling = banning_end_of_generation(req.sampling, getattr(engine.tokenizer, "eog_ids", ()))
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        handle = engine.submit(req)
        tg.start_soon(_cancel_on_interrupt, handle, out)
        async for event in handle:
            if isinstance(event, PieceEvent) and event.text and not args.json and not out.write(event.text):
                handle.cancel()  # nobody reads the rest; the final event still arrives
        tg.cancel_scope.cancel()
    assert handle.final is not None
    return handle.final


async def _cancel_on_interrupt(handle: Any, out: _Stdout) -> None:
    """Ctrl-C while generating cancels the request (the engine stops at the next round) instead of
    relying on a KeyboardInterrupt reaching the right frame of the event loop."""
    with anyio.open_signal_receiver(signal.SIGINT) as signals:
        async for _ in signals:
            out.interrupted = True
            handle.cancel()
            return


def run(args: argparse.Namespace) -> int:
    configure_logging(args.verbose, log_format=args.log_format)
    text = _prompt_text(args)
    grammar = grammar_from_args(args)  # a bad option fails before the model loads
    with collector_paused():
        engine = build_engine(args)
    try:
        tok = engine.tokenizer
        if grammar is not None:
            try:
                engine.grammars.compile(grammar)
            except ConstraintError as exc:
                what = "JSON schema" if grammar.kind == "json_schema" else "grammar"
                raise ConfigError(f"invalid {what}: {exc}") from None
        if args.chat:
            text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompt = tok.encode(text, add_special=True, parse_special=True)
        log.info("generate", model=engine.backend.info.name, n_prompt=len(prompt),
                 spec_types=list(engine.config.spec.types))
        out = _Stdout()
        final = anyio.run(_generate, engine, args, prompt, out)
    finally:
        engine.backend.close()
    if args.json:
        obj = {"content": final.content, "tokens": final.tokens, "stop_type": final.stop_type,
               "stopping_word": final.stopping_word, "tokens_evaluated": final.tokens_evaluated,
               "timings": final.timings}
        if final.error:
            obj["error"] = final.error
        out.write(json.dumps(obj) + "\n")
    elif out.wrote or final.stop_type != "error":
        out.write("\n")
    if out.gone:
        return EXIT_BROKEN_PIPE
    if out.interrupted:
        return 130  # as a shell reports a command ended by SIGINT
    if final.timings:  # requests rejected before running (bad prompt, context) carry none
        for line in _timing_lines(final.timings):
            print(line, file=sys.stderr)
    if engine.config.spec.types:
        for line in statistics_lines(engine, final, verbose=args.verbose):
            print(line, file=sys.stderr)
        for name, counters in engine.stats()["drafters"].items():
            log.info("spec_statistics", drafter=name, **counters)
        entry = engine.request_stats.get(final.request_id)
        if entry is not None:
            log.info("slot_spec_statistics", slot=entry["slot"], **entry["spec"].to_dict())
    if final.stop_type == "error":
        print(f"spekula: error: {final.error}", file=sys.stderr)
        return 1
    return 0
