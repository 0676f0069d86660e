"""A reranker's classifier head read from its GGUF (rank pooling, core/embedding.py).

llama.cpp's decoder rerankers are Qwen3 models converted with their "yes"/"no" rows of the output head
as `cls.output.weight` ([2, n_embd], labels in `{arch}.classifier.output_labels`), scored as the softmax's
first entry over the last token's hidden state. Only that decoder form is read here: another
architecture carrying classifier tensors is refused by name rather than scored by a guess at its head,
and so is a model without them.
"""

from __future__ import annotations

from functools import cache

from spekula.backends.gguf.weights import dequantize
from spekula.core.embedding import ClassifierHead
from spekula.core.errors import ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile

RANKING_ARCHS = ("qwen3",)  # decoders whose converted rerankers llama.cpp scores with a softmax head


@cache
def read_classifier_head(path: str) -> ClassifierHead | None:
    """The head of the reranker at `path`, None when the file has no `cls.output.weight`."""
    f = GGUFFile.shared(path)
    if not f.has_tensor("cls.output.weight"):
        return None
    arch = f.architecture
    if arch not in RANKING_ARCHS:
        raise ModelFileError(path, f"rank pooling is not supported for architecture {arch!r} "
                                   f"(supported: {', '.join(RANKING_ARCHS)} rerankers)")
    extra = [n for n in ("cls.weight", "cls.bias", "cls.output.bias") if f.has_tensor(n)]
    if extra:
        raise ModelFileError(path, f"a {arch} reranker with {', '.join(extra)} is not supported "
                                   "(only the output projection cls.output.weight)")
    out = dequantize(f.tensor("cls.output.weight"), f.path)
    n_embd = int(f.require(f"{arch}.embedding_length"))
    if out.ndim != 2 or out.shape[1] != n_embd:
        raise ModelFileError(path, f"cls.output.weight has shape {tuple(out.shape)}, expected [labels, {n_embd}]")
    labels = tuple(str(x) for x in (f.get(f"{arch}.classifier.output_labels") or ()))
    if labels and len(labels) != out.shape[0]:
        raise ModelFileError(path, f"{len(labels)} classifier labels for {out.shape[0]} cls.output rows")
    return ClassifierHead(out_weight=out, softmax=True, labels=labels)
