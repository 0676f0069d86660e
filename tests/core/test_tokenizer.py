"""Tokenizer, streaming detokenizer and chat templates against transformers on the same GGUF files."""

from __future__ import annotations

import warnings
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from spekula.core.errors import ModelFileError, SpekulaError
from spekula.core.modelfile import tokenizer as tok_mod
from spekula.core.modelfile.chat_template import ChatTemplateError, render_chat
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import CONTROL, USER_DEFINED, Tokenizer
from spekula.fixtures.tiny_gguf import ARCHS, tiny_model_path, tokenizer_metadata, write_gguf

SAMPLES = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It's here; we'll see, DON'T panic!",
    "def fibonacci(n: int) -> list[int]:\n    if n < 2:\n        return [0, 1][:n]\n\treturn []\n",
    'for (int i = 0; i < 10; i++) { printf("%d\\n", i * i); }',
    "numbers 0 7 42 1234567890 3.14159 -2e10 1,000,000 2026-11-29",
    "whitespace   runs\t\ttabs\n\n\nnewlines  \r\n  and trailing   ",
    "   leading spaces",
    "Caf\u00e9 na\u00efve \u00fcber M\u00fcnchen r\u00e9sum\u00e9",
    "\u4f60\u597d\uff0c\u4e16\u754c\u3002\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3067\u3059\u3002",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u0393\u03b5\u03b9\u03ac \u03c3\u03bf\u03c5",
    "emoji \U0001f600\U0001f680 family \U0001f468\u200d\U0001f469\u200d\U0001f467 flag \U0001f1eb\U0001f1f7 \u2764\ufe0f",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<|im_end|>",
    "",
    " ",
    "a",
]


@cache
def _tokenizer(path: str) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(path))


@cache
def _hf_tokenizer(path: str) -> Any:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    p = Path(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)


def _smollm2_path() -> str:
    from spekula.backends.gguf.default_model import DefaultModelError, ensure_default_model

    try:
        return str(ensure_default_model(quiet=True))
    except DefaultModelError as exc:
        pytest.skip(f"default model unavailable: {exc}")


# ---- agreement with transformers -------------------------------------------------------------------


def _check_against_hf(path: str) -> None:
    tok, hf = _tokenizer(path), _hf_tokenizer(path)
    for text in SAMPLES:
        ids = tok.encode(text, add_special=False)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert tok.encode(text) == hf.encode(text), text  # add_special follows the file's add_bos/eos flags
        assert tok.decode(ids) == text


@pytest.mark.parametrize("arch", ARCHS)
def test_fixture_ids_match_transformers(arch: str) -> None:
    _check_against_hf(str(tiny_model_path(arch)))


@pytest.mark.slow
def test_smollm2_ids_match_transformers() -> None:
    _check_against_hf(_smollm2_path())


@pytest.mark.slow
def test_smollm2_specials_and_chat_template() -> None:
    path = _smollm2_path()
    tok, hf = _tokenizer(path), _hf_tokenizer(path)
    assert tok.n_vocab == 49152
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos) == (1, 2, False, False)
    # eos <|im_end|>, <|endoftext|> by text, <reponame> as the FIM repo token: what llama.cpp lists
    assert tok.eog_ids == frozenset({0, 2, 4})
    conversations = [
        [{"role": "user", "content": "Hi there"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Count to 3 \U0001f600"},
            {"role": "assistant", "content": "1, 2, 3"},
            {"role": "user", "content": "again"},
        ],
    ]
    for msgs in conversations:
        for gen in (True, False):
            expected = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == expected


@pytest.mark.parametrize("arch", ARCHS)
def test_fixture_chat_template_matches_transformers(arch: str) -> None:
    path = str(tiny_model_path(arch))
    msgs = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    expected = _hf_tokenizer(path).apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert _tokenizer(path).apply_chat_template(msgs) == expected
    assert expected.endswith("<|im_start|>assistant\n")


# ---- special tokens -------------------------------------------------------------------------------


def test_special_tokens_and_eog_on_fixture() -> None:
    tok = _tokenizer(str(tiny_model_path("qwen2")))
    im_start, im_end, eot = (
        tok.encode(s, add_special=False) for s in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    )
    assert (im_start, im_end, eot) == ([1], [2], [0])
    assert tok.eog_ids == frozenset({0, 2})
    assert tok.is_eog(2) and not tok.is_eog(1) and not tok.is_eog(100)
    plain = tok.encode("<|im_start|>", add_special=False, parse_special=False)
    assert len(plain) > 1 and 1 not in plain
    assert tok.decode(plain) == "<|im_start|>"
    ids = tok.encode("<|im_start|>hi<|im_end|>", add_special=False)
    assert tok.decode(ids, skip_special=True) == "hi"
    assert tok.token_text(2) == "<|im_end|>"


def _meta_with_types(types: dict[int, int]) -> dict[str, Any]:
    meta = tokenizer_metadata("qwen2")
    tt = list(meta["tokenizer.ggml.token_type"])
    for i, t in types.items():
        tt[i] = t
    return {**meta, "tokenizer.ggml.token_type": tt}


def test_user_defined_tokens_split_even_without_parse_special() -> None:
    meta = tokenizer_metadata("qwen2")
    tokens = list(meta["tokenizer.ggml.tokens"])
    tokens[-1] = "<think>"  # a hand-added token, as converters write them (raw text)
    types = list(meta["tokenizer.ggml.token_type"])
    types[-1] = USER_DEFINED
    tok = Tokenizer({**meta, "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types})
    for parse in (True, False):
        ids = tok.encode("a<think>b", add_special=False, parse_special=parse)
        assert tok.n_vocab - 1 in ids
        assert tok.decode(ids) == "a<think>b"
    # skip_special only drops control/unknown tokens; user-defined text stays
    assert tok.decode(tok.encode("<think>", add_special=False), skip_special=True) == "<think>"


def test_eog_found_by_text_and_forced_control() -> None:
    meta = tokenizer_metadata("qwen2")
    tokens = list(meta["tokenizer.ggml.tokens"])
    tokens[-1] = "<|eot_id|>"
    meta = {**meta, "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.eos_token_id": 1}
    tok = Tokenizer(meta)
    assert tok.eog_ids == frozenset({0, 1, 2, tok.n_vocab - 1})
    assert tok.token_type(tok.n_vocab - 1) == CONTROL


def test_llama_cpp_defaults_when_keys_absent() -> None:
    meta = tokenizer_metadata("qwen2")
    for key in ("bos_token_id", "eos_token_id", "add_bos_token", "padding_token_id", "unknown_token_id"):
        meta.pop(f"tokenizer.ggml.{key}")
    tok = Tokenizer(meta)
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos) == (11, 11, False, False)
    bpe3 = Tokenizer({**meta, "tokenizer.ggml.pre": "llama-bpe"})
    assert bpe3.add_bos and bpe3.encode("hi")[0] == 11


# ---- streaming ------------------------------------------------------------------------------------


def test_stream_decoder_holds_back_partial_characters() -> None:
    tok = _tokenizer(str(tiny_model_path("llama")))
    ids = tok.encode("\U0001f600x", add_special=False)
    assert len(ids) == 5  # four byte tokens for the emoji (no merges cover it), then "x"
    dec = tok.stream_decoder()
    outs = [dec.push(t) for t in ids]
    assert outs == ["", "", "", "\U0001f600", "x"]
    assert dec.flush() == ""
    dec = tok.stream_decoder()
    assert dec.push(ids[:2]) == "" and dec.pending
    assert dec.flush() == "\ufffd"  # a dangling partial character is not silently dropped


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_stream_decode_equals_whole_decode(data: st.DataObject) -> None:
    tok = _tokenizer(str(tiny_model_path("qwen2")))
    ids = data.draw(st.lists(st.integers(0, tok.n_vocab - 1), max_size=40), label="ids")
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=6), label="cuts"))
    skip = data.draw(st.booleans(), label="skip_special")
    dec = tok.stream_decoder(skip_special=skip)
    pieces, start = [], 0
    for cut in [*cuts, len(ids)]:
        pieces.append(dec.push(ids[start:cut]))
        start = cut
    pieces.append(dec.flush())
    assert "".join(pieces) == tok.decode(ids, skip_special=skip)


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=60))
def test_roundtrip_arbitrary_text(text: str) -> None:
    tok = _tokenizer(str(tiny_model_path("llama")))
    ids = tok.encode(text, add_special=False)
    assert tok.decode(ids) == text
    dec = tok.stream_decoder()
    assert "".join(dec.push(t) for t in ids) + dec.flush() == text


# ---- chat templates -------------------------------------------------------------------------------


def test_chatml_fallback_warns() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    with structlog.testing.capture_logs() as logs:
        out = render_chat(None, msgs)
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert any("ChatML" in entry["event"] for entry in logs)


def test_template_environment_features() -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}{% generation %}{{ m | tojson }}{% endgeneration %}"
        "{% if loop.index > 5 %}{% break %}{% endif %}{% endfor %}{{ strftime_now('%Y') | length }}"
    )
    out = render_chat(template, [{"role": "user", "content": "caf\u00e9"}], bos_token="<s>")
    assert out == '<s>{"role": "user", "content": "caf\u00e9"}4'


def test_template_errors_are_clear() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError, match="does not parse"):
        render_chat("{% for m in messages %}", msgs)
    with pytest.raises(ChatTemplateError, match="only user roles"):
        render_chat("{{ raise_exception('only user roles') }}", msgs)
    with pytest.raises(ChatTemplateError, match="failed to render"):
        render_chat("{{ messages.append(msgs) }}", msgs)  # the immutable sandbox refuses mutation
    with pytest.raises(ChatTemplateError, match="ZeroDivisionError"):
        render_chat("{{ 1 / 0 }}", msgs)
    with pytest.raises(ChatTemplateError):
        render_chat("{{ x }}", "not a list")  # type: ignore[arg-type]
    assert issubclass(ChatTemplateError, SpekulaError)


# ---- bad input ------------------------------------------------------------------------------------


def test_non_gguf_file(tmp_path: Path) -> None:
    p = tmp_path / "model.gguf"
    p.write_bytes(b"PK\x03\x04 definitely not a model")
    with pytest.raises(ModelFileError, match="not a GGUF"):
        Tokenizer.from_gguf(GGUFFile(p))


def test_gguf_without_tokenizer(tmp_path: Path) -> None:
    import numpy as np

    p = write_gguf(tmp_path / "bare.gguf", "llama", {"block_count": 1}, {"x": np.zeros(4, np.float32)}, {})
    with pytest.raises(ModelFileError, match="no tokenizer"):
        Tokenizer.from_gguf(GGUFFile(p))


def test_broken_tokenizer_metadata() -> None:
    meta = tokenizer_metadata("qwen2")
    with pytest.raises(ModelFileError, match="pre-tokenizer"):
        Tokenizer({**meta, "tokenizer.ggml.pre": "no-such-pre"})
    with pytest.raises(ModelFileError, match="merges"):
        Tokenizer({k: v for k, v in meta.items() if k != "tokenizer.ggml.merges"})
    with pytest.raises(ModelFileError, match="unsupported tokenizer model"):
        Tokenizer({**meta, "tokenizer.ggml.model": "rwkv"})
    with pytest.raises(ModelFileError, match="token_type"):
        Tokenizer({**meta, "tokenizer.ggml.token_type": [1, 1]})
    tok = Tokenizer(meta)
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.n_vocab])


# ---- SentencePiece-style vocabularies ---------------------------------------------------------------


@pytest.fixture(scope="module")
def spm_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    import numpy as np

    from spekula.fixtures.tiny_spm import spm_tokenizer_metadata

    out = tmp_path_factory.mktemp("spm") / "spm.gguf"
    write_gguf(out, "llama", {"block_count": 1}, {"x": np.zeros(32, np.float32)}, spm_tokenizer_metadata())
    return str(out)


def test_spm_matches_transformers(spm_path: str) -> None:
    tok, hf = _tokenizer(spm_path), _hf_tokenizer(spm_path)
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (1, 2, True)
    assert tok.eog_ids == frozenset({2})
    for text in SAMPLES:
        ids = tok.encode(text, add_special=False)
        assert tok.decode(ids) == text
        if text:  # after a BOS, llama.cpp keeps the prefix space
            assert tok.decode(tok.encode(text), skip_special=True) == " " + text
        if text[:1].isspace():
            continue  # see test_spm_space_prefix_follows_llama_cpp
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert tok.encode(text) == hf.encode(text), text


def test_spm_space_prefix_follows_llama_cpp(spm_path: str) -> None:
    """llama.cpp always prefixes one space (transformers skips it when the text starts with one), and
    prefixes again after every special token; decode() removes only the first."""
    tok = _tokenizer(spm_path)
    (sp,) = (i for i in range(tok.n_vocab) if tok.token_text(i) == "\u2581")
    assert tok.encode(" ", add_special=False) == [sp, sp]
    assert tok.decode([sp, sp]) == " "
    ids = tok.encode("</s>x", add_special=False)
    assert ids[0] == 2 and tok.token_text(ids[1]).startswith("\u2581")
    assert tok.decode(ids) == "</s> x"
    # characters outside the pieces fall back to <0xNN> byte tokens and stream back intact
    ids = tok.encode("\u00e9\U0001f600", add_special=False)
    assert [tok.token_text(i) for i in ids[-4:]] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    dec = tok.stream_decoder()
    assert "".join(dec.push(i) for i in ids) + dec.flush() == " \u00e9\U0001f600"


def test_eog_exceptions_follow_llama_cpp() -> None:
    meta = tokenizer_metadata("qwen2", 330)
    tokens = list(meta["tokenizer.ggml.tokens"])
    tokens[-5:] = ["<|end|>", "<|call|>", "<|return|>", "</s>", "<|tool_response>"]
    tok = Tokenizer({**meta, "tokenizer.ggml.tokens": tokens})
    end, call, ret, s_end, tool = range(tok.n_vocab - 5, tok.n_vocab)
    assert {call, ret, tool} <= tok.eog_ids
    assert end not in tok.eog_ids and tok.token_type(end) == USER_DEFINED  # harmony: ends a message only
    assert s_end not in tok.eog_ids  # gemma4: "</s>" is ordinary text
    assert tok.encode("a</s>", add_special=False)[-1] != s_end


def test_smollm_isolates_digits_before_whitespace_rules() -> None:
    """llama.cpp's smollm pre-tokenizer splits every digit off first, so "  12" is "  ", "1", "2".

    transformers' GGUF loader has no smollm entry and uses GPT-2's regex (" 12" stays together), so on
    runs of spaces before digits it disagrees with llama.cpp; we follow llama.cpp (and SmolLM2's own
    tokenizer.json, whose pre-tokenizer is Digits(individual) + ByteLevel).
    """
    tok = _tokenizer(str(tiny_model_path("llama")))
    ids = tok.encode("a  12", add_special=False)
    assert [tok.token_text(i) for i in ids] == ["a", "\u0120\u0120", "1", "2"]


_BYTE_ALPHABET = sorted(tok_mod._BYTE_OF_CHAR)


@settings(max_examples=300, deadline=None)
@given(st.text(st.one_of(st.sampled_from(_BYTE_ALPHABET), st.characters(max_codepoint=0x2FF),
                         st.characters(blacklist_categories=("Cs",))),
               max_size=12))
def test_byte_level_pieces_decode_character_by_character(text: str) -> None:
    """A byte-level piece is the byte of each alphabet character and the UTF-8 of any other character,
    whichever path (one translate, or character by character) computes it."""
    want = b"".join(bytes([tok_mod._BYTE_OF_CHAR[c]]) if c in tok_mod._BYTE_OF_CHAR else c.encode("utf-8")
                    for c in text)
    tok = object.__new__(tok_mod.Tokenizer)
    tok._tokens, tok._types, tok.model_kind = [text], [tok_mod.NORMAL], "gpt2"
    assert tok._piece(0) == want
