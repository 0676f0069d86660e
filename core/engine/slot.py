"""One slot: a concurrent request's place in the engine, with its KV sequence and emission rules.

A slot owns one backend sequence for the engine's lifetime. When a request ends its KV stays, with
the token ids behind it in `tokens[:n_cached]`; the next request keeps the prefix it shares with
its prompt (core/engine/prompt_cache.py) and truncates the rest. The history H (prompt + accepted tokens, excluding the pending target token x) lives in a preallocated
int32 buffer so that drafters get a zero-copy view of it.

Emission follows llama-server's per-token checks (docs/semantics.md §1.1 step 9): each
emitted token is checked for EOG, n_predict, context full and stop strings, in that order; the first
token that stops generation ends the request and the rest of the round is dropped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import numpy as np

from spekula.core.drafting.drafter import Drafter
from spekula.core.events import ProgressEvent, StopType
from spekula.core.params import CompletionRequest
from spekula.core.stats.stats import SlotSpecStats
from spekula.core.verify.token_probs import TokenProbs

if TYPE_CHECKING:
    from spekula.core.engine.request_handle import Outbox
    from spekula.core.engine.request_plan import RequestPlan
    from spekula.core.policy.policy import DraftPolicy


class SlotState(StrEnum):
    IDLE = "idle"
    PROMPT = "prompt"
    GENERATING = "generating"


class StopText:
    """Generated text with stop-string detection and partial-match holdback (llama-server style).

    The streamed text never shows a suffix that could still become a stop string; the final
    content is cut right before the first complete stop string.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.text = ""
        self.n_sent = 0

    def push(self, piece: str) -> str | None:
        """Append `piece`; return the stop word if one is now complete (text is cut before it)."""
        old_len = len(self.text)
        self.text += piece
        best: tuple[int, str] | None = None
        for word in self.stops:
            pos = self.text.find(word, max(0, old_len - len(word) + 1))
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, word)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        return best[1]

    def _holdback(self) -> int:
        longest = 0
        for word in self.stops:
            for n in range(min(len(word) - 1, len(self.text)), longest, -1):
                if self.text.endswith(word[:n]):
                    longest = n
                    break
        return longest

    def take(self, final: bool) -> str:
        """Text not streamed yet; while not final, a possible stop-string prefix is held back."""
        end = len(self.text) if final else len(self.text) - self._holdback()
        if end <= self.n_sent:
            return ""
        out = self.text[self.n_sent : end]
        self.n_sent = end
        return out


@dataclass(eq=False)
class Slot:
    id: int
    seq_id: int
    n_ctx: int
    context_shift: bool = False  # a full context shifts (core/engine/context_shift.py) instead of stopping
    state: SlotState = SlotState.IDLE
    tokens: np.ndarray = field(init=False)  # H in tokens[:n_hist]
    n_hist: int = 0
    last: int = -1  # x, the pending target token (not in the KV)
    # While idle: how many of `tokens` the KV sequence holds (valid for the next request's prefix).
    n_cached: int = 0
    last_used: float = 0.0  # when the last request ended (least recently used slots are reused first)
    # Per-request fields, reset by `start`.
    request: CompletionRequest | None = None
    outbox: Outbox | None = None
    prompt: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    n_prompt_done: int = 0  # prompt tokens in the KV, the reused ones included
    n_cache_reused: int = 0  # prompt tokens this request found in the KV (timings.cache_n)
    plan: RequestPlan | None = None  # how the request runs: drafters, sampler, verifier (set at submit)
    generated: list[int] = field(default_factory=list)
    probs: list[TokenProbs] = field(default_factory=list)  # per generated token, when the request asks
    text: StopText = field(default_factory=lambda: StopText([]))
    decoder: Any = None
    stop_type: StopType = "none"
    stopping_word: str = ""
    error: str | None = None
    cancelled: bool = False
    truncated: bool = False  # stopped because the context was full (llama-server's `truncated`)
    # Statistics (docs/semantics.md §4.2) and timings.
    spec_stats: SlotSpecStats = field(default_factory=SlotSpecStats)
    t_start: float = 0.0
    t_prompt_done: float = 0.0
    t_end: float = 0.0

    def __post_init__(self) -> None:
        self.tokens = np.zeros(self.n_ctx, dtype=np.int32)

    @property
    def busy(self) -> bool:
        return self.state is not SlotState.IDLE

    @property
    def request_id(self) -> str | None:
        return self.request.id if self.request is not None else None

    @property
    def finished(self) -> bool:
        return self.stop_type != "none" or self.error is not None

    def start(self, request: CompletionRequest, outbox: Outbox, plan: RequestPlan, decoder: Any,
              n_reused: int = 0) -> None:
        """Take a request whose first `n_reused` prompt tokens are already in the KV (the caller
        truncated the sequence to them)."""
        self.request, self.outbox, self.plan, self.decoder = request, outbox, plan, decoder
        self.prompt = np.asarray(request.prompt, dtype=np.int32)
        assert 0 <= n_reused < len(self.prompt) or n_reused == 0
        self.state = SlotState.PROMPT
        # The prompt goes into the history buffer now, so tokens[:n_prompt_done] always names the KV.
        self.tokens[: len(self.prompt)] = self.prompt
        self.n_prompt_done = self.n_cache_reused = n_reused
        self.n_hist = 0
        self.n_cached = 0
        self.last = -1
        self.generated = []
        self.probs = []
        self.text = StopText(list(request.stop))
        self.stop_type, self.stopping_word, self.error, self.cancelled = "none", "", None, False
        self.truncated = False
        self.spec_stats = SlotSpecStats(n_max=plan.n_max_eff)
        self.t_start = time.perf_counter()
        self.t_prompt_done = self.t_end = 0.0
        if request.n_predict == 0:
            self.stop_type = "limit"

    @property
    def n_kv(self) -> int:
        """Tokens of `tokens` the KV sequence holds right now."""
        if self.state is SlotState.GENERATING:
            return self.n_hist
        if self.state is SlotState.PROMPT:
            return self.n_prompt_done
        return self.n_cached

    def reset(self, keep_cache: bool = True) -> None:
        """Back to idle; the KV (and the tokens naming it) stays for the next request unless the
        request failed in a way that leaves the sequence's contents unknown."""
        self.n_cached = self.n_kv if keep_cache else 0
        self.last_used = time.perf_counter()
        self.state = SlotState.IDLE
        self.request = self.outbox = self.plan = self.decoder = None

    @property
    def drafters(self) -> tuple[Drafter, ...]:
        return self.plan.drafters if self.plan is not None else ()

    @property
    def policy(self) -> DraftPolicy | None:
        """What decides the request's draft lengths (core/policy/policy.py)."""
        return self.plan.policy if self.plan is not None else None

    @property
    def constrained(self) -> bool:
        """A grammar checks the request's drafts."""
        return self.plan is not None and self.plan.constraint is not None

    def may_draft(self) -> bool:
        return bool(self.drafters) and self.n_draft_max() > 0

    @property
    def history(self) -> np.ndarray:
        return self.tokens[: self.n_hist]

    def n_draft_max(self) -> int:
        """The round's draft budget (docs/semantics.md §1.1 step 2): context room and the n_predict remainder."""
        assert self.request is not None
        n = self.n_ctx - self.n_hist - 2
        if self.request.n_predict >= 0:
            n = min(n, self.request.n_predict - len(self.generated) - 1)
        return max(n, 0)

    def commit(self, emitted: list[int]) -> None:
        """x and the accepted drafts join H; the last emitted token becomes the new x."""
        n = len(emitted)
        self.tokens[self.n_hist] = self.last
        self.tokens[self.n_hist + 1 : self.n_hist + n] = emitted[:-1]
        self.n_hist += n
        self.last = int(emitted[-1])

    def emit(self, token: int, is_eog: bool) -> None:
        """Per-token stop checks; sets stop_type when this token ends the request."""
        assert self.request is not None
        req = self.request
        self.generated.append(int(token))
        if is_eog and not req.ignore_eos:
            self.stop_type = "eos"  # EOG text is not part of the content (special tokens render empty)
            return
        word = self.text.push(self.decoder.push([int(token)]))
        if word is not None:
            self.stop_type, self.stopping_word = "word", word
        elif req.n_predict >= 0 and len(self.generated) >= req.n_predict:
            self.stop_type = "limit"
        elif not self.context_shift and len(self.prompt) + len(self.generated) >= self.n_ctx:
            # Counted as if tokens were generated one at a time, so a speculative round stops at
            # the same token as plain decoding would (llama.cpp can stop a round early instead).
            self.stop_type = "limit"
            self.truncated = True

    def progress(self) -> ProgressEvent:
        """The prompt's progress now: the reused prefix counts as processed, and time runs from the
        request's start (llama-server's prompt_progress); timings too if the request asked."""
        assert self.request is not None
        now = time.perf_counter()
        timings = None
        if self.request.timings_per_token:
            timings = self.timings()
            if not self.t_prompt_done and self.n_prompt_done > self.n_cache_reused:  # part of the prompt is in
                n = self.n_prompt_done - self.n_cache_reused
                ms = (now - self.t_start) * 1e3
                timings.update(prompt_n=int(n), prompt_ms=ms, prompt_per_token_ms=ms / n, prompt_per_second=1e3 * n / ms)
        return ProgressEvent(self.request.id, total=len(self.prompt), cache=int(self.n_cache_reused),
                             processed=int(self.n_prompt_done), time_ms=(now - self.t_start) * 1e3, slot=self.id,
                             timings=timings)

    def timings(self) -> dict[str, Any]:
        prompt_ms = (self.t_prompt_done - self.t_start) * 1e3 if self.t_prompt_done else 0.0
        end = self.t_end or time.perf_counter()
        predicted_ms = (end - self.t_prompt_done) * 1e3 if self.t_prompt_done else 0.0
        n_prompt, n_pred = int(self.n_prompt_done - self.n_cache_reused), len(self.generated)
        # The first token comes with the prompt's forward: decoding took n_pred - 1 steps (as
        # llama-server counts them), so a one-token answer has no decoding rate.
        steps = max(n_pred - 1, 0)
        out: dict[str, Any] = {
            "cache_n": int(self.n_cache_reused),
            "prompt_n": n_prompt,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / n_prompt if n_prompt else 0.0,
            "prompt_per_second": 1e3 * n_prompt / prompt_ms if prompt_ms > 0 else 0.0,
            "predicted_n": n_pred,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / steps if steps else 0.0,
            "predicted_per_second": 1e3 * steps / predicted_ms if steps and predicted_ms > 0 else 0.0,
        }
        out.update(self.spec_stats.timings_fields())  # draft_n, draft_n_accepted only when drafted (docs/semantics.md §4.2)
        return out
