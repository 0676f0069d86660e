"""`--reasoning-budget N` / `--reasoning-budget-message`, and a chat request's `reasoning_budget_tokens` /
`thinking_budget_tokens` / `reasoning_budget_message` (Anthropic's `thinking.budget_tokens`), as llama-server
11434 reads them: -1 is unlimited (a request's -1 takes the server's), 0 ends reasoning at once, N > 0
lets N tokens of reasoning through and then forces the message and the end tag.

0: llama-server forces the end tag as the first tokens after the opening one; spekula asks the template
for no reasoning (`enable_thinking` false, the switch Qwen3's and DeepSeek V3.1's templates read) and,
when the prompt still opens reasoning (DeepSeek R1's, QwQ's), closes it at the end of the prompt, so the
reply starts after it as llama-server's does.

N > 0: the request carries a `ReasoningBudget` (core/modelfile/reasoning_budget.py, a constraint beside its
grammar, lossless under speculation) of the template's reasoning tags as llama.cpp names them: the start
tag, the end tags (the first is forced, after the message), tokenized with special tokens. A template
that does not reason gets none, as llama-server sets none.
"""

from __future__ import annotations

from typing import Any

from spekula.core.modelfile.reasoning_budget import ReasoningBudget
from spekula.frontends.schema.tool_formats.detect import reasoning_tags, template_family

UNLIMITED = -1
ANTHROPIC_DEFAULT_BUDGET = 10000  # llama-server's `thinking.budget_tokens` when a request leaves it out

# llama.cpp's own tags where a family's parser names more than <think> ... </think> (common/parsers/*.cpp)
_BUDGET_TAGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "harmony": ("<|channel|>analysis<|message|>", ("<|end|>",)),
    "deepseek_r1": ("<think>", ("</think>", "<｜tool▁calls▁begin｜>")),
    "deepseek_v31": ("<think>", ("</think>", "<｜tool▁calls▁begin｜>")),
    "xml": ("<think>", ("\n</think>", "</think>", "<tool_call>")),
}


class ReasoningBudgetError(ValueError):
    """A budget that is not an integer >= -1; the message names the field."""


def read_budget(value: Any, where: str) -> int:
    """The budget `value` given as `where`: -1, 0 or a positive number of tokens."""
    if isinstance(value, bool) or not isinstance(value, int) or value < -1 or value > 2**31 - 1:
        raise ReasoningBudgetError(f"{where} must be an integer >= -1")
    return value


def read_message(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ReasoningBudgetError(f"{where} must be a string")
    return value


BUDGET_FIELDS = frozenset({"reasoning_budget_tokens", "thinking_budget_tokens", "reasoning_budget_message"})


def read_budget_fields(obj: dict[str, Any]) -> tuple[int, str | None]:
    """A request's budget (reasoning_budget_tokens before thinking_budget_tokens, as llama-server reads them;
    -1: the server's) and message (None: the server's)."""
    budget = UNLIMITED
    for name in ("thinking_budget_tokens", "reasoning_budget_tokens"):
        if obj.get(name) is not None and (value := read_budget(obj[name], f"'{name}'")) != UNLIMITED:
            budget = value
    message = obj.get("reasoning_budget_message")
    return budget, None if message is None else read_message(message, "'reasoning_budget_message'")


def closed_reasoning(prompt: str, opener: str, closer: str) -> str:
    """`prompt` with the reasoning it opens at its end closed (a budget of 0)."""
    return prompt + closer if opener in prompt and prompt.rstrip().endswith(opener) else prompt


def without_open_reasoning(tokenizer: Any, prompt: str) -> str:
    """`prompt` rendered by `tokenizer`'s template, its open reasoning closed (a budget of 0)."""
    return closed_reasoning(prompt, *reasoning_tags(template_family(getattr(tokenizer, "chat_template", None) or "")))


def budget_tags(template: str) -> tuple[str, tuple[str, ...]] | None:
    """The start tag and end tags of `template`'s reasoning (None: it does not reason)."""
    family = template_family(template)
    if family in _BUDGET_TAGS:
        start, ends = _BUDGET_TAGS[family]
        return (start, ends) if family == "harmony" or start in template else None
    opener, closer = reasoning_tags(family)
    return (opener, (closer,)) if opener in template else None


def token_budget(tokenizer: Any, budget: int, message: str) -> ReasoningBudget | None:
    """The `ReasoningBudget` a positive `budget` puts on a chat request for `tokenizer`'s template (None: the
    budget is not positive, or the template does not reason)."""
    tags = budget_tags(getattr(tokenizer, "chat_template", None) or "") if budget > 0 else None
    if tags is None:
        return None

    def ids(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special=False, parse_special=True))

    start, ends = tags
    end_ids = tuple(e for e in map(ids, ends) if e)
    return ReasoningBudget(budget, ids(start), end_ids, (*(ids(message) if message else ()), *end_ids[0]))
