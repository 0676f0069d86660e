"""Fill-in-the-middle prompts: the code before and after the cursor, laid out for a code model.

The layout is llama-server's /infill one (the repository-level pattern of Qwen2.5-Coder), so a
client such as llama.vim or llama.vscode gets the same prompt from spekula:

    [FIM_REP]myproject\\n [FIM_SEP]file0\\n text0 ... [FIM_SEP]filename\\n
    [BOS] [FIM_PRE] prefix prompt [FIM_SUF] suffix [FIM_MID]

The extra files (`input_extra`) come first, or with no FIM_SEP token each after a plain "--- snippet
---" line; the last of them are kept when they do not all fit. Prefix and suffix are cut to fit one
batch, three quarters for the end of the prefix and the rest for the start of the suffix. With `spm`
(suffix-prefix-middle models) the suffix part comes before the prefix part.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from spekula.core.errors import SpekulaError

REPO_NAME = "myproject\n"  # the repository line llama-server writes (it takes no name from the request)
CURRENT_FILE = "filename\n"  # and the current file's name line
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"  # between extra files when the model has no FIM_SEP


class InfillError(SpekulaError):
    """The model cannot fill in the middle."""


@dataclass(frozen=True, slots=True)
class ExtraFile:
    filename: str
    text: str


def check_model(fim: dict[str, int]) -> None:
    """Raise InfillError naming the tokens a fill-in-the-middle prompt needs and the model lacks."""
    missing = [what for key, what in (("fim_pre", "prefix"), ("fim_suf", "suffix"), ("fim_mid", "middle"))
               if key not in fim]
    if missing:
        raise InfillError("Infill is not supported by this model: "
                          + " ".join(f"{what} token is missing." for what in missing))


def infill_prompt(fim: dict[str, int], encode: Callable[[str], list[int]], *, prefix: Sequence[int],
                  suffix: Sequence[int], extra: Sequence[ExtraFile], prompt: Sequence[int], n_batch: int,
                  n_predict: int, n_ctx: int, bos: int | None, spm: bool = False) -> list[int]:
    """The token ids of one fill-in-the-middle request. `fim` holds the model's FIM tokens (check
    them with `check_model` first), `encode` tokenizes plain text without special tokens, `bos` is
    the BOS id when the model adds one, `n_predict` the server's default (-1: no limit)."""
    check_model(fim)
    head: list[int] = []
    if "fim_rep" in fim:
        head += [fim["fim_rep"], *encode(REPO_NAME)]
    for chunk in extra:
        if "fim_sep" in fim:
            head += [fim["fim_sep"], *encode(chunk.filename + "\n")]
        else:
            head += encode(SNIPPET_SEPARATOR)
        head += encode(chunk.text)
    if "fim_sep" in fim:
        head += [fim["fim_sep"], *encode(CURRENT_FILE)]

    n_prefix = min(len(prefix), 3 * (n_batch // 4))
    n_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))
    n_head = min(max(0, n_ctx - n_batch - 2 * n_predict), len(head))
    before = [fim["fim_pre"], *prefix[len(prefix) - n_prefix:], *prompt]
    after = [fim["fim_suf"], *suffix[:n_suffix]]
    first, second = (after, before) if spm else (before, after)
    return [*head[len(head) - n_head:], *([bos] if bos is not None else []), *first, *second, fim["fim_mid"]]
