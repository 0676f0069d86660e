"""The HTTP application in-process: gates (loading, API key, CORS), field policy, prompt forms and
/metrics text, driven through ASGI without a socket."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest
from asgi_helpers import asgi
from toy_backend import RepeatDrafter, ToyBackend, ToyTokenizer, make_engine, run_requests

from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.frontends.http.app import build_app
from spekula.frontends.http.errors import HttpError
from spekula.frontends.http.fields import normalise
from spekula.frontends.http.generation import GenerationService
from spekula.frontends.http.metrics import render
from spekula.frontends.http.prompts import prompt_tokens, split_batch
from spekula.frontends.http.state import HttpState
from spekula.frontends.schema import completion as rp


@pytest.mark.anyio
async def test_loading_gives_503_everywhere_and_keys_gate_everything_but_health() -> None:
    state = HttpState(api_keys=("k1", "k2"))
    app = build_app(state)
    status, _, body = await asgi(app, "GET", "/health")
    assert status == 503 and json.loads(body) == {"error": {"code": 503, "message": "Loading model",
                                                            "type": "unavailable_error"}}
    status, _, body = await asgi(app, "POST", "/completion", b'{"prompt": "x"}')
    assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
    status, _, _ = await asgi(app, "POST", "/completion", b"{}", {"Authorization": "Bearer k2"})
    assert status == 503  # past the key, the server is still loading
    status, _, _ = await asgi(app, "GET", "/props", headers={"X-Api-Key": "k1"})
    assert status == 503
    # CORS preflight needs no key; any origin is reflected with credentials by default
    status, headers, _ = await asgi(app, "OPTIONS", "/completion", headers={"Origin": "http://example.org"})
    assert status == 200 and headers["access-control-allow-origin"] == "http://example.org"
    assert headers["access-control-allow-credentials"] == "true"


@pytest.mark.anyio
async def test_cors_localhost_only() -> None:
    app = build_app(HttpState(cors_origins="localhost"))
    _, headers, _ = await asgi(app, "OPTIONS", "/health", headers={"Origin": "http://localhost:5173"})
    assert headers["access-control-allow-origin"] == "http://localhost:5173"
    _, headers, _ = await asgi(app, "OPTIONS", "/health", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in headers


def test_field_policy() -> None:
    params, opts = normalise({"prompt": "x", "max_tokens": 5, "typical_p": 1.0, "tfs_z": 1, "model": "m",
                              "stream_options": {"include_usage": True}, "n": 2, "seed": None}, allowed=rp.COMPLETION_FIELDS,
                             n_slots=2)
    assert params == {"prompt": "x", "n_predict": 5, "typical_p": 1.0} and opts.include_usage and opts.n == 2
    for body, word in (({"tfs_z": 0.9}, "tfs_z"), ({"n_indent": 2}, "n_indent"),
                       ({"n": 3}, "'n'"), ({"lora": [{"id": 0, "scale": 1}]}, "lora"),
                       ({"logprobs": True}, "logprobs"), ({"what": 1}, "unknown field 'what'"),
                       ({"stream_options": {"x": 1}}, "stream_options")):
        with pytest.raises(HttpError, match=word):
            normalise({"prompt": "x", **body}, allowed=rp.COMPLETION_FIELDS, n_slots=2)


@pytest.mark.anyio
async def test_prompt_forms() -> None:
    async def encode(text: str, add_special: bool = True) -> list[int]:
        return ([1] if add_special else []) + [ord(c) for c in text]

    assert await prompt_tokens("ab", encode, 300) == ([1, 97, 98], "ab")
    assert await prompt_tokens({"prompt_string": "ab"}, encode, 300) == ([1, 97, 98], "ab")
    assert await prompt_tokens([5, 6, "a", 7], encode, 300) == ([5, 6, 97, 7], None)
    assert await prompt_tokens(["a", 7], encode, 300) == ([1, 97, 7], None)
    for bad in ([], [5, 999], [True], {"prompt_string": "a", "multimodal_data": "x"}, 3.5):
        with pytest.raises(HttpError):
            await prompt_tokens(bad, encode, 300)
    assert split_batch([[1, 2], "x"]) == [[1, 2], "x"]
    assert split_batch(["x", "y"]) == ["x", "y"]
    assert split_batch([1, 2, "x"]) == [[1, 2, "x"]]
    assert split_batch("x") == ["x"]


@pytest.mark.anyio
async def test_metrics_text_parses_and_counts_what_timings_report() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    engine = make_engine(ToyBackend(), ToyTokenizer(), spec=SpecParams(types=("test-repeat",)),
                         drafters=[RepeatDrafter()])
    greedy = SamplingParams(temperature=0.0)
    finals = await run_requests(engine, [CompletionRequest([3, 9, 4, 17, 5, 8, 2, 11], n_predict=20, sampling=greedy)])
    finals += await run_requests(engine, [CompletionRequest([3, 9, 4, 17, 5, 8, 2, 12], n_predict=8, sampling=greedy)])
    values: dict[str, float] = {}
    kinds: dict[str, str] = {}
    for fam in text_string_to_metric_families(render(engine).decode()):
        kinds[fam.name] = fam.type
        for sample in fam.samples:
            key = sample.name + ("" if not sample.labels else json.dumps(sample.labels, sort_keys=True))
            values[key] = sample.value
    assert values["llamacpp:prompt_tokens_total"] == sum(f.timings["prompt_n"] for f in finals)
    assert values["llamacpp:prompt_tokens_cached_total"] == sum(f.timings["cache_n"] for f in finals) > 0
    assert values["llamacpp:tokens_predicted_total"] == sum(f.timings["predicted_n"] for f in finals)
    assert values["llamacpp:spec_decode_num_draft_tokens_total"] == sum(f.timings.get("draft_n", 0) for f in finals)
    assert values["llamacpp:spec_decode_num_accepted_tokens_total"] == sum(f.timings.get("draft_n_accepted", 0)
                                                                           for f in finals)
    assert values['llamacpp:spec_decode_drafter_num_draft_tokens_total{"drafter": "test-repeat"}'] == \
        values["llamacpp:spec_decode_num_draft_tokens_total"]
    assert values["llamacpp:requests_processing"] == 0 and values["llamacpp:n_decode_total"] > 0
    # llama-server types n_tokens_max a counter without the _total suffix; the parser adds one
    assert "\nllamacpp:n_tokens_max 28.0\n" in render(engine).decode()
    assert values["llamacpp:n_tokens_max_total"] == 8 + 20
    per_pos = [v for k, v in values.items() if k.startswith("llamacpp:spec_decode_num_accepted_tokens_per_pos_total")]
    assert sum(per_pos) == values["llamacpp:spec_decode_num_accepted_tokens_total"]


@pytest.mark.anyio
async def test_generation_through_the_app_matches_the_engine() -> None:
    engine = make_engine(ToyBackend(), ToyTokenizer(), n_slots=2)
    state = HttpState()
    app = build_app(state)
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        state.attach(engine, GenerationService(engine, rp.ServerDefaults(sampling=SamplingParams(temperature=0.0)), 5.0))
        body = json.dumps({"prompt": [3, 9, 4, 17], "n_predict": 6, "return_tokens": True}).encode()
        status, _, raw = await asgi(app, "POST", "/completion", body)
        assert status == 200
        one = json.loads(raw)
        batch = json.dumps({"prompt": [[3, 9, 4, 17], [3, 9, 4, 17]], "n_predict": 6, "return_tokens": True}).encode()
        status, _, raw = await asgi(app, "POST", "/completion", batch)
        both = json.loads(raw)
        assert status == 200 and [r["tokens"] for r in both] == [one["tokens"]] * 2 and [r["index"] for r in both] == [0, 1]
        fields = json.dumps({"prompt": [3, 9], "n_predict": 2, "response_fields": ["content", "generation_settings/n_predict"]})
        status, _, raw = await asgi(app, "POST", "/completion", fields.encode())
        assert status == 200 and set(json.loads(raw)) == {"content", "generation_settings/n_predict"}
        status, _, raw = await asgi(app, "POST", "/v1/chat/completions/input_tokens",
                                    b'{"messages": [{"role": "user", "content": "hi"}]}')
        assert status == 200 or status == 400  # the toy tokenizer may have no chat template
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_static_files_are_served_without_a_key_and_never_shadow_the_api(tmp_path: Any) -> None:
    (tmp_path / "index.html").write_text("<p>ui</p>")
    (tmp_path / "health").write_text("not the endpoint")
    app = build_app(HttpState(api_keys=("k",), static_dir=str(tmp_path)))
    status, _, body = await asgi(app, "GET", "/")
    assert status == 200 and body == b"<p>ui</p>"
    status, _, _ = await asgi(app, "GET", "/index.html")
    assert status == 200
    status, _, body = await asgi(app, "GET", "/health")
    assert status == 503 and b"Loading model" in body  # the route, not the file
    status, _, _ = await asgi(app, "GET", "/props")
    assert status == 401
    status, _, body = await asgi(app, "POST", "/no/such/route", headers={"Authorization": "Bearer k"})
    assert status == 404 and json.loads(body)["error"]["type"] == "not_found_error"
    status, _, _ = await asgi(app, "GET", "/../etc/passwd")
    assert status in (401, 404)
