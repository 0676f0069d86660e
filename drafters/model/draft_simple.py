"""draft-simple: a smaller model with the target's vocabulary drafts greedily or by sampling (docs/semantics.md §5).

The draft model runs on its own Backend with one sequence per slot. Its KV cache is kept in step
with the target through a record of the token at every position it holds:

* While a slot's prompt is being processed (before `begin`), `observe` mirrors each target prompt
  chunk into the draft KV, so the draft model's prefill runs alongside the target's.
* At `draft` time the record is compared with the committed history H: the longest matching
  prefix is kept (truncation is O(1)), and the rest of H plus x is decoded in the first draft
  forward. After a round, x and the accepted draft tokens are usually already in the draft KV from
  drafting, so nothing is decoded twice — llama.cpp instead re-decodes x and the draft in the
  verification mirror (its own TODO) and then deletes the rejected tail; both end each round with
  the draft KV equal to the committed history.

Every draft step of every slot shares one draft-backend forward. The vocabulary check mirrors
llama.cpp's `common_speculative_are_compatible`; a mismatch is a ConfigError, never a silent
fallback.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np

from spekula.core.backend import Backend, Capture, SeqInput, SeqOutput, load_backend
from spekula.core.drafting.description import DrafterDescription
from spekula.core.drafting.draft_models import choose
from spekula.core.drafting.drafter import Draft, DrafterContext, DraftRequest
from spekula.core.drafting.slot_states import SlotStates
from spekula.core.errors import ConfigError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer

VOCAB_CHECK_START = 5  # ids 0-4 are exempt from the text comparison (llama.cpp)
VOCAB_MAX_SIZE_DIFFERENCE = 128
SEED_XOR = 0x85EBCA6B  # probabilistic drafting seeds its sampler with the request seed XOR this
CATCH_UP_CHUNK = 512  # bound on tokens per sequence per catch-up forward (memory, not semantics)


def check_vocab_compatible(target: Any, draft: Any, target_name: str, draft_name: str) -> None:
    """Raise ConfigError naming both models unless the draft vocabulary can stand in for the target's."""
    where = f"draft model {draft_name} cannot draft for target {target_name}"
    t_kind, d_kind = getattr(target, "model_kind", None), getattr(draft, "model_kind", None)
    if t_kind != d_kind:
        raise ConfigError(f"{where}: vocab type {d_kind!r} != target's {t_kind!r}")
    for what in ("bos", "eos"):
        t_add, d_add = bool(getattr(target, f"add_{what}")), bool(getattr(draft, f"add_{what}"))
        t_id, d_id = getattr(target, f"{what}_id"), getattr(draft, f"{what}_id")
        if t_add != d_add or (t_add and t_id != d_id):
            raise ConfigError(
                f"{where}: {what.upper()} differs (add_{what}: target {t_add}, draft {d_add}; "
                f"id: target {t_id}, draft {d_id})"
            )
    n_t, n_d = int(target.n_vocab), int(draft.n_vocab)
    if abs(n_t - n_d) > VOCAB_MAX_SIZE_DIFFERENCE:
        raise ConfigError(
            f"{where}: vocab sizes {n_t} (target) and {n_d} (draft) differ by more than {VOCAB_MAX_SIZE_DIFFERENCE}"
        )
    for i in range(VOCAB_CHECK_START, min(n_t, n_d)):
        t_text, d_text = target.token_text(i), draft.token_text(i)
        if t_text != d_text:
            raise ConfigError(f"{where}: token {i} differs: target {t_text!r}, draft {d_text!r}")


@dataclass(slots=True)
class _Slot:
    seq: int
    kv: list[int] = field(default_factory=list)  # token at every position held in the draft KV
    begun: bool = False
    rng: np.random.Generator | None = None
    rng_key: tuple[float, int] | None = None


@dataclass(slots=True)
class _Run:
    """One slot's drafting in the current call."""

    index: int  # position in the request list
    slot: _Slot
    pos0: int  # position of x
    cap: int
    probabilistic: bool
    temperature: float
    p_min: float
    tokens: list[int] = field(default_factory=list)
    probs: list[np.ndarray] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)
    keep_drafting: Callable[[Sequence[float]], bool] | None = None  # DraftRequest.keep_drafting


class DraftSimpleDrafter:
    name: ClassVar[str] = "draft-simple"
    model_based: ClassVar[bool] = True
    # After a context shift the draft cache is re-decoded from the first position whose token changed
    # (`draft` keeps only the prefix the cache shares with the history), so it always matches the history.
    follows_context_shift: ClassVar[bool] = True
    description: ClassVar[DrafterDescription] = DrafterDescription(
        summary="a smaller model with the target's vocabulary drafts (-md), greedily or by sampling",
        builtin_order=6, draft_model="required",
    )

    def __init__(self, backend: Backend, *, target_n_vocab: int) -> None:
        self.backend = backend
        self.target_n_vocab = target_n_vocab
        self._slots: SlotStates[_Slot] = SlotStates(lambda _slot: _Slot(self.backend.new_seq()))

    @classmethod
    def create(cls, ctx: DrafterContext) -> DraftSimpleDrafter:
        path = ctx.draft_model_path
        if not path:
            raise ConfigError("draft-simple needs a draft model: pass -md/--spec-draft-model FILE.gguf")
        draft_tok = Tokenizer.from_gguf(GGUFFile(path))
        target_tok = ctx.tokenizer if ctx.tokenizer is not None else Tokenizer.from_gguf(GGUFFile(ctx.target.info.path))
        check_vocab_compatible(target_tok, draft_tok, ctx.target.info.path, str(path))
        # Same context as the target and one sequence per slot (llama.cpp requires both); device,
        # dtype and threads follow the target unless --spec-draft-* options were given.
        base = ctx.draft_backend_options or ctx.target.options
        options = replace(base, n_ctx=ctx.target.n_ctx, n_seq_max=max(ctx.n_seq_max, 1))
        return cls(load_backend(ctx.backend_name, str(path), options), target_n_vocab=ctx.target.info.n_vocab)

    # --- protocol ------------------------------------------------------------------------------

    def capture(self) -> Capture:
        return Capture()

    def begin(self, slot: int, prompt: np.ndarray) -> None:
        st = self._slots.get(slot)
        st.begun = True
        st.rng, st.rng_key = None, None  # reset the draft sampler, or two identical requests differ

    def observe(self, slot: int, inp: SeqInput, out: SeqOutput) -> None:
        """Mirror prompt chunks (before begin); later rounds are synced lazily in `draft`."""
        st = self._slots.get(slot)
        if st.begun or inp.start > len(st.kv) or len(inp.tokens) == 0:
            return
        self._forward([(st, [int(t) for t in inp.tokens], inp.start, False)])

    def accept(self, slot: int, n_accepted: int, mine: bool) -> None:
        # Nothing to roll back here: the next draft call keeps only the KV prefix equal to H.
        return None

    def end(self, slot: int) -> None:
        st = self._slots.pop(slot)
        if st is not None:
            self.backend.free_seq(st.seq)

    # --- drafting ------------------------------------------------------------------------------

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        runs: list[_Run] = []
        pending: list[tuple[_Slot, list[int], int]] = []
        for i, r in enumerate(requests):
            cap = min(int(r.spec.n_max), int(r.n_max))
            if cap <= 0:
                continue
            st = self._slots.get(r.slot)
            history = np.asarray(r.history)
            # A recurrent draft model rebuilds only some lengths: from its last checkpoint on, and 0.
            keep = self.backend.restorable(st.seq, _common_prefix(st.kv, history))
            pending.append((st, [int(t) for t in history[keep:]] + [int(r.last)], keep))
            prob = r.spec.draft_sampling == "probabilistic" and r.temperature > 0.0
            if prob:
                self._retune(st, r.temperature, r.seed)
            runs.append(_Run(i, st, len(history), cap, prob, r.temperature, float(r.spec.p_min),
                             keep_drafting=r.keep_drafting))

        if runs:
            rows = self._catch_up(pending)
            for st, _, _ in pending:  # the draft steps after x are what a recurrent draft model takes back
                self.backend.checkpoint(st.seq)
            self._draft_steps(runs, rows)

        out = [Draft.empty() for _ in requests]
        for run in runs:
            if not run.tokens or len(run.tokens) < int(requests[run.index].spec.n_min):
                continue  # nothing, or too short: discarded whole, never padded
            probs = np.stack(run.probs).astype(np.float32) if run.probabilistic else None
            out[run.index] = Draft(run.tokens, probs, run.confidence)
        return out

    def _retune(self, st: _Slot, temperature: float, seed: int) -> None:
        key = (float(temperature), int(seed))
        if st.rng is None or st.rng_key != key:  # rebuilt only when (temp, seed) changes
            st.rng = np.random.default_rng((int(seed) ^ SEED_XOR) & 0xFFFFFFFF)
            st.rng_key = key

    def _catch_up(self, pending: list[tuple[_Slot, list[int], int]]) -> list[np.ndarray]:
        """Decode each slot's missing history + x; return each slot's logits row for x."""
        todo = [(st, toks, start) for st, toks, start in pending]
        while any(len(toks) > CATCH_UP_CHUNK for _, toks, _ in todo):
            chunk = [(st, toks[:CATCH_UP_CHUNK], start, False) for st, toks, start in todo if len(toks) > CATCH_UP_CHUNK]
            self._forward(chunk)
            todo = [
                (st, toks[CATCH_UP_CHUNK:], start + CATCH_UP_CHUNK) if len(toks) > CATCH_UP_CHUNK else (st, toks, start)
                for st, toks, start in todo
            ]
        return self._forward([(st, toks, start, True) for st, toks, start in todo])

    def _draft_steps(self, runs: list[_Run], rows: list[np.ndarray]) -> None:
        active = list(zip(runs, rows, strict=True))
        while active:
            queue: list[_Run] = []
            for run, row in active:
                tok, top_p, q = self._choose(run, row)
                if top_p < run.p_min:
                    continue  # not confident enough: stop this slot, drop the token
                run.tokens.append(tok)
                run.confidence.append(float(top_p))
                if q is not None:
                    run.probs.append(q)
                if len(run.tokens) >= run.cap or (run.keep_drafting is not None and not run.keep_drafting(run.confidence)):
                    continue  # at its cap, or where the policy says no further token could be verified
                queue.append(run)
            if not queue:
                break
            new_rows = self._forward([(run.slot, [run.tokens[-1]], run.pos0 + len(run.tokens), True) for run in queue])
            active = list(zip(queue, new_rows, strict=True))

    def _choose(self, run: _Run, row: np.ndarray) -> tuple[int, float, np.ndarray | None]:
        """Top-10 candidates: (token, probability of the best candidate, dense q or None); the same pick
        as the draft heads', over the ids the target has (never draft ids the target lacks)."""
        if run.probabilistic:
            assert run.slot.rng is not None
        c = choose(row[: self.target_n_vocab], run.temperature, run.slot.rng if run.probabilistic else None)
        return c.token, c.p_top, c.q

    def _forward(self, items: list[tuple[_Slot, list[int], int, bool]]) -> list[np.ndarray]:
        """One draft-backend forward for all items (slot, tokens, start, want last-row logits)."""
        if not items:
            return []
        inputs = []
        for st, toks, start, want in items:
            if start < len(st.kv):
                self.backend.truncate(st.seq, start)
                del st.kv[start:]
            rows = None if want else np.zeros(0, dtype=np.int64)
            inputs.append(SeqInput(st.seq, np.asarray(toks, dtype=np.int32), start, rows))
        outs = self.backend.forward(inputs)
        for st, toks, _start, _want in items:
            st.kv.extend(toks)
        return [out.logits[-1] for (_, _, _, want), out in zip(items, outs, strict=True) if want]


def _common_prefix(kv: list[int], history: np.ndarray) -> int:
    n = min(len(kv), len(history))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(kv[:n], dtype=np.int64) != history[:n])
    return int(diff[0]) if len(diff) else n
