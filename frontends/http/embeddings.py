"""Embeddings and reranking over HTTP, in llama-server's shapes: `/embedding` and `/embeddings` (its
native array, per-token vectors when the pooling is none), `/v1/embeddings` (OpenAI's list, `usage`,
float or base64 vectors), and `/rerank` (Jina's `results` with `relevance_score`, or TEI's plain list
when the documents come as `texts`).

The server's pooling is fixed at start (`--embedding --pooling`, `--reranking`); each sequence is
computed by `ServingEngine.embed` (core/engine/embedding_jobs.py) and normalised here.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from spekula.core.embedding import Pooling, normalize
from spekula.core.engine.embedding_jobs import EmbeddingsOff, InputTooLong
from spekula.core.engine.request_plan import RequestRejected
from spekula.frontends.http.errors import HttpError, from_rpc
from spekula.frontends.rpc.protocol import RpcError
from spekula.frontends.schema import completion as rp

if TYPE_CHECKING:
    from spekula.frontends.http.serving_engine import ServingEngine
    from spekula.frontends.http.state import HttpState

MAX_INPUTS = 2048  # sequences per request (OpenAI's own limit for one embeddings call)
EMBEDDING_FIELDS = {"input", "content", "encoding_format", "embd_normalize", "model", "user", "dimensions"}
RERANK_FIELDS = {"query", "documents", "texts", "top_n", "return_text", "model", "user"}
_MULTIMODAL = {"image_url", "input_audio", "input_video"}


def _pooling(engine: ServingEngine) -> Pooling | None:
    return getattr(engine.config, "pooling", None)


def _content_parts_text(parts: Any) -> str:
    """An OpenAI content array: its text parts joined (the same tokens as one string)."""
    if not isinstance(parts, list):
        raise HttpError("'content' of an input object must be an array of content parts")
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _MULTIMODAL:
            raise HttpError("Multimodal data provided, but model does not support multimodal requests.")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise HttpError(f"unsupported content part {kind!r}: only text parts ({{'type': 'text', 'text': ...}})")
        texts.append(part["text"])
    return "".join(texts)


async def _entry_tokens(state: HttpState, entry: Any) -> list[int]:
    if isinstance(entry, dict) and "content" in entry:
        if set(entry) != {"content"}:
            raise HttpError("an input object with 'content' must hold nothing else")
        return await state.service.encode(_content_parts_text(entry["content"]))
    if isinstance(entry, bool) or not isinstance(entry, str | list | dict):
        raise HttpError("'input' must be a string, a list of tokens, a list of such, or content objects")
    return (await state.service.prompt_tokens(entry))[0]


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


async def _input_tokens(state: HttpState, value: Any) -> list[list[int]]:
    """llama-server's input shapes: a list holding no number is a batch of entries, anything else is one."""
    entries = value if isinstance(value, list) and not any(map(_is_number, value)) else [value]
    if not entries:
        raise HttpError('"input" must not be empty')
    if len(entries) > MAX_INPUTS:
        raise HttpError(f"'input' holds {len(entries)} sequences (at most {MAX_INPUTS} per request)")
    return [await _entry_tokens(state, e) for e in entries]


def _embd_normalize(body: dict[str, Any], default: int) -> int:
    value = body.get("embd_normalize", default)
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise HttpError("'embd_normalize' must be an integer >= -1 (-1 none, 0 max-absolute, 1 taxicab, "
                        "2 euclidean, p > 2 p-norm)")
    return value


async def _embed_all(engine: ServingEngine, prompts: list[list[int]]) -> list[np.ndarray]:
    """Every sequence queued at once (the engine runs them in one hand-off), results in input order. The
    first failure withdraws the sequences not yet computed and is the answer."""
    results: list[np.ndarray | None] = [None] * len(prompts)
    failures: list[BaseException] = []

    async with anyio.create_task_group() as tg:
        async def one(i: int) -> None:
            try:
                results[i] = await engine.embed(prompts[i])
            except (RequestRejected, RuntimeError) as exc:
                failures.append(exc)
                tg.cancel_scope.cancel()

        for i in range(len(prompts)):
            tg.start_soon(one, i)
    if failures:
        raise _http_error(failures[0])
    return [r for r in results if r is not None]


def _http_error(exc: BaseException) -> HttpError:
    if isinstance(exc, InputTooLong):
        return HttpError(str(exc), "exceed_context_size_error",
                         extra={"n_prompt_tokens": exc.n_tokens, "n_ctx": exc.n_ctx})
    if isinstance(exc, EmbeddingsOff):
        return HttpError(str(exc), "not_supported_error")
    if isinstance(exc, RequestRejected):
        return HttpError(str(exc))
    return HttpError(str(exc), "server_error")


async def _embeddings(request: Request, *, oai: bool) -> Response:
    state: HttpState = request.app.state.http
    engine = state.ready()
    pooling = _pooling(engine)
    if pooling is None:
        raise HttpError("This server does not support embeddings. Start it with `--embeddings`", "not_supported_error")
    if pooling is Pooling.RANK:
        raise HttpError("This server ranks documents (--reranking); embeddings need another --pooling",
                        "not_supported_error")
    if oai and pooling is Pooling.NONE:
        raise HttpError("Pooling type 'none' is not OAI compatible. Please use a different pooling type")
    body = rp.as_object(await state.read_json(request), "embeddings")
    rp.reject_unknown(body, EMBEDDING_FIELDS, "embeddings")
    if "input" in body:
        value = body["input"]
    elif "content" in body:
        oai, value = False, body["content"]  # `content` is llama-server's own field: its native answer
    else:
        raise HttpError('"input" or "content" must be provided')
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise HttpError("The format to return the embeddings in. Can be either float or base64")
    norm = _embd_normalize(body, state.embd_normalize)
    prompts = await _input_tokens(state, value)
    for p in prompts:
        if not p:
            raise HttpError("Input content cannot be empty")
    vectors = await _embed_all(engine, prompts)
    if pooling is not Pooling.NONE:
        vectors = [normalize(v, norm) for v in vectors]
    dims = body.get("dimensions")
    if dims is not None and (not oai or dims != int(vectors[0].shape[-1])):
        raise HttpError(f"'dimensions' must be the model's embedding size, {int(vectors[0].shape[-1])} "
                        "(shortened embeddings are not supported)")
    if not oai:  # llama-server's native shape: a list of vectors per input (one when pooled)
        return JSONResponse([{"index": i, "embedding": (v if v.ndim == 2 else v[None]).tolist()}
                             for i, v in enumerate(vectors)])
    data = []
    for i, v in enumerate(vectors):
        item: dict[str, Any] = {"embedding": v.tolist(), "index": i, "object": "embedding"}
        if fmt == "base64":
            item["embedding"] = base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
            item["encoding_format"] = "base64"
        data.append(item)
    n_tokens = sum(len(p) for p in prompts)
    return JSONResponse({"model": body.get("model", state.model_alias), "object": "list",
                         "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}, "data": data})


async def embeddings_native(request: Request) -> Response:
    try:
        return await _embeddings(request, oai=False)
    except RpcError as exc:
        raise from_rpc(exc) from None


async def embeddings_oai(request: Request) -> Response:
    try:
        return await _embeddings(request, oai=True)
    except RpcError as exc:
        raise from_rpc(exc) from None


def _documents(body: dict[str, Any]) -> list[str]:
    docs = body["documents"] if "documents" in body else body.get("texts")
    if not isinstance(docs, list) or not docs or not all(isinstance(d, str) for d in docs):
        raise HttpError('"documents" must be a non-empty string array')
    if len(docs) > MAX_INPUTS:
        raise HttpError(f"{len(docs)} documents (at most {MAX_INPUTS} per request)")
    return docs


async def rerank(request: Request) -> Response:
    try:
        return await _rerank(request)
    except RpcError as exc:
        raise from_rpc(exc) from None


async def _rerank(request: Request) -> Response:
    state: HttpState = request.app.state.http
    engine = state.ready()
    if _pooling(engine) is not Pooling.RANK or state.rerank_format is None:
        raise HttpError("This server does not support reranking. Start it with `--reranking`", "not_supported_error")
    body = rp.as_object(await state.read_json(request), "rerank")
    rp.reject_unknown(body, RERANK_FIELDS, "rerank")
    query = body.get("query")
    if "query" not in body:
        raise HttpError('"query" must be provided')
    if not isinstance(query, str):
        raise HttpError('"query" must be a string')
    docs = _documents(body)
    top_n = body.get("top_n", len(docs))
    if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0:
        raise HttpError("'top_n' must be a non-negative integer")
    tei = "texts" in body  # TEI's request form gets TEI's answer: a plain list
    return_text = tei and rp.get_bool(body, "return_text", False)
    prompts = [await state.rerank_format.tokens(query, d, state.service.encode) for d in docs]
    scores = await _embed_all(engine, prompts)
    label = "score" if tei else "relevance_score"
    results = []
    for i, s in enumerate(scores):
        item: dict[str, Any] = {"index": i, label: float(s[0])}
        if return_text:
            item["text"] = docs[i]
        results.append(item)
    results.sort(key=lambda r: -r[label])
    results = results[:top_n]
    if tei:
        return JSONResponse(results)
    n_tokens = sum(len(p) for p in prompts)
    return JSONResponse({"model": body.get("model", state.model_alias), "object": "list",
                         "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}, "results": results})
