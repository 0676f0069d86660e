"""The HTTP frontend as clients use it: a real `spekula serve --port` process on the tiny fixture,
driven with plain HTTP and with the official `openai` client."""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_helpers import run_cli
from http_helpers import HttpServer, start

from spekula.fixtures.tiny_gguf import tiny_model_path

SPEC = ("--spec-type", "ngram-simple,ngram-mod", "--spec-ngram-simple-size-n", "2", "--spec-ngram-simple-size-m", "4",
        "--spec-ngram-mod-n-match", "2", "--spec-ngram-mod-n-min", "1", "--spec-ngram-mod-n-max", "4")
MODEL = tiny_model_path("llama")
KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    log = tmp_path_factory.mktemp("http") / "server.log"
    srv = start(MODEL, "-np", "2", "-c", "256", "--temp", "0", "--metrics", *SPEC, log=log)
    try:
        yield srv
    finally:
        assert srv.stop() == 0, log.read_text()


def _generate(prompt: str, n: int, *extra: str) -> dict:  # type: ignore[type-arg]
    res = run_cli("generate", "-m", MODEL, "-p", prompt, "-n", str(n), "--temp", "0", "--json", *extra)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_endpoints_answer_in_llama_server_shapes(server: HttpServer) -> None:
    assert server.get("/health") == (200, {"status": "ok"})
    status, props = server.get("/props")
    assert status == 200 and props["total_slots"] == 2
    assert props["default_generation_settings"]["n_ctx"] == 256
    status, slots = server.get("/slots")
    assert status == 200 and [s["id"] for s in slots] == [0, 1] and "is_processing" in slots[0]
    status, models = server.get("/v1/models")
    assert status == 200 and models["object"] == "list" and models["data"][0]["id"].endswith(".gguf")
    status, tok = server.post("/tokenize", {"content": "hello world"})
    assert status == 200 and tok["tokens"] and all(isinstance(t, int) for t in tok["tokens"])
    status, pieces = server.post("/tokenize", {"content": "hello", "with_pieces": True})
    assert status == 200 and {"id", "piece"} <= set(pieces["tokens"][0])
    assert server.post("/detokenize", {"tokens": tok["tokens"]}) == (200, {"content": "hello world"})
    status, tmpl = server.post("/apply-template", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and "hi" in tmpl["prompt"]


@pytest.mark.parametrize("spec", [(), ("--spec-type", "none")])
def test_greedy_completion_equals_spekula_generate(server: HttpServer, spec: tuple[str, ...]) -> None:
    prompt = "the cat sat on the mat and the cat sat on the"
    want = _generate(prompt, 24, *(spec or SPEC))
    body = {"prompt": prompt, "n_predict": 24, "return_tokens": True}
    if spec:
        body["speculative.type"] = "none"
    status, got = server.post("/completion", body)
    assert status == 200, got
    assert got["content"] == want["content"] and got["tokens"] == want["tokens"]
    assert got["stop_type"] in ("limit", "eos") and got["timings"]["predicted_n"] == len(got["tokens"])


@pytest.mark.parametrize("speculative", ["none", "ngram-simple,ngram-mod"])
def test_logit_bias_bans_and_favours_tokens_in_every_form(server: HttpServer, speculative: str) -> None:
    """A banned token never comes out, with speculation or without (the drafters copy the prompt, which
    holds the banned tokens), and each of llama-server's forms (pairs, OpenAI's object, texts) says the same."""
    prompt = "the cat sat on the mat and the cat sat on the"
    base = {"prompt": prompt, "n_predict": 24, "return_tokens": True, "speculative.type": speculative}
    status, plain = server.post("/completion", base)
    assert status == 200, plain
    banned = sorted(set(plain["tokens"][:6]))
    answers = []
    for bias in ([[t, False] for t in banned], {str(t): False for t in banned}):
        status, got = server.post("/completion", {**base, "logit_bias": bias})
        assert status == 200, got
        assert not set(got["tokens"]) & set(banned) and got["tokens"] != plain["tokens"]
        assert got["generation_settings"]["logit_bias"] == [{"bias": None, "token": t} for t in banned]
        answers.append(got["tokens"])
    assert answers[0] == answers[1]
    _, text = server.post("/detokenize", {"tokens": [banned[0]]})
    _, favoured = server.post("/tokenize", {"content": text["content"]})
    status, got = server.post("/completion", {**base, "logit_bias": [[text["content"], 100]]})
    assert status == 200 and got["tokens"] and set(got["tokens"]) <= set(favoured["tokens"])


def test_stream_pieces_spell_the_completion(server: HttpServer) -> None:
    body = {"prompt": "one two three one two three one two", "n_predict": 20}
    status, whole = server.post("/completion", body)
    events = server.events("/completion", {**body, "stream": True})
    assert events[-1]["stop"] is True and "timings" in events[-1]
    assert "".join(e["content"] for e in events) == whole["content"]
    assert all(e["stop"] is False for e in events[:-1])
    assert {e["id_slot"] for e in events} == {events[-1]["id_slot"]} and events[-1]["id_slot"] >= 0


def test_openai_client_completes_and_streams(server: HttpServer) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    prompt = "a b c a b c a b"
    done = client.completions.create(model="any", prompt=prompt, max_tokens=16, temperature=0)
    assert done.choices[0].text == _generate(prompt, 16, *SPEC)["content"]
    assert done.usage is not None and done.usage.completion_tokens <= 16
    streamed = client.completions.create(model="any", prompt=prompt, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == done.choices[0].text
    messages = [{"role": "user", "content": "say something"}]
    chat = client.chat.completions.create(model="any", messages=messages, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(model="any", messages=messages, max_tokens=12, temperature=0,  # type: ignore[arg-type]
                                                  stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens  # type: ignore[union-attr]


def test_second_chat_turn_reuses_the_first(server: HttpServer) -> None:
    turn1 = [{"role": "user", "content": "tell me about cats and dogs"}]
    status, first = server.post("/v1/chat/completions", {"messages": turn1, "max_tokens": 16, "temperature": 0})
    assert status == 200
    turn2 = [*turn1, first["choices"][0]["message"], {"role": "user", "content": "and birds?"}]
    body = {"messages": turn2, "max_tokens": 16, "temperature": 0}
    status, second = server.post("/v1/chat/completions", body)
    assert status == 200
    n_prompt = second["usage"]["prompt_tokens"]
    assert second["timings"]["cache_n"] > 0
    assert second["timings"]["prompt_n"] == n_prompt - second["timings"]["cache_n"]
    status, cold = server.post("/v1/chat/completions", {**body, "cache_prompt": False})
    assert status == 200 and cold["timings"]["cache_n"] == 0
    assert cold["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]


SAMPLER_FIELDS = {"dry_multiplier": 0.8, "dry_base": 1.5, "dry_allowed_length": 2, "dry_penalty_last_n": 64,
                  "dry_sequence_breakers": ["\n", ":"], "xtc_probability": 0.5, "xtc_threshold": 0.1, "typical_p": 0.9,
                  "top_n_sigma": 2.0, "dynatemp_range": 0.3, "dynatemp_exponent": 1.5, "samplers": "edskypmxt"}


def test_sampler_fields_on_completion_and_chat(server: HttpServer) -> None:
    """Every sampler's fields are taken (and reported back); a seeded request repeats itself, with
    speculation on or off; Mirostat keeps its state across tokens."""
    body = {"prompt": "the cat sat on the mat and the cat sat on the", "n_predict": 16, "temperature": 0.9,
            "seed": 5, "return_tokens": True, **SAMPLER_FIELDS}
    status, first = server.post("/completion", body)
    assert status == 200, first
    settings = first["generation_settings"]
    assert {k: settings[k] for k in SAMPLER_FIELDS if k != "samplers"} == {
        k: v for k, v in SAMPLER_FIELDS.items() if k != "samplers"}
    assert settings["samplers"] == ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
                                    "temperature"]
    status, reordered = server.post("/completion", {**body, "samplers": ["temperature", "top-k", "dry"]})
    assert status == 200 and reordered["generation_settings"]["samplers"] == ["temperature", "top_k", "dry"]
    status, plain = server.post("/completion", {**body, "speculative.type": "none"})
    assert status == 200 and plain["tokens"] == first["tokens"]
    for mirostat in (1, 2):
        m = {**body, "mirostat": mirostat, "mirostat_tau": 3.0, "mirostat_eta": 0.2}
        (s1, a), (s2, b) = server.post("/completion", m), server.post("/completion", {**m, "speculative.type": "none"})
        assert s1 == s2 == 200 and a["tokens"] == b["tokens"] and a["generation_settings"]["mirostat"] == mirostat
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "seed": 3, "temperature": 0.8,
            **SAMPLER_FIELDS, "samplers": ["top_k", "dry", "temperature"], "mirostat": 0}
    status, reply = server.post("/v1/chat/completions", chat)
    assert status == 200 and reply["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize(("body", "field"), [
    ({"prompt": "x", "n_predict": "many"}, "n_predict"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 7}, "top_p"),
    ({"prompt": "x", "temprature": 1}, "temprature"),
    ({"prompt": 17}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "typical_p": 1.5}, "typical_p"),
    ({"prompt": "x", "mirostat": 3}, "mirostat"),
    ({"prompt": "x", "mirostat_tau": -1}, "mirostat_tau"),
    ({"prompt": "x", "xtc_probability": 2}, "xtc_probability"),
    ({"prompt": "x", "xtc_threshold": -0.5}, "xtc_threshold"),
    ({"prompt": "x", "dry_base": 0.5}, "dry_base"),
    ({"prompt": "x", "dry_multiplier": "lots"}, "dry_multiplier"),
    ({"prompt": "x", "dry_allowed_length": -1}, "dry_allowed_length"),
    ({"prompt": "x", "dry_penalty_last_n": -1}, "dry_penalty_last_n"),
    ({"prompt": "x", "dry_sequence_breakers": []}, "dry_sequence_breakers"),
    ({"prompt": "x", "dry_sequence_breakers": ["\n", 3]}, "dry_sequence_breakers"),
    ({"prompt": "x", "dynatemp_range": -1}, "dynatemp_range"),
    ({"prompt": "x", "top_n_sigma": "wide"}, "top_n_sigma"),
    ({"prompt": "x", "samplers": "kz"}, "samplers"),
    ({"prompt": "x", "samplers": ["top_k", "infill"]}, "samplers"),
    ({"prompt": "x", "samplers": 3}, "samplers"),
    ({"prompt": "x", "speculative.type": "no-such-drafter"}, "speculative.type"),
    ({"prompt": "x", "id_slot": 9}, "id_slot"),
    ({"prompt": "x", "logit_bias": [[1]]}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": "lots"}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": [[99999, 1.0]]}, "logit_bias"),
    ({"prompt": "x", "logit_bias": 3}, "logit_bias"),
    ({"prompt": "x", "min_keep": -1}, "min_keep"),
    ({"prompt": "x", "min_keep": 0.5}, "min_keep"),
])
def test_bad_fields_are_400_naming_the_field(server: HttpServer, body: dict, field: str) -> None:  # type: ignore[type-arg]
    status, err = server.post("/completion", body)
    assert status == 400, err
    assert err["error"]["type"] == "invalid_request_error" and field in err["error"]["message"]


def test_malformed_and_hostile_bodies(server: HttpServer) -> None:
    for raw in (b"{bad", b"[1,2", b"\xff\xfe", b'{"prompt": NaN}', b"[" * 100_000):
        status, _, err = server.call("POST", "/completion", raw=raw)
        assert status == 400 and err["error"]["code"] == 400, (raw[:20], err)
    status, _, err = server.call("POST", "/v1/chat/completions", raw=b'{"messages": "hi"}')
    assert status == 400 and "messages" in err["error"]["message"]
    status, _, err = server.call("GET", "/no/such/endpoint")
    assert status == 404 and err["error"]["type"] == "not_found_error"
    status, _, err = server.call("POST", "/completion", {"prompt": "x " * 5000})
    assert status == 400 and err["error"]["type"] == "exceed_context_size_error"


def test_oversized_body_is_413_and_the_server_keeps_serving(server: HttpServer) -> None:
    big = b'{"prompt": "' + b"a" * (100 * 1024 * 1024) + b'"}'
    try:
        status, _, err = server.call("POST", "/completion", raw=big)
        assert status == 413 and err["error"]["code"] == 413
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered 413 and closed while the client was still sending
    # chunked, with no Content-Length to refuse up front
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.putrequest("POST", "/completion")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        chunk = b"a" * (1024 * 1024)
        try:
            for _ in range(40):
                conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            conn.send(b"0\r\n\r\n")
            assert conn.getresponse().status == 413
        except (BrokenPipeError, ConnectionResetError):
            pass
    finally:
        conn.close()
    assert server.get("/health") == (200, {"status": "ok"})


def _busy_slots(server: HttpServer) -> int:
    return sum(s["is_processing"] for s in server.get("/slots")[1])


def test_client_closing_mid_stream_frees_its_slot_at_once(server: HttpServer) -> None:
    body = json.dumps({"prompt": "go on forever", "n_predict": 200, "ignore_eos": True, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    seen = b""
    while b"data: " not in seen:
        seen += sock.recv(4096)
    assert _busy_slots(server) == 1
    sock.close()
    deadline = time.monotonic() + 5
    while _busy_slots(server) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _busy_slots(server) == 0
    # non-streaming: a client gone before the answer also frees the slot
    body = json.dumps({"prompt": "go on forever", "n_predict": 200, "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    time.sleep(0.3)
    sock.close()
    deadline = time.monotonic() + 5
    while _busy_slots(server) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _busy_slots(server) == 0


def test_fifty_keep_alive_connections(server: HttpServer) -> None:
    results: list[int] = []

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        try:
            for _ in range(2):  # two requests on the same connection
                conn.request("POST", "/completion", body=json.dumps({"prompt": "hi", "n_predict": 2}),
                             headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                results.append(resp.status)
        finally:
            conn.close()

    threads = [threading.Thread(target=client) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert results == [200] * 100


def test_metrics_in_prometheus_text(server: HttpServer) -> None:
    server.post("/completion", {"prompt": "a b a b a b a b", "n_predict": 12})
    status, _, text = server.call("GET", "/metrics")
    assert status == 200
    from prometheus_client.parser import text_string_to_metric_families

    names = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    for name in ("prompt_tokens_total", "tokens_predicted_total", "requests_processing", "prompt_tokens_cached_total",
                 "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "spec_decode_drafter_num_draft_tokens_total"):
        assert f"llamacpp:{name}" in names, name
    assert 'spec_decode_drafter_num_drafts_total{drafter="ngram-simple"}' in text


def test_api_key_and_socket_in_one_process(tmp_path: Path) -> None:
    sock_path = str(tmp_path / "s.sock")
    key_file = tmp_path / "keys"
    key_file.write_text("other-key\n")
    srv = start(MODEL, "-c", "128", "--api-key", KEY, "--api-key-file", str(key_file), "--socket", sock_path,
                log=tmp_path / "log")
    try:
        assert srv.get("/health")[0] == 200  # public
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY + "x"}):
            status, err = srv.get("/props", headers=headers)
            assert status == 401 and err["error"] == {"code": 401, "message": "Invalid API Key",
                                                      "type": "authentication_error"}
            assert srv.post("/completion", {"prompt": "x"}, headers=headers)[0] == 401
        for key in (KEY, "other-key"):
            status, _ = srv.post("/completion", {"prompt": "x", "n_predict": 2},
                                 headers={"Authorization": f"Bearer {key}"})
            assert status == 200
        # metrics were not enabled
        status, err = srv.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})
        assert status == 501 and err["error"]["type"] == "not_supported_error"
        from spekula.frontends.rpc.client import SpekulaClient

        with SpekulaClient(sock_path, timeout=30) as c:
            assert c.health()["status"] == "ok"
            assert c.completion("x", n_predict=2)["tokens_predicted"] >= 1
            assert c.completion("x", n_predict=6, grammar='root ::= "ab"')["content"] == "ab"
    finally:
        assert srv.stop() == 0


@pytest.mark.slow
def test_smollm2_openai_client_equals_spekula_generate(tmp_path: Path) -> None:
    from model_drafter_helpers import smollm2_or_skip
    from openai import OpenAI

    model = str(smollm2_or_skip())
    spec = ("--spec-type", "ngram-simple,ngram-mod")
    srv = start(model, "-c", "1024", "-t", "2", "--temp", "0", *spec, log=tmp_path / "log")
    try:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        question = "List the planets of the solar system in order, one per line."
        for types in (None, "none"):
            extra = {} if types is None else {"speculative.type": types}
            want = run_cli("generate", "-m", model, "-c", "1024", "-t", "2", "--chat", "-p", question, "-n", "48",
                           "--temp", "0", "--json", *(spec if types is None else ("--spec-type", "none")))
            assert want.returncode == 0, want.stderr
            expected = json.loads(want.stdout)["content"]
            chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],  # type: ignore[arg-type]
                                                  max_tokens=48, temperature=0, extra_body=extra)
            assert chat.choices[0].message.content == expected
            stream = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],  # type: ignore[arg-type]
                                                    max_tokens=48, temperature=0, stream=True, extra_body=extra)
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
        prompt = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
        want = run_cli("generate", "-m", model, "-c", "1024", "-t", "2", "-p", prompt, "-n", "24", "--temp", "0",
                       "--json", *spec)
        done = client.completions.create(model="smollm2", prompt=prompt, max_tokens=24, temperature=0)
        assert done.choices[0].text == json.loads(want.stdout)["content"]
    finally:
        assert srv.stop() == 0


def test_grammars_and_schemas_over_http(server: HttpServer) -> None:
    import re

    status, got = server.post("/completion", {"prompt": "x", "n_predict": 8, "grammar": 'root ::= "ab" "c"+'})
    assert status == 200 and re.fullmatch(r"abc+", got["content"]), got
    body = {"messages": [{"role": "user", "content": "yes?"}], "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"enum": ["yes", "no"]}}}}
    status, chat = server.post("/v1/chat/completions", body)
    assert status == 200 and json.loads(chat["choices"][0]["message"]["content"]) in ("yes", "no")
    streamed = server.events("/v1/chat/completions", {**body, "stream": True})
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in streamed[:-1] if e["choices"])
    assert text == chat["choices"][0]["message"]["content"]
    for bad, field, word in (({"grammar": "root ::= foo"}, "grammar", "foo"),
                             ({"json_schema": {"type": "array", "uniqueItems": True}}, "json_schema", "uniqueItems"),
                             ({"grammar": 'root ::= "a"', "json_schema": {"type": "object"}}, "json_schema", "one of"),
                             ({"response_format": {"type": "sound"}}, "response_format", "sound")):
        status, err = server.post("/completion", {"prompt": "x", **bad})
        assert status == 400 and field in err["error"]["message"] and word in err["error"]["message"], err


def test_token_probabilities_are_the_targets_with_or_without_speculation(server: HttpServer) -> None:
    prompt = "the cat sat on the mat and the cat sat on the"
    base = {"prompt": prompt, "n_predict": 16, "n_probs": 5, "return_tokens": True}
    answers = {}
    for speculative in ("none", "ngram-simple,ngram-mod"):
        status, got = server.post("/completion", {**base, "speculative.type": speculative})
        assert status == 200, got
        probs = got["completion_probabilities"]
        assert [p["id"] for p in probs] == got["tokens"]
        for p in probs:
            assert p["logprob"] <= 0 and len(p["top_logprobs"]) == 5 and isinstance(p["bytes"], list)
            values = [t["logprob"] for t in p["top_logprobs"]]
            assert values == sorted(values, reverse=True)
            assert p["top_logprobs"][0]["id"] == p["id"]  # greedy: the most likely token is the one emitted
        answers[speculative] = probs
    # The tiny model's answers rarely repeat, so this is mostly the plain path; tests/test_token_probs.py
    # shows drafted tokens get the target's numbers.
    assert answers["none"] == answers["ngram-simple,ngram-mod"]
    events = server.events("/completion", {**base, "stream": True})
    assert [p for e in events[:-1] for p in e["completion_probabilities"]] == answers["none"]
    assert "completion_probabilities" not in events[-1]
    status, post = server.post("/completion", {**base, "post_sampling_probs": True, "temperature": 1.0, "seed": 3})
    assert status == 200, post
    for p in post["completion_probabilities"]:
        assert 0 < p["prob"] <= 1 and 0 < sum(t["prob"] for t in p["top_probs"]) <= 1 + 1e-9
    status, plain = server.post("/completion", {"prompt": prompt, "n_predict": 4})
    assert "completion_probabilities" not in plain


def test_a_stop_word_takes_its_tokens_probabilities_with_it(server: HttpServer) -> None:
    """As llama-server: a non-streamed answer ended by a stop word lists no probabilities for the
    last tokens, as many as the stop word has on its own (the content ends before it)."""
    base = {"prompt": "the cat sat on the mat and the dog", "n_predict": 24, "n_probs": 2, "return_tokens": True}
    status, full = server.post("/completion", base)
    assert status == 200, full
    # The tiny model writes bytes more than words: stop at a run of letters from the answer's second half.
    runs = [m.group() for m in re.finditer("[A-Za-z]{2,}", full["content"]) if m.start() >= 4]
    assert runs, full["content"]
    stop = runs[len(runs) // 2]
    status, got = server.post("/completion", {**base, "stop": [stop]})
    assert status == 200 and got["stop_type"] == "word" and got["stopping_word"] == stop, got
    _, tokenized = server.post("/tokenize", {"content": stop, "parse_special": False})
    kept = len(got["tokens"]) - len(tokenized["tokens"])
    assert got["completion_probabilities"] == full["completion_probabilities"][: max(kept, 0)]
    status, oai = server.post("/v1/completions", {"prompt": base["prompt"], "max_tokens": 24, "temperature": 0,
                                                  "logprobs": 2, "stop": [stop]})
    assert status == 200 and oai["choices"][0]["finish_reason"] == "stop", oai
    assert len(oai["choices"][0]["logprobs"]["tokens"]) == max(kept, 0)
    events = server.events("/completion", {**base, "stop": [stop], "stream": True})
    assert len([p for e in events[:-1] for p in e.get("completion_probabilities", [])]) == len(got["tokens"])


def test_openai_logprobs(server: HttpServer) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "say something"}]
    chat = client.chat.completions.create(model="any", messages=messages, max_tokens=12, temperature=0,  # type: ignore[arg-type]
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 3 for t in content)
    chunks = list(client.chat.completions.create(model="any", messages=messages, max_tokens=12, temperature=0,  # type: ignore[arg-type]
                                                  logprobs=True, top_logprobs=3, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content or []]
    assert [t.token for t in streamed] == [t.token for t in content]
    none = client.chat.completions.create(model="any", messages=messages, max_tokens=4, temperature=0)  # type: ignore[arg-type]
    assert none.choices[0].logprobs is None
    done = client.completions.create(model="any", prompt="a b c a b c a b", max_tokens=10, temperature=0, logprobs=2)
    lp = done.choices[0].logprobs
    assert lp is not None and "".join(lp.tokens or []) == done.choices[0].text
    assert all(len(t) <= 2 for t in lp.top_logprobs or []) and lp.text_offset and lp.text_offset[0] == 0


@pytest.mark.parametrize("path,body,field", [
    ("/completion", {"prompt": "x", "n_probs": -1}, "n_probs"),
    ("/completion", {"prompt": "x", "n_probs": 101}, "n_probs"),
    ("/completion", {"prompt": "x", "n_probs": "5"}, "n_probs"),
    ("/completion", {"prompt": "x", "post_sampling_probs": 1}, "post_sampling_probs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 2}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": 1000}, "logprobs"),
])
def test_bad_probability_fields_are_400(server: HttpServer, path: str, body: dict, field: str) -> None:  # type: ignore[type-arg]
    status, err = server.post(path, body)
    assert status == 400, err
    assert field in err["error"]["message"]


def test_presence_and_frequency_penalties_equal_the_cli(server: HttpServer) -> None:
    prompt = "the cat sat on the mat and the cat sat on the"
    body = {"prompt": prompt, "n_predict": 24, "return_tokens": True, "repeat_last_n": 64}
    _, plain = server.post("/completion", body)
    for field, flag in (("frequency_penalty", "--frequency-penalty"), ("presence_penalty", "--presence-penalty")):
        status, got = server.post("/completion", {**body, field: 1.5})
        assert status == 200, got
        assert got["tokens"] == _generate(prompt, 24, *SPEC, flag, "1.5")["tokens"] != plain["tokens"]
        assert got["generation_settings"][field] == 1.5
    status, err = server.post("/completion", {**body, "presence_penalty": 1e9})
    assert status == 400 and "presence_penalty" in err["error"]["message"]


def test_assistant_prefill_and_continue_final_message(server: HttpServer) -> None:
    user = {"role": "user", "content": "What is the best book"}
    _, opened = server.post("/apply-template", {"messages": [user]})
    status, pre = server.post("/apply-template", {"messages": [user, {"role": "assistant", "content": "Whill"}]})
    assert status == 200 and pre["prompt"] == opened["prompt"] + "Whill"
    base = {"messages": [user, {"role": "assistant", "content": "Whill"}], "max_tokens": 4, "temperature": 0}
    for extra in ({}, {"continue_final_message": True, "add_generation_prompt": False}):
        status, got = server.post("/v1/chat/completions", {**base, **extra, "verbose": True})
        assert status == 200, got
        assert got["__verbose"]["prompt"] == pre["prompt"]
    status, err = server.post("/v1/chat/completions", {**base, "continue_final_message": True,
                                                       "add_generation_prompt": True})
    assert status == 400 and "continue_final_message" in err["error"]["message"]
    status, err = server.post("/v1/chat/completions", {**base, "messages": [user], "continue_final_message": True})
    assert status == 400 and "continue_final_message" in err["error"]["message"]
    status, closed = server.post("/v1/chat/completions", {**base, "messages": [user], "add_generation_prompt": False,
                                                          "verbose": True})
    assert status == 200 and opened["prompt"].startswith(closed["__verbose"]["prompt"])
    assert closed["__verbose"]["prompt"] != opened["prompt"]


def test_text_parts_are_joined_as_llama_server_joins_them(server: HttpServer) -> None:
    def parts(*texts: str) -> list[dict[str, str]]:
        return [{"type": "text", "text": t} for t in texts]

    _, whole = server.post("/apply-template", {"messages": [{"role": "user", "content": "Hi\nthere"},
                                                            {"role": "assistant", "content": "Wh\n\nill"}]})
    status, got = server.post("/apply-template", {"messages": [{"role": "user", "content": parts("Hi", "there")},
                                                               {"role": "assistant", "content": parts("Wh", "ill")}]})
    assert status == 200 and got["prompt"] == whole["prompt"]
    assert got["prompt"].endswith("Wh\n\nill")


def test_template_variables_and_no_prefill_over_http(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{{ greeting }}|{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                        "{% if add_generation_prompt %}[assistant]{% endif %}")
    srv = start(MODEL, "-np", "1", "-c", "128", "--chat-template-file", template, "--chat-template-kwargs",
                '{"greeting": "hey"}', "--no-prefill-assistant", log=tmp_path / "server.log")
    try:
        chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
        status, got = srv.post("/apply-template", {"messages": chat})
        assert status == 200 and got["prompt"] == "hey|[user]hi[assistant]Hel[assistant]"  # a closed turn
        status, got = srv.post("/apply-template", {"messages": chat, "chat_template_kwargs": {"greeting": "yo"},
                                                   "continue_final_message": "content", "add_generation_prompt": False})
        assert status == 200 and got["prompt"] == "yo|[user]hi[assistant]Hel"
        status, got = srv.post("/v1/chat/completions", {"messages": chat[:1], "max_tokens": 2, "temperature": 0,
                                                        "verbose": True, "chat_template_kwargs": {"greeting": "yo"}})
        assert status == 200 and got["__verbose"]["prompt"] == "yo|[user]hi[assistant]"
        for body, field in (({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                            ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
                            ({"continue_final_message": "reasoning_content"}, "continue_final_message"),
                            ({"continue_final_message": 1}, "continue_final_message")):
            status, err = srv.post("/v1/chat/completions", {"messages": chat, "max_tokens": 2, **body})
            assert status == 400 and field in err["error"]["message"], err
        assert srv.get("/health")[0] == 200
    finally:
        assert srv.stop() == 0, (tmp_path / "server.log").read_text()


def test_prompt_progress_and_timings_per_token(tmp_path: Path) -> None:
    srv = start(MODEL, "-np", "1", "-c", "256", "-b", "16", "--temp", "0", log=tmp_path / "server.log")
    try:
        prompt = "one two three four five six seven eight nine ten " * 4
        body = {"prompt": prompt, "n_predict": 6, "temperature": 0, "stream": True, "return_progress": True,
                "timings_per_token": True, "cache_prompt": False}
        events = srv.events("/completion", body)
        progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
        total = progress[0]["total"]
        assert total > 40 and progress[0]["processed"] == progress[0]["cache"] == 0
        assert [p["processed"] for p in progress] == [*range(0, total, 16), total]  # one per 16-token chunk
        assert all(p["total"] == total and p["cache"] == 0 for p in progress)
        first = next(e for e in events if "prompt_progress" in e)["timings"]
        assert first["prompt_n"] == 0 and first["prompt_ms"] == 0 and first["predicted_n"] == 0
        ms = [e["timings"]["prompt_ms"] for e in events if "prompt_progress" in e]
        assert ms == sorted(ms) and ms[-1] > 0
        pieces = [e for e in events if e.get("tokens")]
        assert pieces and all("timings" in e and "prompt_progress" not in e for e in pieces)
        status, plain = srv.post("/completion", {**body, "stream": False})
        assert status == 200 and "".join(e["content"] for e in events) == plain["content"]
        assert not [e for e in srv.events("/completion", {**body, "return_progress": False}) if "prompt_progress" in e]
        # The slot still holds the prompt: reused, it starts where the cache ends.
        reused = [e["prompt_progress"] for e in srv.events("/completion", {**body, "cache_prompt": True})
                  if "prompt_progress" in e]
        assert reused[0]["cache"] == reused[0]["processed"] > 0 and reused[0]["total"] == total
        assert reused[-1]["processed"] == total and len(reused) < len(progress)
        chat = srv.events("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], "max_tokens": 3,
                                                   "stream": True, "return_progress": True})
        marked = [c for c in chat if isinstance(c, dict) and "prompt_progress" in c]
        assert marked and all(c["choices"][0]["delta"] == {"role": "assistant", "content": None} for c in marked)
        assert marked[-1]["prompt_progress"]["processed"] == marked[-1]["prompt_progress"]["total"]
        for bad in ({"return_progress": 1}, {"timings_per_token": "yes"}, {"verbose": 1},
                    {"stream_options": {"include_usage": 1}}):
            status, err = srv.post("/v1/completions", {"prompt": "x", "max_tokens": 1, "stream": True, **bad})
            assert status == 400 and next(iter(bad)) in err["error"]["message"], err
    finally:
        assert srv.stop() == 0, (tmp_path / "server.log").read_text()


def test_min_keep_widens_the_sampled_candidates(server: HttpServer) -> None:
    body = {"prompt": "a b c", "n_predict": 8, "temperature": 1.5, "seed": 3, "top_k": 0, "top_p": 0.01,
            "min_p": 0.0, "n_probs": 5, "post_sampling_probs": True}
    _, narrow = server.post("/completion", body)
    status, wide = server.post("/completion", {**body, "min_keep": 3})
    assert status == 200 and wide["generation_settings"]["min_keep"] == 3
    assert all(len(t["top_probs"]) == 1 for t in narrow["completion_probabilities"])  # top-p 0.01 keeps one
    assert all(len(t["top_probs"]) == 3 for t in wide["completion_probabilities"])


def test_samplers_field_selects_the_chain(server: HttpServer) -> None:
    body = {"prompt": "a b c", "n_predict": 12, "temperature": 0.9, "seed": 11, "top_k": 3, "top_p": 0.5, "min_p": 0.2}
    _, full = server.post("/completion", body)
    _, ui_order = server.post("/completion", {**body, "samplers": "edskypmxt"})
    assert ui_order["content"] == full["content"]
    probs = {"n_probs": 3, "post_sampling_probs": True}
    _, only_k = server.post("/completion", {**body, **probs, "samplers": ["top_k", "temperature"]})
    _, same = server.post("/completion", {**body, **probs, "top_p": 1.0, "min_p": 0.0})
    assert only_k["content"] == same["content"]
    assert all(len(t["top_probs"]) == 3 for t in only_k["completion_probabilities"])  # top-k 3 alone cut them
    assert any(len(t["top_probs"]) < 3 for t in full_probs(server, body))  # top-p 0.5 / min-p 0.2 cut more
    status, reordered = server.post("/completion", {**body, "samplers": ["temperature", "top_k"]})
    assert status == 200 and reordered["generation_settings"]["samplers"] == ["temperature", "top_k"]
    status, err = server.post("/completion", {**body, "samplers": ["temperature", "infill"]})
    assert status == 400 and "samplers" in err["error"]["message"] and "infill" in err["error"]["message"]


def full_probs(server: HttpServer, body: dict) -> list[dict]:  # type: ignore[type-arg]
    _, res = server.post("/completion", {**body, "n_probs": 3, "post_sampling_probs": True})
    return res["completion_probabilities"]  # type: ignore[no-any-return]


def test_ignore_eos_bans_end_of_generation_tokens(server: HttpServer) -> None:
    body = {"prompt": "a b c", "n_predict": 24, "temperature": 1.0, "seed": 5, "return_tokens": True}
    _, banned = server.post("/completion", {**body, "ignore_eos": True})
    eog = {e["token"] for e in banned["generation_settings"]["logit_bias"] if e["bias"] is None}
    assert eog == {0, 2}  # the fixture's <|endoftext|> and <|im_end|>, as llama-server lists them
    assert len(banned["tokens"]) == 24 and not eog & set(banned["tokens"])
    _, plain = server.post("/completion", body)
    assert plain["generation_settings"]["logit_bias"] == []
