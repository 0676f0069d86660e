"""A deterministic numpy Backend, a tiny tokenizer and engine-test helpers (test drafters, a plain
reference decoder, a run wrapper).

The toy model's logits for a position depend only on the last `window` tokens up to and including
it (a hash seeds a small random vector), so greedy decoding falls into repeating cycles — which
gives the n-gram drafters something real to find — and every row's logits are exactly independent
of batching, chunking and the other sequences in the forward (a property the lossless harness
relies on, as the real torch backend's exact mode guarantees).
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import anyio
import numpy as np

from spekula.core.backend import Backend, BackendOptions, Capture, ModelInfo, SeqInput, SeqOutput
from spekula.core.drafting.drafter import Draft, DrafterContext, DraftlessDrafter, DraftRequest
from spekula.core.engine.engine import Engine, EngineConfig
from spekula.core.errors import ConfigError
from spekula.core.events import FinalEvent
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.core.policy.cost_model import CostModel
from spekula.core.verify.dry import Breakers
from spekula.core.verify.sampling import Sampler


class ToyBackend(Backend):
    def __init__(self, n_vocab: int = 48, *, window: int = 2, n_ctx: int = 256, n_seq_max: int = 8,
                 salt: int = 0, n_embd: int = 8, n_layer: int = 2) -> None:
        self.info = ModelInfo(path="<toy>", arch="toy", name="toy", n_vocab=n_vocab, n_embd=n_embd,
                              n_layer=n_layer, n_ctx_train=n_ctx)
        self.options = BackendOptions(n_ctx=n_ctx, n_seq_max=n_seq_max)
        self.window = window
        self.salt = salt
        self._seqs: dict[int, np.ndarray] = {}
        self._lens: dict[int, int] = {}
        self.n_forward = 0  # forward calls, for batching assertions
        self.rows_per_forward: list[int] = []
        self._cache: dict[bytes, np.ndarray] = {}

    def new_seq(self) -> int:
        if len(self._seqs) >= self.options.n_seq_max:
            raise ConfigError("toy backend: too many sequences")
        seq_id = next(i for i in range(self.options.n_seq_max) if i not in self._seqs)
        self._seqs[seq_id] = np.zeros(self.options.n_ctx, dtype=np.int32)
        self._lens[seq_id] = 0
        return seq_id

    def free_seq(self, seq_id: int) -> None:
        del self._seqs[seq_id], self._lens[seq_id]

    def seq_len(self, seq_id: int) -> int:
        return self._lens[seq_id]

    def truncate(self, seq_id: int, n_keep: int) -> None:
        self._lens[seq_id] = min(self._lens[seq_id], n_keep)

    def _row_logits(self, context: np.ndarray) -> np.ndarray:
        key = context.astype(np.int32).tobytes()
        cached = self._cache.get(key)
        if cached is None:
            rng = np.random.default_rng(zlib.crc32(key) ^ self.salt)
            cached = (rng.standard_normal(self.info.n_vocab) * 3.0).astype(np.float32)
            self._cache[key] = cached
        return cached

    def forward(self, inputs: Sequence[SeqInput], capture: Capture = Capture()) -> list[SeqOutput]:  # noqa: B008 - the ABC's signature
        self.n_forward += 1
        self.rows_per_forward.append(sum(len(i.tokens) for i in inputs))
        outs = []
        for inp in inputs:
            buf, n = self._seqs[inp.seq_id], len(inp.tokens)
            if inp.start > self._lens[inp.seq_id]:
                raise ValueError(f"seq {inp.seq_id}: start {inp.start} > length {self._lens[inp.seq_id]}")
            if inp.start + n > self.options.n_ctx:
                raise ValueError(f"seq {inp.seq_id}: {inp.start + n} positions exceed n_ctx {self.options.n_ctx}")
            if np.any(inp.tokens < 0) or np.any(inp.tokens >= self.info.n_vocab):
                raise ValueError("token id out of range")
            buf[inp.start:inp.start + n] = inp.tokens
            self._lens[inp.seq_id] = inp.start + n
            rows = np.array([n - 1]) if inp.logit_rows is None else np.asarray(inp.logit_rows, dtype=np.int64)
            logits = np.zeros((len(rows), self.info.n_vocab), dtype=np.float32)
            for j, r in enumerate(rows):
                pos = inp.start + int(r)
                logits[j] = self._row_logits(buf[max(0, pos - self.window + 1):pos + 1])
            out = SeqOutput(logits=logits)
            if capture:
                # Fake hidden states that are a pure function of (token, position).
                pos = np.arange(inp.start, inp.start + n, dtype=np.float32)[:, None]
                base = np.sin(inp.tokens.astype(np.float32)[:, None] + pos * 0.01 + np.arange(self.info.n_embd))
                out.layer_inputs = {layer: (base * (layer + 1)).astype(np.float32) for layer in capture.layers}
                if capture.final_norm:
                    out.hidden_final = base.astype(np.float32)
            outs.append(out)
        return outs


class GatedBackend(ToyBackend):
    """Holds its forward after `open_for` forwards until the gate opens: the toy model is so fast that
    a loaded machine could otherwise let a whole request finish before a test cancels it."""

    def __init__(self, open_for: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.open_for, self.calls, self.gate = open_for, 0, threading.Event()

    def forward(self, inputs: Sequence[SeqInput], capture: Capture = Capture()) -> list[SeqOutput]:  # noqa: B008
        self.calls += 1
        if self.calls > self.open_for:
            assert self.gate.wait(30), "the test never opened the gate"
        return super().forward(inputs, capture)


class RecurrentToyBackend(ToyBackend):
    """The toy model with a recurrent state, holding callers to the recurrent-state contract.

    Each row's logits also depend on a state folded over every token of the sequence so far (as a
    gated delta-net layer's does), so a state restored wrongly changes what follows. Truncation
    reaches only what a recurrent backend can rebuild: 0, the current length, lengths from the last
    checkpoint on (for at most `max_logged` rows after it) and the last two snapshots; anything else
    raises, so an engine that forgets a checkpoint or reuses an unrestorable prefix fails loudly.
    """

    STATES = 5
    N_SNAPSHOTS = 2

    def __init__(self, *, max_logged: int = 64, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.info = ModelInfo(path="<toy-recurrent>", arch="toy-recurrent", name="toy-recurrent",
                              n_vocab=self.info.n_vocab, n_embd=self.info.n_embd, n_layer=self.info.n_layer,
                              n_ctx_train=self.info.n_ctx_train, recurrent=True)
        self.max_logged = max_logged
        self._checkpoint: dict[int, int | None] = {}
        self._snapshots: dict[int, list[int]] = {}
        self.n_checkpoints = self.n_snapshots = 0

    def new_seq(self) -> int:
        seq_id = super().new_seq()
        self._checkpoint[seq_id], self._snapshots[seq_id] = None, []
        return seq_id

    def free_seq(self, seq_id: int) -> None:
        super().free_seq(seq_id)
        del self._checkpoint[seq_id], self._snapshots[seq_id]

    def checkpoint(self, seq_id: int) -> None:
        self._checkpoint[seq_id] = self._lens[seq_id]
        self.n_checkpoints += 1

    def snapshot(self, seq_id: int) -> None:
        snaps = self._snapshots[seq_id]
        n = self._lens[seq_id]
        if n not in snaps:
            snaps.append(n)
            del snaps[: -self.N_SNAPSHOTS]
        self.n_snapshots += 1

    def restorable(self, seq_id: int, n_keep: int) -> int:
        length = self._lens[seq_id]
        n = max(0, min(int(n_keep), length))
        ck = self._checkpoint[seq_id]
        if n == length or (ck is not None and ck <= n):
            return n
        return max([0, *(p for p in self._snapshots[seq_id] if p <= n)])

    def truncate(self, seq_id: int, n_keep: int) -> None:
        n = max(0, min(int(n_keep), self._lens[seq_id]))
        if self.restorable(seq_id, n) != n:
            raise ConfigError(f"toy recurrent backend: length {n} of seq {seq_id} cannot be restored "
                              f"(length {self._lens[seq_id]}, checkpoint {self._checkpoint[seq_id]}, "
                              f"snapshots {self._snapshots[seq_id]})")
        self._lens[seq_id] = n
        ck = self._checkpoint[seq_id]
        if ck is not None and ck > n:
            self._checkpoint[seq_id] = None
        self._snapshots[seq_id] = [p for p in self._snapshots[seq_id] if p <= n]

    def _states(self, tokens: np.ndarray) -> np.ndarray:
        """state[i]: the state after tokens[: i + 1]."""
        out, state = np.zeros(len(tokens), np.int32), 0
        for i, t in enumerate(tokens):
            state = (state * 3 + int(t)) % self.STATES
            out[i] = state
        return out

    def forward(self, inputs: Sequence[SeqInput], capture: Capture = Capture()) -> list[SeqOutput]:  # noqa: B008
        for inp in inputs:
            if inp.start < self._lens[inp.seq_id]:
                self.truncate(inp.seq_id, inp.start)  # writing at start truncates: the same rule applies
            ck = self._checkpoint[inp.seq_id]
            if ck is not None and inp.start + len(inp.tokens) - ck > self.max_logged:
                self._checkpoint[inp.seq_id] = None  # too many rows after it to replay
        outs = super().forward(inputs, capture)
        for inp, out in zip(inputs, outs, strict=True):
            n = len(inp.tokens)
            rows = np.array([n - 1]) if inp.logit_rows is None else np.asarray(inp.logit_rows, dtype=np.int64)
            states = self._states(self._seqs[inp.seq_id][: inp.start + n])
            for j, r in enumerate(rows):
                out.logits[j] = np.roll(out.logits[j], int(states[inp.start + int(r)]))
        return outs


class _StreamDecoder:
    def __init__(self, tok: ToyTokenizer, skip_special: bool) -> None:
        self._tok = tok
        self._skip = skip_special

    def push(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special=self._skip)

    def flush(self) -> str:
        return ""


class ToyTokenizer:
    """Token i is a short fixed string; ids in `eog_ids` are end-of-generation control tokens."""

    ALPHABET = "abcdefghijklmnopqrstuvwxyz .,!?0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"

    def __init__(self, n_vocab: int = 48, eog_ids: frozenset[int] = frozenset()) -> None:
        self.n_vocab = n_vocab
        self.eog_ids = frozenset(eog_ids)
        self.eos_id = min(eog_ids) if eog_ids else None
        self.bos_id = None
        self.add_bos = False
        self.add_eos = False

    def is_eog(self, token: int) -> bool:
        return token in self.eog_ids

    def token_text(self, token: int) -> str:
        if token in self.eog_ids:
            return f"<eog{token}>"
        return self.ALPHABET[token % len(self.ALPHABET)]

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        return "".join("" if (skip_special and t in self.eog_ids) else self.token_text(t) for t in ids)

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return [self.ALPHABET.index(c) % self.n_vocab for c in text]

    def token_bytes(self, token: int) -> bytes:
        return self.token_text(token).encode()

    def stream_decoder(self, *, skip_special: bool = False) -> _StreamDecoder:
        return _StreamDecoder(self, skip_special)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        return "".join(m["content"] for m in messages)


class RepeatDrafter(DraftlessDrafter):
    """Proposes what followed the latest earlier occurrence of (H[-1], x): an n-gram drafter in miniature."""

    name: ClassVar[str] = "test-repeat"

    def __init__(self, n_max: int = 6) -> None:
        self.n_max = n_max
        self.draft_cap = n_max  # the engine sizes synthetic rates and tables by it
        self.accepts: list[tuple[int, int, bool]] = []
        self.begun: list[int] = []

    @classmethod
    def create(cls, ctx: DrafterContext) -> RepeatDrafter:
        return cls(int(ctx.option("test-repeat-n-max", 6)))

    def begin(self, slot: int, prompt: np.ndarray) -> None:
        self.begun.append(slot)

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        out = []
        for r in requests:
            h = r.history
            found: list[int] = []
            for j in range(len(h) - 2, 0, -1):
                if h[j - 1] == h[-1] and h[j] == r.last:
                    found = [int(t) for t in h[j + 1 : j + 1 + min(self.n_max, r.n_max)]]
                    break
            out.append(Draft(found))
        return out

    def accept(self, slot: int, n_accepted: int, mine: bool) -> None:
        self.accepts.append((slot, n_accepted, mine))


class OracleDrafter(DraftlessDrafter):
    """Knows the sequences plain decoding produces (`sequences`: prompt + output) and proposes their next
    tokens, one of them wrong in about half the drafts: the target accepts every length from 0 to the whole
    draft, so rollbacks of every size happen on any model."""

    name: ClassVar[str] = "test-oracle"

    def __init__(self, sequences: Sequence[Sequence[int]], n_vocab: int, n_max: int = 6, seed: int = 0) -> None:
        self.sequences = [list(map(int, q)) for q in sequences]
        self.n_vocab, self.n_max = n_vocab, n_max
        self.draft_cap = n_max
        self.rng = np.random.default_rng(seed)

    @classmethod
    def create(cls, ctx: DrafterContext) -> OracleDrafter:
        raise ConfigError("test-oracle is built by the tests that know the sequences")

    def begin(self, slot: int, prompt: np.ndarray) -> None:
        return None

    def accept(self, slot: int, n_accepted: int, mine: bool) -> None:
        return None

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        out = []
        for r in requests:
            known = [*map(int, r.history), int(r.last)]
            seq = next((q for q in self.sequences if q[: len(known)] == known), None)
            tokens = [] if seq is None else seq[len(known) : len(known) + min(self.n_max, r.n_max)]
            if tokens and self.rng.random() < 0.5:
                i = int(self.rng.integers(len(tokens)))
                tokens[i] = (tokens[i] + 1) % self.n_vocab
            out.append(Draft(tokens))
        return out


class GarbageDrafter(DraftlessDrafter):
    """Always proposes n_max pseudo-random tokens: verification must throw them away losslessly."""

    name: ClassVar[str] = "test-garbage"

    def __init__(self, n_vocab: int, n_max: int = 4) -> None:
        self.n_vocab = n_vocab
        self.n_max = n_max
        self.draft_cap = n_max  # the engine sizes synthetic rates and tables by it
        self._rng = np.random.default_rng(7)

    @classmethod
    def create(cls, ctx: DrafterContext) -> GarbageDrafter:
        return cls(ctx.target.info.n_vocab)

    def begin(self, slot: int, prompt: np.ndarray) -> None:
        return None

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        return [Draft([int(t) for t in self._rng.integers(0, self.n_vocab, min(self.n_max, r.n_max))])
                for r in requests]

    def accept(self, slot: int, n_accepted: int, mine: bool) -> None:
        return None


class ConfidentDrafter(DraftlessDrafter):
    """Model-based stand-in that says how sure it is: knows the sequence plain decoding produces
    (`truth`: prompt and output) and drafts it for `right` tokens, then pseudo-random tokens up to
    n_max, with confidence `sure` for the right tokens and `unsure` for the rest (swapped with `liar`),
    so its confidence tells the right tokens from the wrong ones (or says the opposite)."""

    name: ClassVar[str] = "test-confident"
    model_based: ClassVar[bool] = True

    def __init__(self, truth: Sequence[int], n_vocab: int, n_max: int = 6, right: int = 3, sure: float = 0.95,
                 unsure: float = 0.15, liar: bool = False) -> None:
        self.truth = [int(t) for t in truth]
        self.garbage = GarbageDrafter(n_vocab, n_max)
        self.n_max = n_max  # no draft_cap: like the real model drafters it stops at --spec-draft-n-max
        self.right = right
        self.sure, self.unsure = (unsure, sure) if liar else (sure, unsure)

    @classmethod
    def create(cls, ctx: DrafterContext) -> ConfidentDrafter:
        raise NotImplementedError("built by the tests with the sequence it knows")

    def begin(self, slot: int, prompt: np.ndarray) -> None:
        return None

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        out = []
        for r, pad in zip(requests, self.garbage.draft(requests), strict=True):
            n = min(self.n_max, r.n_max, r.spec.n_max)
            at = len(r.history) + 1  # the draft follows the history and the pending token x
            right = self.truth[at : at + min(self.right, n)]
            tokens = (right + [int(t) for t in pad.tokens])[:n]
            out.append(Draft(tokens, None, [self.sure] * len(right) + [self.unsure] * (n - len(right))))
        return out

    def accept(self, slot: int, n_accepted: int, mine: bool) -> None:
        return None


class ObservingDrafter(GarbageDrafter):
    """Model-based stand-in: declares a capture and records what observe() saw."""

    name: ClassVar[str] = "test-observer"
    model_based: ClassVar[bool] = True

    def __init__(self, n_vocab: int, n_max: int = 2) -> None:
        super().__init__(n_vocab, n_max)
        self.observed: list[tuple[int, int, int, tuple[int, ...]]] = []

    def capture(self) -> Capture:
        return Capture(frozenset({1}))

    def observe(self, slot: int, inp: SeqInput, out: SeqOutput) -> None:
        self.observed.append((slot, inp.start, len(inp.tokens), tuple(out.layer_inputs)))


def plain_decode(backend: Backend, prompt: Sequence[int], *, n_predict: int, sampling: SamplingParams,
                 seed: int, is_eog: Callable[[int], bool], n_ctx: int, ignore_eos: bool = False,
                 dry_breakers: Breakers | None = None) -> list[int]:
    """Reference: one token per forward, straight over Backend + Sampler (no engine involved)."""
    seq = backend.new_seq()
    sampler = Sampler(sampling, backend.info.n_vocab, seed, dry_breakers)
    sampler.accept_many(prompt)
    out = backend.forward([SeqInput(seq, np.asarray(prompt, np.int32), 0)])
    tokens: list[int] = []
    pos = len(prompt)
    while True:
        t = sampler.sample(out[0].logits[-1])
        sampler.accept(t)
        tokens.append(t)
        if (is_eog(t) and not ignore_eos) or (0 <= n_predict <= len(tokens)) or len(prompt) + len(tokens) >= n_ctx:
            break
        out = backend.forward([SeqInput(seq, np.array([t], np.int32), pos)])
        pos += 1
    backend.free_seq(seq)
    return tokens


async def run_requests(engine: Engine, requests: list[CompletionRequest], timeout: float = 30.0,
                       on_event: Callable[[Any], None] | None = None) -> list[FinalEvent]:
    """Start the engine, submit every request at once, collect the finals in order."""
    finals: list[FinalEvent | None] = [None] * len(requests)
    with anyio.fail_after(timeout):
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)

            async def consume(i: int, req: CompletionRequest) -> None:
                handle = engine.submit(req)
                async for ev in handle:
                    if on_event is not None:
                        on_event(ev)
                finals[i] = handle.final

            async with anyio.create_task_group() as inner:
                for i, req in enumerate(requests):
                    inner.start_soon(consume, i, req)
            tg.cancel_scope.cancel()
    assert all(f is not None for f in finals)
    return finals  # type: ignore[return-value]


def make_engine(backend: Backend, tokenizer: Any, *, n_slots: int = 1, n_ctx: int = 256, n_batch: int = 64,
                **kw: Any) -> Engine:
    spec = kw.pop("spec", SpecParams())
    return Engine(backend, tokenizer, EngineConfig(n_slots=n_slots, n_ctx=n_ctx, n_batch=n_batch, spec=spec), **kw)


class FixedCost(CostModel):
    """A cost model that does not learn: forward(rows) = base + per_row * rows, drafting free.

    With it the cost model's decisions depend only on the acceptance it has seen, not on how fast
    the machine running the tests happens to be, so a test can make drafts worth shortening."""

    def __init__(self, base: float, per_row: float) -> None:
        super().__init__({1: base + per_row, 2: base + 2 * per_row})

    def observe_forward(self, rows: int, seconds: float) -> None:
        return None

    def observe_overhead(self, seconds: float) -> None:
        return None

    def observe_draft(self, drafter: str, seconds: float, steps: int, per_token: bool) -> None:
        return None

    def observe_plain_round(self, n_gen: int, seconds: float) -> None:
        return None


def fix_cost(engine: Engine, base: float, per_row: float) -> Engine:
    """Give `engine` a FixedCost (see there)."""
    engine.adaptive.cost = FixedCost(base, per_row)
    return engine
