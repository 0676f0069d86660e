"""`--reasoning-budget N` and a request's `reasoning_budget_tokens` / `thinking_budget_tokens`, as
llama-server 11434 reads them: -1 is unlimited (a request's -1 takes the server's), 0 ends reasoning at
once. llama-server forces the end-of-reasoning tag as the first tokens after the opening one; spekula
asks the template for no reasoning (`enable_thinking` false, the switch Qwen3's and DeepSeek V3.1's
templates read) and, when the prompt still opens reasoning (DeepSeek R1's, QwQ's), closes it at the
end of the prompt, so the reply starts after it as llama-server's does. A positive budget (llama-server
counts the reasoning's tokens and then forces the tag) is not built and is refused, naming it.
"""

from __future__ import annotations

from typing import Any

UNLIMITED = -1
NOT_BUILT = ("a positive reasoning budget (llama-server ends reasoning after N tokens by forcing its end tag) "
             "is not built; -1 (unlimited) and 0 (no reasoning) are")


class ReasoningBudgetError(ValueError):
    """A budget that is not -1 or 0; the message names the field."""


def read_budget(value: Any, where: str) -> int:
    """The budget `value` given as `where`: -1 or 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ReasoningBudgetError(f"{where} must be an integer >= -1")
    if value > 0:
        raise ReasoningBudgetError(f"{where} = {value}: {NOT_BUILT}")
    return value


def closed_reasoning(prompt: str, opener: str, closer: str) -> str:
    """`prompt` with the reasoning it opens at its end closed (a budget of 0)."""
    return prompt + closer if opener in prompt and prompt.rstrip().endswith(opener) else prompt
