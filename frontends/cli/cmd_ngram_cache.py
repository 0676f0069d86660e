"""`spekula ngram-cache build CORPUS... -o FILE [-m MODEL]`: a static lookup cache for ngram-cache.

Like llama.cpp's `llama-lookup-create`: each corpus file is tokenized with the model's tokenizer
(special tokens added and parsed, as llama.cpp's common_tokenize(…, true, true) does) and every
2-gram -> next-token count goes into one cache, written in llama.cpp's binary format. The result
is used with `--spec-type ngram-cache --lookup-cache-static FILE` here or `-lcs FILE` in llama.cpp.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spekula.drafters.draftless.ngram_cache_file import NgramCache

HELP = "Build an ngram-cache static lookup file from a text corpus"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="ngram_cache_action", metavar="ACTION", required=True)
    build = sub.add_parser("build", help=HELP, description=HELP)
    build.add_argument(
        "corpus", nargs="+", metavar="CORPUS", help="UTF-8 text files (each tokenized separately)"
    )
    build.add_argument("-o", "--output", required=True, metavar="FILE", help="the lookup cache file to write")
    build.add_argument(
        "-m",
        "--model",
        metavar="GGUF",
        help="model whose tokenizer to use (default: the embedded SmolLM2-135M-Instruct)",
    )
    build.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")


def _read_text(path: Path) -> str:
    from spekula.core.errors import SpekulaError

    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise SpekulaError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise SpekulaError(f"{path}: cannot read ({exc.strerror or exc})") from None


def build_cache(corpus: list[Path], encode: Callable[..., list[int]]) -> tuple[NgramCache, int]:
    """Count the 2-grams of every file with `encode` (a Tokenizer.encode); (cache, tokens read)."""
    import numpy as np

    from spekula.drafters.draftless.ngram_cache_file import count_static_ngrams, merge_cache

    cache: NgramCache = {}
    n_tokens = 0
    for path in corpus:
        ids = encode(_read_text(path), add_special=True, parse_special=True)
        n_tokens += len(ids)
        merge_cache(cache, count_static_ngrams(np.asarray(ids, dtype=np.int64)))
    return cache, n_tokens


def run(args: argparse.Namespace) -> int:
    from spekula.core.modelfile.gguf_file import GGUFFile
    from spekula.core.modelfile.tokenizer import Tokenizer
    from spekula.drafters.draftless.ngram_cache_file import cache_size, save_cache

    if args.ngram_cache_action != "build":  # argparse allows only "build"; kept for a clear message
        print(f"spekula ngram-cache: unknown action {args.ngram_cache_action!r}", file=sys.stderr)
        return 2
    corpus = [Path(c) for c in args.corpus]
    if args.model:
        model = Path(args.model)
    else:
        from spekula.backends.gguf.default_model import ensure_default_model

        model = ensure_default_model(quiet=args.quiet)
    tokenizer = Tokenizer.from_gguf(GGUFFile(model))
    cache, n_tokens = build_cache(corpus, tokenizer.encode)
    save_cache(cache, args.output)
    if not args.quiet:
        n_ngrams, total = cache_size(cache)
        print(
            f"{args.output}: {n_ngrams} 2-grams, {total} counts from {n_tokens} tokens "
            f"in {len(corpus)} file(s), tokenizer of {model.name}",
            file=sys.stderr,
        )
    return 0
