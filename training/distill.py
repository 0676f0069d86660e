"""Self-distillation: the target answers the prompt set, and the hidden states it had on the way are kept.

Each prompt is chat-templated with the target's own template and answered by the target itself
(greedy by default, or sampled at ``temperature`` with one RNG stream per prompt), several prompts at
a time in one batched forward. The same forwards capture the layer inputs the head will read, so no
second pass is needed: every token the target reads yields its features and its greedy label (the
argmax of its logits there), prompt rows included, and with ``soft_top_k`` its K likeliest next tokens
and their log-probabilities (soft labels: what the target thinks of the runners-up as well). Results go to a :class:`FeatureCacheWriter` one
shard at a time, in prompt order, so an interrupted run resumes after the last whole shard and the
data do not depend on how many prompts ran side by side (the backends' numerics are batch-invariant).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from spekula.backends.gguf.default_model import cache_dir
from spekula.backends.onnx.cache import gguf_sha256
from spekula.core.backend import BackendOptions, Capture, SeqInput, load_backend, resolve_backend_name
from spekula.core.errors import ConfigError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.training.feature_cache import DistilledSequence, FeatureCache, FeatureCacheWriter
from spekula.training.prompts import prompt_digest

PREFILL_CHUNK = 512  # prompt rows per forward: bounds the logits array of a long prompt


@dataclass(frozen=True, slots=True)
class DistillOptions:
    max_new: int = 256  # answer tokens per prompt at most
    temperature: float = 0.0  # 0: greedy answers
    seed: int = 0
    parallel: int = 8  # prompts answered side by side in one forward
    n_ctx: int = 2048
    shard_prompts: int = 64
    backend: str = "auto"
    device: str = "cpu"
    threads: int = 0
    soft_top_k: int = 0  # keep the target's K likeliest next tokens per position (0: hard labels only)


@dataclass(frozen=True, slots=True)
class DistillProgress:
    prompts_done: int
    prompts_total: int
    tokens: int
    tokens_goal: int
    tokens_per_s: float  # tokens the target read per second in this run


def target_identity(path: str) -> str:
    """What names the target in a cache recipe: its file's digest (a re-fetched identical file matches),
    memoised per (path, size, mtime) with the other users of a GGUF's digest."""
    return gguf_sha256(path)


def recipe_for(target: str, prompts: Sequence[str], layers: Sequence[int], options: DistillOptions) -> dict[str, object]:
    gen = asdict(options)
    for k in ("parallel", "shard_prompts", "backend", "device", "threads"):  # do not change the data
        gen.pop(k)
    if not options.soft_top_k:  # caches made before soft labels existed keep their recipe (and folder)
        gen.pop("soft_top_k")
    return {"target": target_identity(target), "layers": [int(x) for x in layers],
            "prompts": prompt_digest(list(prompts)), "n_prompts": len(prompts), "generation": gen}


def default_cache_dir(recipe: dict[str, object]) -> Path:
    """Where a recipe's data live unless --cache-dir says otherwise: named by the recipe, in the user cache."""
    key = hashlib.sha256(repr(sorted(recipe.items())).encode()).hexdigest()[:16]
    return cache_dir() / "train" / f"distill-{key}"


@dataclass(slots=True)
class _Active:
    index: int
    seq: int
    tokens: list[int]
    n_prompt: int
    fed: int  # tokens already forwarded
    feats: list[np.ndarray]
    labels: list[np.ndarray]
    soft: list[tuple[np.ndarray, np.ndarray]]
    rng: np.random.Generator | None


class Distiller:
    """Runs the target over prompts and writes distilled sequences into a cache."""

    def __init__(self, target: str, layers: Sequence[int], options: DistillOptions) -> None:
        self.options = options
        self.layers = tuple(int(x) for x in layers)
        bopts = BackendOptions(device=options.device, n_ctx=options.n_ctx, n_seq_max=max(1, options.parallel),
                               threads=options.threads, exact=True)
        self.backend = load_backend(resolve_backend_name(options.backend, bopts), target, bopts)
        self.tokenizer = Tokenizer.from_gguf(GGUFFile(target))
        bad = [x for x in self.layers if not 0 <= x <= self.backend.info.n_layer]
        if bad:
            raise ConfigError(f"layers {bad} outside the target's 0..{self.backend.info.n_layer}")
        self.capture = Capture(layers=frozenset(self.layers))

    def close(self) -> None:
        self.backend.close()

    def encode(self, prompt: str) -> list[int]:
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special=True, parse_special=True)

    def answer(self, prompts: Sequence[tuple[int, str]], on_tokens: Callable[[int], None] | None = None) -> list[DistilledSequence]:
        """Distilled sequences for (prompt index, prompt) pairs, in the given order; prompts too long
        for the context are skipped."""
        o = self.options
        queue: list[tuple[int, list[int]]] = []
        for index, prompt in prompts:
            ids = self.encode(prompt)
            if 0 < len(ids) <= o.n_ctx - o.max_new - 1:
                queue.append((index, ids))
        queue.reverse()
        active: list[_Active] = []
        done: dict[int, DistilledSequence] = {}
        while queue or active:
            while queue and len(active) < max(1, o.parallel):
                index, ids = queue.pop()
                rng = np.random.default_rng([o.seed, index]) if o.temperature > 0 else None
                active.append(_Active(index, self.backend.new_seq(), ids, len(ids), 0, [], [], [], rng))
            inputs = []
            for a in active:
                chunk = a.tokens[a.fed:a.fed + PREFILL_CHUNK]
                inputs.append(SeqInput(a.seq, np.asarray(chunk, dtype=np.int32), a.fed,
                                       logit_rows=np.arange(len(chunk))))
            outs = self.backend.forward(inputs, self.capture)
            still: list[_Active] = []
            for a, inp, out in zip(active, inputs, outs, strict=True):
                n = len(inp.tokens)
                a.fed += n
                a.feats.append(np.concatenate([out.layer_inputs[x] for x in self.layers], axis=1).astype(np.float16))
                labels = np.argmax(out.logits, axis=1).astype(np.int32)
                a.labels.append(labels)
                if o.soft_top_k:
                    a.soft.append(top_k_log_probs(out.logits, o.soft_top_k))
                if on_tokens is not None:
                    on_tokens(n)
                if a.fed < len(a.tokens):  # prompt still being read
                    still.append(a)
                    continue
                nxt = int(labels[-1]) if a.rng is None else _sample(out.logits[-1], o.temperature, a.rng)
                n_answer = a.fed - a.n_prompt
                if self.tokenizer.is_eog(nxt) or n_answer + 1 > o.max_new or a.fed + 1 >= o.n_ctx:
                    soft_ids = np.concatenate([x[0] for x in a.soft]) if a.soft else None
                    soft_logp = np.concatenate([x[1] for x in a.soft]) if a.soft else None
                    done[a.index] = DistilledSequence(np.asarray(a.tokens[:a.fed], dtype=np.int32),
                                                      np.concatenate(a.labels), np.concatenate(a.feats), a.n_prompt,
                                                      soft_ids, soft_logp)
                    self.backend.free_seq(a.seq)
                    continue
                a.tokens.append(nxt)
                still.append(a)
            active = still
        return [done[i] for i, _ in prompts if i in done]


def top_k_log_probs(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the ``k`` likeliest token ids (most likely first; ties by lower id, so the first is the
    row's argmax) and their log-probabilities under the full softmax (int32, float16)."""
    x = torch.from_numpy(np.ascontiguousarray(logits, dtype=np.float32))
    values, ids = torch.topk(x, min(k, x.shape[1]), dim=1)
    # topk's order among equal values is unspecified: order by (value, then lower id) explicitly.
    by_id = torch.argsort(ids, dim=1)
    values, ids = values.gather(1, by_id), ids.gather(1, by_id)
    by_value = torch.argsort(values, dim=1, descending=True, stable=True)
    values, ids = values.gather(1, by_value), ids.gather(1, by_value)
    logp = values - torch.logsumexp(x, dim=1, keepdim=True)
    return ids.numpy().astype(np.int32), logp.numpy().astype(np.float16)


def _sample(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    z = logits.astype(np.float64) / temperature
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    return int(rng.choice(len(p), p=p))


def distill(target: str, prompts: Sequence[str], layers: Sequence[int], cache_root: Path | None, tokens_goal: int,
            options: DistillOptions, progress: Callable[[DistillProgress], None] | None = None) -> FeatureCache:
    """Fill (or continue) the cache at ``cache_root`` (None: the recipe's default folder) until it holds
    ``tokens_goal`` tokens or the prompts run out; returns the verified cache."""
    recipe = recipe_for(target, prompts, layers, options)
    cache_root = cache_root or default_cache_dir(recipe)
    probe = GGUFFile(target)
    n_embd = int(probe.require(f"{probe.architecture}.embedding_length"))
    writer = FeatureCacheWriter(cache_root, recipe, len(layers) * n_embd, options.soft_top_k)
    cursor = writer.n_prompts
    if writer.n_tokens >= tokens_goal or cursor >= len(prompts):
        return writer.verified or FeatureCache(cache_root)  # nothing to add: what opening checked is it
    distiller = Distiller(target, layers, options)
    t0, read = time.perf_counter(), 0

    def count(n: int) -> None:
        nonlocal read
        read += n
        if progress is not None:
            rate = read / max(time.perf_counter() - t0, 1e-9)
            progress(DistillProgress(cursor, len(prompts), writer.n_tokens, tokens_goal, rate))

    try:
        while writer.n_tokens < tokens_goal and cursor < len(prompts):
            batch = list(enumerate(prompts))[cursor:cursor + options.shard_prompts]
            seqs = distiller.answer(batch, count)
            writer.write_shard(seqs, n_prompts=len(batch))
            cursor += len(batch)
            count(0)
    finally:
        distiller.close()
    if writer.n_tokens < tokens_goal:
        writer.note_exhausted()
    return FeatureCache(cache_root)
