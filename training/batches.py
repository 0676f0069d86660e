"""Training batches from a feature cache, as a pure function of (seed, step).

The order of sequences is a fresh permutation per epoch drawn from ``seed``; a sequence longer than
``seq_len`` contributes one window whose start is drawn from (seed, sample index). Nothing here keeps
state between steps, so a resumed run sees exactly the batches an uninterrupted one would have.
A held-out tail of the cache (``n_eval`` sequences) never enters training and serves as the evaluation set.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from spekula.core.errors import ConfigError
from spekula.training.feature_cache import DistilledSequence, FeatureCache
from spekula.training.head_api import TrainBatch

# One sequence's window: tokens, labels, features, loss mask, and (soft ids, soft log-probs) or None.
Window = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray] | None]


class BatchSource:
    def __init__(self, cache: FeatureCache, cache_layers: Sequence[int], head_layers: Sequence[int], *,
                 n_embd: int, seq_len: int, batch_seqs: int, seed: int, n_eval: int, answer_only: bool = False,
                 soft_labels: bool = False, device: torch.device | str = "cpu") -> None:
        missing = [x for x in head_layers if x not in cache_layers]
        if missing:
            raise ValueError(f"the feature cache holds layers {list(cache_layers)}, not {missing}")
        if len(cache) < n_eval + 1:
            raise ValueError(f"the feature cache holds {len(cache)} sequences; at least {n_eval + 1} are needed")
        if soft_labels and not cache.has_soft_labels:
            raise ConfigError("soft labels asked for, but the feature cache was distilled without them "
                             "(distil again with --soft-top-k)")
        self.cache = cache
        self.soft_labels = soft_labels
        self.cols = np.concatenate([np.arange(cache_layers.index(x) * n_embd, (cache_layers.index(x) + 1) * n_embd)
                                    for x in head_layers])
        self.whole = len(self.cols) == cache.n_features and np.array_equal(self.cols, np.arange(cache.n_features))
        self.seq_len, self.batch_seqs, self.seed = seq_len, batch_seqs, seed
        self.answer_only = answer_only
        self.device = torch.device(device)
        self.n_train = len(cache) - n_eval
        self.eval_indices = list(range(self.n_train, len(cache)))
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.n_train)}
        return self._perms[epoch]

    def train_indices(self, step: int) -> list[int]:
        first = step * self.batch_seqs
        out = []
        for i in range(first, first + self.batch_seqs):
            out.append(int(self._perm(i // self.n_train)[i % self.n_train]))
        return out

    def batch(self, step: int) -> TrainBatch:
        first = step * self.batch_seqs
        windows = [self._window(self.cache[idx], first + j) for j, idx in enumerate(self.train_indices(step))]
        return self.collate(windows)

    def eval_batches(self) -> list[TrainBatch]:
        seqs = [self._window(self.cache[i], -1 - i) for i in self.eval_indices]
        return [self.collate(seqs[k:k + self.batch_seqs]) for k in range(0, len(seqs), self.batch_seqs)]

    def _window(self, s: DistilledSequence, sample: int) -> Window:
        n = len(s.tokens)
        start = 0
        if n > self.seq_len:
            start = int(np.random.default_rng([self.seed, 1 << 20, abs(sample)]).integers(0, n - self.seq_len + 1))
        end = min(n, start + self.seq_len)
        feats = np.asarray(s.features[start:end])
        if not self.whole:
            feats = feats[:, self.cols]
        mask = np.ones(end - start, dtype=bool)
        if self.answer_only:
            # label t predicts token t+1: it is an answer token from answer_start - 1 on
            mask = np.arange(start, end) >= s.answer_start - 1
        soft = None
        if self.soft_labels and s.soft_ids is not None and s.soft_logp is not None:
            soft = (np.asarray(s.soft_ids[start:end]), np.asarray(s.soft_logp[start:end]))
        return s.tokens[start:end], s.labels[start:end], feats, mask, soft

    def collate(self, windows: Sequence[Window]) -> TrainBatch:
        B, T = len(windows), max(len(w[0]) for w in windows)
        F = windows[0][2].shape[1]
        tokens = np.zeros((B, T), dtype=np.int64)
        labels = np.full((B, T), -1, dtype=np.int64)
        feats = np.zeros((B, T, F), dtype=np.float32)
        valid = np.zeros((B, T), dtype=bool)
        loss_mask = np.zeros((B, T), dtype=bool)
        K = next((w[4][0].shape[1] for w in windows if w[4] is not None), 0) if self.soft_labels else 0
        soft_ids = np.full((B, T, K), -1, dtype=np.int64)
        soft_logp = np.zeros((B, T, K), dtype=np.float32)
        for b, (tok, lab, fe, m, soft) in enumerate(windows):
            n = len(tok)
            tokens[b, :n], labels[b, :n], feats[b, :n], valid[b, :n], loss_mask[b, :n] = tok, lab, fe, True, m
            if K and soft is not None:
                soft_ids[b, :n], soft_logp[b, :n] = soft
        d = self.device
        return TrainBatch(torch.from_numpy(tokens).to(d), torch.from_numpy(labels).to(d),
                          torch.from_numpy(feats).to(d), torch.from_numpy(valid).to(d),
                          torch.from_numpy(loss_mask).to(d),
                          torch.from_numpy(soft_ids).to(d) if K else None,
                          torch.from_numpy(soft_logp).to(d) if K else None)
