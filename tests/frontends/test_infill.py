"""Fill-in-the-middle prompts (core/modelfile/infill.py) and POST /infill on a tiny code-model fixture."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from http_helpers import HttpServer, start

from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.infill import ExtraFile, InfillError, check_model, infill_prompt
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.fixtures.tiny_gguf import tiny_model_path

FIM = {"fim_pre": 900, "fim_suf": 901, "fim_mid": 902, "fim_rep": 903, "fim_sep": 904}


def _chars(text: str) -> list[int]:  # one id per character: lengths and order are easy to read
    return [ord(c) for c in text]


def _layout(fim: dict[str, int] = FIM, **kw: object) -> list[int]:
    args: dict[str, object] = dict(prefix=_chars("abcdefgh"), suffix=_chars("STUVWXYZ"), extra=[], prompt=[],
                                   n_batch=64, n_predict=-1, n_ctx=256, bos=None)
    args.update(kw)
    return infill_prompt(fim, _chars, **args)  # type: ignore[arg-type]


def test_repository_layout() -> None:
    got = _layout(extra=[ExtraFile("a.py", "x=1")], prompt=[7], bos=1)
    want = [903, *_chars("myproject\n"), 904, *_chars("a.py\n"), *_chars("x=1"), 904, *_chars("filename\n"),
            1, 900, *_chars("abcdefgh"), 7, 901, *_chars("STUVWXYZ"), 902]
    assert got == want


def test_suffix_prefix_middle_and_no_separator_tokens() -> None:
    bare = {k: FIM[k] for k in ("fim_pre", "fim_suf", "fim_mid")}
    got = _layout(bare, extra=[ExtraFile("a.py", "x")], spm=True)
    assert got == [*_chars("\n\n--- snippet ---\n\n"), *_chars("x"), 901, *_chars("STUVWXYZ"),
                   900, *_chars("abcdefgh"), 902]


def test_long_inputs_are_cut_to_one_batch_and_the_context() -> None:
    got = _layout(prefix=_chars("p" * 50 + "END"), suffix=_chars("BEGIN" + "s" * 50), n_batch=24, prompt=[1])
    pre, suf = got.index(900), got.index(901)
    assert got[pre + 1:suf] == [*_chars("p" * 15 + "END"), 1]  # the last 3/4 of a batch of the prefix
    assert got[suf + 1:-1] == _chars("BEG")  # the first 24/4 - (2 + 1 prompt token) of the suffix
    files = [ExtraFile(f"f{i}", "t" * 30) for i in range(5)]
    got = _layout(extra=files, n_batch=16, n_ctx=80, n_predict=10)  # room for 80 - 16 - 20 = 44 extra tokens
    whole = _layout(extra=files, n_ctx=10**6)
    assert got.index(900) == 44 and got[:44] == whole[:whole.index(900)][-44:]  # the end of the extra files


def test_models_without_fim_tokens_are_told_which_are_missing() -> None:
    check_model(FIM)
    with pytest.raises(InfillError, match="suffix token is missing. middle token is missing."):
        check_model({"fim_pre": 1})


def test_fim_tokens_are_found_by_text_or_key() -> None:
    tok = Tokenizer.from_gguf(GGUFFile(tiny_model_path("qwen2", fim=True)))
    assert set(tok.fim) == {"fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep"}
    assert {tok.fim["fim_pad"], tok.fim["fim_rep"], tok.fim["fim_sep"]} <= tok.eog_ids
    assert tok.encode("<|fim_prefix|>", add_special=False) == [tok.fim["fim_pre"]]
    meta = dict(GGUFFile(tiny_model_path("llama")).metadata)
    assert Tokenizer(meta).fim == {}
    meta.update({"tokenizer.ggml.fim_pre_token_id": 5, "tokenizer.ggml.fim_suf_token_id": 6,
                 "tokenizer.ggml.fim_mid_token_id": 7})
    assert Tokenizer(meta).fim == {"fim_pre": 5, "fim_suf": 6, "fim_mid": 7}


@pytest.fixture(scope="module")
def coder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    log = tmp_path_factory.mktemp("infill") / "server.log"
    srv = start(tiny_model_path("qwen2", fim=True), "-np", "1", "-c", "512", "-b", "64", "--temp", "0",
                "--spec-type", "ngram-simple", log=log)
    try:
        yield srv
    finally:
        assert srv.stop() == 0, log.read_text()


def test_infill_answers_what_completion_gives_its_prompt(coder: HttpServer) -> None:
    tok = Tokenizer.from_gguf(GGUFFile(tiny_model_path("qwen2", fim=True)))
    body = {"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n\nprint(add(1, 2))\n",
            "input_extra": [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}],
            "prompt": "a", "n_predict": 8, "temperature": 0}
    status, got = coder.post("/infill", body)
    assert status == 200, got

    def plain(text: str) -> list[int]:
        return tok.encode(text, add_special=False, parse_special=False)

    prompt = infill_prompt(tok.fim, plain, prefix=plain(body["input_prefix"]), suffix=plain(body["input_suffix"]),
                           extra=[ExtraFile("util.py", body["input_extra"][0]["text"])], prompt=plain("a"),
                           n_batch=64, n_predict=-1, n_ctx=512, bos=None)
    status, same = coder.post("/completion", {"prompt": prompt, "n_predict": 8, "temperature": 0})
    assert status == 200 and got["content"] == same["content"] and got["tokens_evaluated"] == len(prompt)
    streamed = coder.events("/infill", {**body, "stream": True})
    assert "".join(e["content"] for e in streamed) == got["content"] and streamed[-1]["stop"] is True


@pytest.mark.parametrize(("body", "word"), [
    ({"input_suffix": ""}, '"input_prefix" is required'),
    ({"input_prefix": ""}, '"input_suffix" is required'),
    ({"input_prefix": 3, "input_suffix": ""}, "input_prefix"),
    ({"input_prefix": [1, 10**6], "input_suffix": ""}, "input_prefix"),
    ({"input_prefix": "", "input_suffix": "", "input_extra": {}}, "input_extra"),
    ({"input_prefix": "", "input_suffix": "", "input_extra": [{"filename": "a"}]}, "text"),
    ({"input_prefix": "", "input_suffix": "", "input_extra": [{"text": "", "filename": 1}]}, "filename"),
    ({"input_prefix": "", "input_suffix": "", "prompt": [1]}, "prompt"),
    ({"input_prefix": "", "input_suffix": "", "temprature": 1}, "temprature"),
])
def test_bad_infill_bodies_are_400(coder: HttpServer, body: dict, word: str) -> None:  # type: ignore[type-arg]
    status, err = coder.post("/infill", body)
    assert status == 400 and word in err["error"]["message"], err


def test_a_model_without_fim_tokens_answers_501(tmp_path: Path) -> None:
    srv = start(tiny_model_path("llama"), "-np", "1", "-c", "128", log=tmp_path / "server.log")
    try:
        status, err = srv.post("/infill", {"input_prefix": "a", "input_suffix": "b"})
        assert status == 501 and "prefix token is missing" in err["error"]["message"]
    finally:
        assert srv.stop() == 0
