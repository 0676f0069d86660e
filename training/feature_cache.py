"""Self-distilled training data on disk: token sequences, the target's greedy labels, its hidden states.

A cache is one folder:

* ``manifest.json``: format version, the recipe that made it (target fingerprint, captured layers,
  prompt digest, generation settings), the shards written so far (how many prompts each consumed,
  their sizes and sha256), and ``exhausted`` once every prompt of the recipe has been answered;
* per shard ``shard-NNNNN.npz`` (tokens, labels, sequence offsets, answer starts: small; with soft
  labels also the target's top-K token ids and their log-probabilities at every position) and
  ``shard-NNNNN.features.npy`` (float16 ``[n_tokens, len(layers) * n_embd]``: the bulk, memory-mapped).

Shards are written to a temporary name, fsynced and renamed, and the manifest is replaced atomically
after each one, so an interrupted distillation (Ctrl-C, full disk) keeps every finished shard and the
next run continues after them. Opening verifies every file's size and digest: a damaged cache is an
error naming the file, never silently different training data.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from spekula.backends.onnx.cache import sha256_file
from spekula.core.errors import SpekulaError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class CacheError(SpekulaError):
    """A feature cache is damaged, or belongs to another recipe."""


@dataclass(slots=True)
class DistilledSequence:
    """One distilled sequence: the chat-templated prompt and the target's answer."""

    tokens: np.ndarray  # int32 [T]: every token the target read
    labels: np.ndarray  # int32 [T]: the target's greedy next token after reading tokens[:t+1]
    features: np.ndarray  # float16 [T, len(layers) * n_embd]
    answer_start: int  # index of the first answer token in `tokens`
    # Soft labels (caches distilled with a top-K): the target's K likeliest next tokens after reading
    # tokens[:t+1], most likely first, and their log-probabilities under its full softmax.
    soft_ids: np.ndarray | None = None  # int32 [T, K]
    soft_logp: np.ndarray | None = None  # float16 [T, K]


def _fsync_replace(tmp: Path, final: Path) -> None:
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class FeatureCacheWriter:
    """Appends shards to a cache folder whose recipe matches; reopening continues after the last shard."""

    def __init__(self, root: Path, recipe: dict[str, Any], n_features: int, soft_top_k: int = 0) -> None:
        self.root = root
        self.recipe = recipe
        self.n_features = n_features
        self.soft_top_k = soft_top_k
        root.mkdir(parents=True, exist_ok=True)
        path = root / MANIFEST
        if path.exists():
            manifest = _read_manifest(root)
            if manifest["recipe"] != recipe:
                raise CacheError(f"{root} holds data of another recipe; choose another --cache-dir or delete it")
            # Verify what is there before appending to it (a damaged shard would otherwise stay).
            self.verified: FeatureCache | None = FeatureCache(root, manifest)
            self.manifest = manifest
        else:
            self.verified = None
            self.manifest = {"version": FORMAT_VERSION, "recipe": recipe, "n_features": n_features,
                             "shards": [], "exhausted": False}
            _write_json(path, self.manifest)

    @property
    def n_tokens(self) -> int:
        return sum(int(s["n_tokens"]) for s in self.manifest["shards"])

    @property
    def n_sequences(self) -> int:
        return sum(int(s["n_sequences"]) for s in self.manifest["shards"])

    @property
    def n_prompts(self) -> int:
        """Prompts consumed so far (answered, or skipped as too long), in prompt order."""
        return sum(int(s["n_prompts"]) for s in self.manifest["shards"])

    def write_shard(self, seqs: Sequence[DistilledSequence], *, n_prompts: int) -> None:
        """Append one shard holding the answers to the next ``n_prompts`` prompts."""
        index = len(self.manifest["shards"])
        stem = f"shard-{index:05d}"
        lengths = np.array([len(s.tokens) for s in seqs], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        tokens = np.concatenate([s.tokens for s in seqs] or [np.zeros(0, np.int32)]).astype(np.int32)
        labels = np.concatenate([s.labels for s in seqs] or [np.zeros(0, np.int32)]).astype(np.int32)
        feats = np.concatenate([s.features for s in seqs] or [np.zeros((0, self.n_features), np.float16)]
                               ).astype(np.float16)
        if feats.shape != (len(tokens), self.n_features) or labels.shape != tokens.shape:
            raise ValueError(f"shard arrays disagree: tokens {tokens.shape}, labels {labels.shape}, "
                             f"features {feats.shape}, expected width {self.n_features}")
        soft: dict[str, np.ndarray] = {}
        if self.soft_top_k:
            K = self.soft_top_k
            ids, logp = [np.zeros((0, K), np.int32)], [np.zeros((0, K), np.float16)]
            for s in seqs:
                if s.soft_ids is None or s.soft_logp is None:
                    raise ValueError("this cache keeps soft labels; a sequence came without them")
                ids.append(s.soft_ids)
                logp.append(s.soft_logp)
            soft = {"soft_ids": np.concatenate(ids).astype(np.int32), "soft_logp": np.concatenate(logp).astype(np.float16)}
            if soft["soft_ids"].shape != (len(tokens), K) or soft["soft_logp"].shape != (len(tokens), K):
                raise ValueError(f"soft labels {soft['soft_ids'].shape} do not fit {len(tokens)} tokens x top-{K}")
        meta_tmp = self.root / f"{stem}.npz.tmp"
        feat_tmp = self.root / f"{stem}.features.npy.tmp"
        try:
            with meta_tmp.open("wb") as f:
                np.savez(f, tokens=tokens, labels=labels, offsets=offsets,
                         answer_start=np.array([s.answer_start for s in seqs], dtype=np.int32), **soft)
            with feat_tmp.open("wb") as f:
                np.save(f, feats)
            _fsync_replace(meta_tmp, self.root / f"{stem}.npz")
            _fsync_replace(feat_tmp, self.root / f"{stem}.features.npy")
        except BaseException:
            for tmp in (meta_tmp, feat_tmp):
                tmp.unlink(missing_ok=True)
            raise
        self.verified = None  # the view opened before this shard no longer covers the folder
        entry = {"stem": stem, "n_prompts": int(n_prompts), "n_sequences": len(seqs), "n_tokens": int(len(tokens))}
        for suffix in (".npz", ".features.npy"):
            p = self.root / f"{stem}{suffix}"
            entry[suffix] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
        self.manifest["shards"].append(entry)
        _write_json(self.root / MANIFEST, self.manifest)

    def note_exhausted(self) -> None:
        """Every prompt has been answered: a larger token goal needs more prompts, not more time."""
        self.manifest["exhausted"] = True
        _write_json(self.root / MANIFEST, self.manifest)


def _read_manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CacheError(f"{path}: unreadable feature-cache manifest ({exc}); delete the folder to rebuild it") from None
    if not isinstance(manifest, dict) or manifest.get("version") != FORMAT_VERSION or \
            not isinstance(manifest.get("shards"), list) or not isinstance(manifest.get("recipe"), dict):
        raise CacheError(f"{path}: not a feature-cache manifest of format {FORMAT_VERSION}; delete the folder to rebuild it")
    return manifest


class FeatureCache:
    """A verified, read-only view of a cache: sequences by index, features memory-mapped."""

    def __init__(self, root: Path, manifest: dict[str, Any] | None = None) -> None:
        self.root = root
        self.manifest = manifest if manifest is not None else _read_manifest(root)
        self.n_features = int(self.manifest["n_features"])
        self._tokens: list[np.ndarray] = []
        self._labels: list[np.ndarray] = []
        self._feats: list[np.ndarray] = []
        self._soft: list[tuple[np.ndarray, np.ndarray] | None] = []
        self._index: list[tuple[int, int, int, int]] = []  # (shard, begin, end, answer_start)
        for si, entry in enumerate(self.manifest["shards"]):
            stem = str(entry["stem"])
            for suffix in (".npz", ".features.npy"):
                p = root / f"{stem}{suffix}"
                want = entry[suffix]
                if not p.is_file() or p.stat().st_size != int(want["size"]) or sha256_file(p) != want["sha256"]:
                    raise CacheError(f"{p}: damaged or missing feature-cache shard; delete {root} to rebuild it")
            try:
                with np.load(root / f"{stem}.npz") as z:
                    tokens, labels, offsets, starts = z["tokens"], z["labels"], z["offsets"], z["answer_start"]
                    soft = (z["soft_ids"], z["soft_logp"]) if "soft_ids" in z.files else None
                feats = np.load(root / f"{stem}.features.npy", mmap_mode="r")
            except (OSError, ValueError, KeyError) as exc:
                raise CacheError(f"{root / stem}: unreadable shard ({exc}); delete {root} to rebuild it") from None
            if feats.shape != (len(tokens), self.n_features) or len(offsets) != len(starts) + 1 or \
                    (soft is not None and (soft[0].shape != soft[1].shape or len(soft[0]) != len(tokens))):
                raise CacheError(f"{root / stem}: shard arrays disagree; delete {root} to rebuild it")
            self._soft.append(soft)
            self._tokens.append(tokens)
            self._labels.append(labels)
            self._feats.append(feats)
            for k in range(len(starts)):
                self._index.append((si, int(offsets[k]), int(offsets[k + 1]), int(starts[k])))

    @property
    def recipe(self) -> dict[str, Any]:
        return dict(self.manifest["recipe"])

    @property
    def has_soft_labels(self) -> bool:
        """Whether every shard keeps the target's top-K next tokens (an empty cache has none)."""
        return bool(self._soft) and all(s is not None for s in self._soft)

    @property
    def exhausted(self) -> bool:
        return bool(self.manifest.get("exhausted"))

    @property
    def n_tokens(self) -> int:
        return sum(e - b for _, b, e, _ in self._index)

    def __len__(self) -> int:
        return len(self._index)

    def lengths(self) -> np.ndarray:
        return np.array([e - b for _, b, e, _ in self._index], dtype=np.int64)

    def __getitem__(self, i: int) -> DistilledSequence:
        si, b, e, start = self._index[i]
        soft = self._soft[si]
        return DistilledSequence(self._tokens[si][b:e], self._labels[si][b:e], self._feats[si][b:e], start,
                                 None if soft is None else soft[0][b:e], None if soft is None else soft[1][b:e])

    def label_counts(self, n_vocab: int) -> np.ndarray:
        """How often each token is the target's label (what a reduced draft vocabulary is chosen by)."""
        counts = np.zeros(n_vocab, dtype=np.int64)
        for labels in self._labels:
            counts += np.bincount(labels[(labels >= 0) & (labels < n_vocab)], minlength=n_vocab)[:n_vocab]
        return counts

    def token_counts(self, n_vocab: int) -> np.ndarray:
        """How often each token occurs in the sequences (what the DFlash mask token must avoid)."""
        counts = np.zeros(n_vocab, dtype=np.int64)
        for tokens in self._tokens:
            counts += np.bincount(tokens[(tokens >= 0) & (tokens < n_vocab)], minlength=n_vocab)[:n_vocab]
        return counts
