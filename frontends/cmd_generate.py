"""`spekula generate`: one prompt through the Engine, text streamed to stdout.

stdout carries only the generated text (or, with --json, one llama-server /completion object);
logs, timings and llama.cpp's speculation statistics go to stderr, as plain lines and as structlog
events.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import anyio
import structlog
from spekula.core.engine import Engine
from spekula.core.errors import ConfigError
from spekula.core.events import FinalEvent, PieceEvent
from spekula.frontends.options import add_engine_options, build_engine, completion_request

HELP = "Generate text from a prompt (optionally with speculative decoding)"

log = structlog.get_logger("spekula.generate")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-p", "--prompt", help="prompt text")
    p.add_argument("-f", "--file", help="read the prompt from a file")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-generation tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object (llama-server /completion fields)")
    add_engine_options(p)


def configure_logging(verbose: bool) -> None:
    """structlog to stderr, so stdout stays the generated text alone."""
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="%H:%M:%S"),
                    structlog.dev.ConsoleRenderer(colors=False)],
        wrapper_class=structlog.make_filtering_bound_logger(10 if verbose else 20),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def _prompt_text(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.file:
        raise ConfigError("give either -p/--prompt or -f/--file, not both")
    if args.file:
        try:
            with open(args.file, encoding="utf-8") as fh:
                return fh.read()
        except OSError as exc:
            raise ConfigError(f"cannot read prompt file {args.file}: {exc.strerror}") from None
    if args.prompt is None:
        raise ConfigError("no prompt: pass -p TEXT or -f FILE")
    return str(args.prompt)


def statistics_lines(engine: Engine, final: FinalEvent) -> list[str]:
    """llama.cpp's per-drafter `statistics` lines, the slot's `draft acceptance` line, and a histogram."""
    lines = engine.spec_stats.lines(prefix=True)
    entry = engine.request_stats.get(final.request_id)
    if entry is not None and entry["spec"].n_draft_tokens > 0:
        spec = entry["spec"]
        lines.append(spec.format_line(entry["slot"], 0))
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


async def _generate(engine: Engine, args: argparse.Namespace, prompt: list[int]) -> FinalEvent:
    req = completion_request(args, prompt, stop=list(args.stop), ignore_eos=args.ignore_eos)
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        handle = engine.submit(req)
        async for event in handle:
            if isinstance(event, PieceEvent) and event.text and not args.json:
                sys.stdout.write(event.text)
                sys.stdout.flush()
        tg.cancel_scope.cancel()
    assert handle.final is not None
    return handle.final


def run(args: argparse.Namespace) -> int:
    configure_logging(args.verbose)
    text = _prompt_text(args)
    engine = build_engine(args)
    try:
        tok = engine.tokenizer
        if args.chat:
            text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompt = tok.encode(text, add_special=True, parse_special=True)
        log.info("generate", model=engine.backend.info.name, n_prompt=len(prompt),
                 spec_types=list(engine.config.spec.types))
        final = anyio.run(_generate, engine, args, prompt)
    finally:
        engine.backend.close()
    if args.json:
        out = {"content": final.content, "tokens": final.tokens, "stop_type": final.stop_type,
               "stopping_word": final.stopping_word, "tokens_evaluated": final.tokens_evaluated,
               "timings": final.timings}
        if final.error:
            out["error"] = final.error
        print(json.dumps(out))
    else:
        print()
    if final.timings:  # requests rejected before running (bad prompt, context) carry none
        for line in _timing_lines(final.timings):
            print(line, file=sys.stderr)
    if engine.config.spec.types:
        for line in statistics_lines(engine, final):
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
