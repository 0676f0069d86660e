"""Grammars through llguidance: compiled once per (model, grammar), one matcher per request.

llguidance was chosen by measurement on SmolLM2's 49152-token vocabulary (docs/notes/negative-results.md):
its worst mask took 0.4 ms on every grammar tried (the other candidate took 20-56 ms per token on
llama.cpp's own JSON GBNF), JSON schemas compile in about a millisecond, unsupported schema
keywords are named in its errors, and it checks a whole draft without computing masks.

Two of its rules shape this module: a matcher that consumes a forbidden token is broken for good,
so only tokens already known to be allowed are consumed; and end-of-generation tokens are never
fed to it (once it has stopped it would take one without recording it).
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from spekula.core.modelfile.constraint import ConstraintError, GrammarSpec

_CACHE_SIZE = 64
# llguidance's GBNF reader turns \u00e9 into \ue9, which its own Lark parser refuses; the characters
# themselves (or \x escapes for the ASCII ones GBNF gives a meaning) are read correctly.
_UNICODE_ESCAPE = re.compile(r"\\(?:u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8}))|\\\\|\\.", re.S)


def _unicode_escapes_to_literals(gbnf: str) -> str:
    def sub(m: re.Match[str]) -> str:
        hexs = m.group(1) or m.group(2)
        if hexs is None:
            return m.group(0)
        cp = int(hexs, 16)
        if cp < 0x20 or cp == 0x7F or (cp < 0x80 and chr(cp) in '"\\[]-^'):
            return f"\\x{cp:02X}"
        return chr(cp)

    return _UNICODE_ESCAPE.sub(sub, gbnf)


class _Vocab:
    """What llguidance's TokenizerWrapper reads: every token's bytes, special ones marked."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.eos_token_id = getattr(tok, "eos_id", None)
        self.bos_token_id = getattr(tok, "bos_id", None)
        special = [i for i in range(tok.n_vocab) if self._special(tok, i)]
        marked = set(special)
        self.special_token_ids = special
        # 0xFF in front keeps a special token's text from ever matching grammar literals.
        self.tokens = [(b"\xff" if i in marked else b"") + self._bytes(tok, i) for i in range(tok.n_vocab)]

    @staticmethod
    def _bytes(tok: Any, i: int) -> bytes:
        if hasattr(tok, "token_bytes"):
            return bytes(tok.token_bytes(i))
        return str(tok.token_text(i)).encode()

    @staticmethod
    def _special(tok: Any, i: int) -> bool:
        if tok.is_eog(i):
            return True
        if not hasattr(tok, "token_type"):
            return False
        from spekula.core.modelfile.tokenizer import CONTROL, UNKNOWN, USER_DEFINED

        kind = tok.token_type(i)
        b = tok.token_bytes(i)
        return kind in (CONTROL, UNKNOWN) or (kind == USER_DEFINED and b.startswith(b"<") and b.endswith(b">"))

    def __call__(self, s: bytes) -> list[int]:
        return list(self._tok.encode(s.decode("utf-8", errors="replace"), add_special=False, parse_special=False))


class Grammars:
    """The grammar compiler of one model: templates cached by grammar, a matcher per request."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.n_vocab = int(tokenizer.n_vocab)
        self._ll_tok: Any = None
        self._executor: Any = None  # llguidance's mask thread pool, one for all requests of the model
        self._templates: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._lock = threading.Lock()  # compiled from frontends' threads and the engine's loop

    def _tokenizer(self) -> Any:
        import llguidance as llg

        if self._ll_tok is None:
            eog = sorted(i for i in range(self.n_vocab) if self.tokenizer.is_eog(i))
            self._ll_tok = llg.LLTokenizer(llg.TokenizerWrapper(_Vocab(self.tokenizer)), eos_token=eog or None)
        return self._ll_tok

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar (cached); raises ConstraintError saying what is wrong with it."""
        import llguidance as llg

        with self._lock:
            template = self._templates.get(spec)
            if template is not None:
                self._templates.move_to_end(spec)
                return template
            ll_tok = self._tokenizer()
            try:
                if spec.kind == "gbnf":
                    grammar = llg.grammar_from("gbnf", _unicode_escapes_to_literals(spec.source))
                elif spec.kind == "json_schema":
                    grammar = llg.LLMatcher.grammar_from_json_schema(spec.source)
                elif spec.kind == "lark":
                    grammar = llg.LLMatcher.grammar_from_lark(spec.source)
                else:
                    grammar = llg.LLMatcher.grammar_from_regex(spec.source)
            except ValueError as exc:
                raise ConstraintError(str(exc)) from None
            template = llg.LLMatcher(ll_tok, grammar, log_level=0, limits=llg.LLParserLimits(verbose_errors=False))
            if template.is_error():
                raise ConstraintError(template.get_error())
            self._templates[spec] = template
            while len(self._templates) > _CACHE_SIZE:
                self._templates.popitem(last=False)
            return template

    def new(self, spec: GrammarSpec) -> LLGuidanceConstraint:
        import llguidance as llg

        template = self.compile(spec)
        if self._executor is None:
            self._executor = llg.LLExecutor(num_threads=1)
        return LLGuidanceConstraint(template.deep_copy(), self.n_vocab, self.tokenizer.is_eog, self._executor)


def _forbidden(bitmask: np.ndarray, width: int) -> np.ndarray:
    """llguidance's token bitmask rows as booleans, True where a token is not allowed."""
    return np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :width] == 0


class LLGuidanceConstraint:
    """One request's grammar state (the `Constraint` of core/modelfile/constraint.py)."""

    def __init__(self, matcher: Any, n_vocab: int, is_eog: Any, executor: Any) -> None:
        import llguidance.numpy as llgnp

        self._m = matcher
        self._n_vocab = n_vocab
        self._is_eog = is_eog
        self._llgnp = llgnp
        self._executor = executor
        # (rows, seconds) of every mask_logits call: what the constraint costs (bench/structured.py)
        self.mask_calls: list[tuple[int, float]] = []

    def _body(self, tokens: Sequence[int]) -> list[int]:
        out = []
        for t in tokens:
            if self._is_eog(int(t)):
                break
            out.append(int(t))
        return out

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        body = self._body(tokens)
        n = int(self._m.validate_tokens(body)) if body else 0
        if n == len(body) and len(body) < len(tokens):
            # the draft continues with an end-of-generation token: allowed only where the grammar may end
            return n + 1 if self._m.is_accepting() else n
        return n

    def mask_logits(self, logits: np.ndarray, draft: Sequence[int]) -> None:
        t0 = time.perf_counter()
        rows = logits.shape[0]
        valid = self._body(draft)[: self.valid_prefix(draft)]
        valid = valid[: rows - 1]
        bitmask = self._llgnp.allocate_token_bitmask(len(valid) + 1, self._n_vocab)
        if valid:
            self._llgnp.fill_next_token_bitmask_par_with_draft_tokens(self._executor, [(self._m, 0, valid)], bitmask)
        else:
            self._llgnp.fill_next_token_bitmask(self._m, bitmask, 0)
        forbidden = _forbidden(bitmask, logits.shape[1])
        for r in range(rows):
            # copyto with a mask: a fancy-indexed assignment over a 49k-wide row cost ~8x more
            np.copyto(logits[r], -np.inf, where=forbidden[min(r, len(valid))])
        if len(self.mask_calls) < 100_000:
            self.mask_calls.append((rows, time.perf_counter() - t0))

    def mask_row(self, row: np.ndarray, prefix: Sequence[int]) -> None:
        t0 = time.perf_counter()
        body = self._body(prefix)
        bitmask = self._llgnp.allocate_token_bitmask(1, self._n_vocab)
        if body and not self._m.consume_tokens(body):
            raise ConstraintError(f"mask_row: the grammar does not allow the prefix: {self._m.get_error()}")
        try:
            self._llgnp.fill_next_token_bitmask(self._m, bitmask, 0)
        finally:
            if body:
                self._m.rollback(len(body))
        np.copyto(row, -np.inf, where=_forbidden(bitmask, row.shape[0])[0])
        if len(self.mask_calls) < 100_000:
            self.mask_calls.append((1, time.perf_counter() - t0))

    def advance(self, tokens: Sequence[int]) -> None:
        body = self._body(tokens)
        if body and not self._m.consume_tokens(body):
            raise ConstraintError(f"grammar state out of step: {self._m.get_error()}")

    @property
    def stopped(self) -> bool:
        return bool(self._m.is_stopped())
