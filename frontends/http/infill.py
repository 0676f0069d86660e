"""POST /infill: llama-server's code completion at a cursor (llama.vim, llama.vscode).

The body is a /completion body whose prompt is built from `input_prefix` (the code before the
cursor), `input_suffix` (after it), `input_extra` (other files: `[{"filename", "text"}]`) and an
optional `prompt` (text already typed at the cursor), laid out by core/modelfile/infill.py. The answer is
/completion's, streamed or not; speculation applies as to any request (n-gram drafters do well on
code that repeats the file around it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
from starlette.requests import Request
from starlette.responses import Response

from spekula.core.modelfile.infill import ExtraFile, InfillError, check_model, infill_prompt
from spekula.frontends.http.errors import HttpError
from spekula.frontends.http.fields import normalise
from spekula.frontends.http.native import answer, response_fields
from spekula.frontends.schema.completion import COMPLETION_FIELDS

if TYPE_CHECKING:
    from spekula.frontends.http.state import HttpState

INFILL_FIELDS = ("input_prefix", "input_suffix", "input_extra")


async def infill(request: Request) -> Response:
    state: HttpState = request.app.state.http
    engine = state.ready()
    tok = engine.tokenizer
    try:
        check_model(getattr(tok, "fim", {}))
    except InfillError as exc:
        raise HttpError(str(exc), "not_supported_error") from None
    body = await state.read_json(request)
    if not isinstance(body, dict):
        raise HttpError("request body must be a JSON object")
    for name in ("input_prefix", "input_suffix"):
        if name not in body:
            raise HttpError(f'"{name}" is required')
    inputs = {name: body.pop(name) for name in INFILL_FIELDS if name in body}
    typed = body.pop("prompt", None)
    if typed is not None and not isinstance(typed, str):
        raise HttpError('"prompt" must be a string')
    fields = response_fields(body)
    params, opts = normalise(body, allowed=COMPLETION_FIELDS - {"prompt"}, n_slots=engine.config.n_slots)
    extra = _extra_files(inputs.get("input_extra"))
    cfg, n_predict, spm = engine.config, state.service.defaults.n_predict, state.spm_infill

    def build() -> list[int]:  # tokenizing whole files: in a worker thread, off the event loop
        def plain(text: str) -> list[int]:  # the code itself: special-token texts in it are just text
            return list(tok.encode(text, add_special=False, parse_special=False))

        prefix = _code_tokens(inputs["input_prefix"], "input_prefix", plain, tok.n_vocab)
        suffix = _code_tokens(inputs["input_suffix"], "input_suffix", plain, tok.n_vocab)
        prompt = tok.encode(typed or "", add_special=False, parse_special=True)
        return infill_prompt(tok.fim, plain, prefix=prefix, suffix=suffix, extra=extra, prompt=prompt,
                             n_batch=min(cfg.n_batch, cfg.n_ctx), n_predict=n_predict, n_ctx=cfg.n_ctx,
                             bos=tok.bos_id if tok.add_bos else None, spm=spm)

    tokens = await anyio.to_thread.run_sync(build)
    return await answer(state, request, params, opts, [tokens], fields)


def _code_tokens(value: Any, name: str, plain: Callable[[str], list[int]], n_vocab: int) -> list[int]:
    """A text, or a list mixing texts and token ids (llama-server's mixed form)."""
    if isinstance(value, str):
        return plain(value)
    if not isinstance(value, list):
        raise HttpError(f'"{name}" must be a string or a list of strings and token ids')
    ids: list[int] = []
    for part in value:
        if isinstance(part, str):
            ids += plain(part)
        elif isinstance(part, int) and not isinstance(part, bool) and 0 <= part < n_vocab:
            ids.append(part)
        else:
            raise HttpError(f'"{name}" must be a string or a list of strings and token ids in [0, {n_vocab})')
    return ids


def _extra_files(value: Any) -> list[ExtraFile]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise HttpError('"input_extra" must be an array of {"filename": string, "text": string}')
    out = []
    for chunk in value:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise HttpError('extra_context chunk must contain a "text" field with a string value')
        filename = chunk.get("filename", "tmp")
        if not isinstance(filename, str):
            raise HttpError("extra_context chunk's \"filename\" field must be a string")
        out.append(ExtraFile(filename, chunk["text"]))
    return out
