"""Render a model's Jinja chat template the way Hugging Face transformers does.

Same environment as ``transformers``' ``apply_chat_template`` (modelfile/jinja_sandbox.py, imported by
the first template checked or rendered, so naming these helpers costs no jinja2 import). Models
without a template get ChatML, with a warning, because that is what the tiny fixtures and most small
instruct models use.
"""

from __future__ import annotations

from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import structlog

from spekula.core.errors import SpekulaError
from spekula.core.modelfile.argument_caps import takes_object_arguments, text_arguments
from spekula.core.modelfile.content_caps import content_caps, join_text_parts, shaped_messages
from spekula.core.modelfile.family_messages import family_messages
from spekula.core.modelfile.named_templates import NAMED_TEMPLATES as _BUILT_IN

if TYPE_CHECKING:
    import jinja2

log = structlog.get_logger(__name__)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(SpekulaError):
    """The chat template is invalid, or refuses the given messages."""


def _default_variables() -> dict[str, Any]:
    """Variables every render gets unless the caller sets them, as llama-server sets them: thinking
    on (templates such as Qwen3's switch it off with enable_thinking=false) and today's date in the
    two forms Llama 3 and Firefunction templates print."""
    today = datetime.now()
    return {"tools": None, "documents": None, "enable_thinking": True,
            "date_string": today.strftime("%d %b %Y"), "datetime": today.strftime("%b %d %Y")}


# Checks in two templates that llama-server switches off (common/chat.cpp) because they refuse messages
# it sends: gpt-oss's refusal of an assistant content holding channel markers, and Ministral 3's of an
# assistant message with neither content nor tool calls.
_DISABLED_CHECKS = (
    ("<|channel|>", '{%- if "<|channel|>analysis<|message|>" in message.content or '
                    '"<|channel|>final<|message|>" in message.content %}'),
    ("[TOOL_CALLS]", "{%- if (message['content'] is none or message['content'] == '' or "
                     "message['content']|length == 0) and (message['tool_calls'] is not defined or "
                     "message['tool_calls'] is none or message['tool_calls']|length == 0) %}"),
)


def llamacpp_patched(source: str) -> str:
    """`source` with the checks llama-server disables replaced by ``{%- if false %}``, as it does."""
    for marker, check in _DISABLED_CHECKS:
        if marker in source and check in source:
            source = source.replace(check, "{%- if false %}")
    return source


def _checked(source: str) -> jinja2.Template:
    """The compiled template, or ChatTemplateError saying where it does not parse."""
    from spekula.core.modelfile.jinja_sandbox import TemplateParseError, compile_template

    try:
        return compile_template(source)
    except TemplateParseError as exc:
        raise ChatTemplateError(f"chat template does not parse (line {exc.lineno}): {exc.message}") from None


def render_chat(
    template: str | None,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **extra: Any,
) -> str:
    """Render `messages` with `template` (None or empty: ChatML). A content may be a string or a list of
    ``{"type": "text", "text": ...}`` parts; each reaches the template in the form it takes
    (modelfile/content_caps.py), and so do a call's arguments (an object, or JSON text:
    modelfile/argument_caps.py). Raises ChatTemplateError on failure."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ChatTemplateError("messages must be a list of {'role': ..., 'content': ...} objects")
    if not template:
        log.warning("model has no chat template; using ChatML")
        template = CHATML_TEMPLATE
    from spekula.core.modelfile.jinja_sandbox import TemplateRaised

    compiled = _checked(llamacpp_patched(template))
    context = {**_default_variables(), **extra}
    shaped = shaped_messages(messages, content_caps(template))
    if any(m.get("tool_calls") for m in shaped) and not takes_object_arguments(template):
        shaped = text_arguments(shaped)
    try:
        return compiled.render(
            messages=family_messages(template, shaped),
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **context,
        )
    except TemplateRaised as exc:
        raise ChatTemplateError(f"chat template rejected the messages: {exc}") from None
    except Exception as exc:  # any failure inside someone else's template is a bad-input error, not a crash
        raise ChatTemplateError(f"chat template failed to render ({type(exc).__name__}: {exc})") from None


_PROBE_TOOL = "spekula_probe_tool_4f2a"


@lru_cache(maxsize=16)
def renders_tools(template: str | None) -> bool:
    """Whether the template writes a request's tools into the prompt, told as llama.cpp tells it (jinja
    caps): a tool's name appears when a chat is rendered with it. ChatML (no template) does not."""
    if not template:
        return False
    probe = [{"type": "function", "function": {"name": _PROBE_TOOL, "description": "",
                                               "parameters": {"type": "object", "properties": {}}}}]
    try:
        return _PROBE_TOOL in render_chat(template, [{"role": "user", "content": "x"}], tools=probe)
    except ChatTemplateError:
        return False


# Templates known by name: llama.cpp's built-in formats (modelfile/named_templates.py) and ChatML.
NAMED_TEMPLATES = {"chatml": CHATML_TEMPLATE, **_BUILT_IN}


def template_override(name_or_source: str | None, path: str | None) -> str | None:
    """The chat template to use instead of the model's: `--chat-template` (a name of NAMED_TEMPLATES or
    Jinja source) or `--chat-template-file`; None when neither is given. Checked to parse."""
    if name_or_source and path:
        raise ChatTemplateError("give --chat-template or --chat-template-file, not both")
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                source = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ChatTemplateError(f"--chat-template-file {path}: cannot read it ({exc})") from None
    elif name_or_source:
        source = NAMED_TEMPLATES.get(name_or_source, name_or_source)
        if source is name_or_source and "{{" not in source and "{%" not in source:
            # llama-server (Jinja mode) takes any such string as a template of literal text; so does
            # spekula, but a mistyped name deserves a word in the log.
            log.warning("--chat-template is not a known name and has no Jinja tags: every prompt will be "
                        "this literal text", value=name_or_source[:80], names=", ".join(sorted(NAMED_TEMPLATES)))
    else:
        return None
    _checked(source)
    return source


def with_prefill(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """An assistant message at the end is the start of the answer (a prefill): the template renders the
    messages before it with the generation prompt, and its text follows. Returns (messages to render,
    text to append, text parts joined by a blank line as llama-server joins them); the text is empty when
    the last message is not the assistant's."""
    if not messages or messages[-1].get("role") != "assistant":
        return messages, ""
    if len(messages) >= 2 and messages[-2].get("role") == "assistant":
        raise ChatTemplateError("Cannot have 2 or more assistant messages at the end of the list.")
    return messages[:-1], join_text_parts(messages[-1].get("content"), "\n\n")


def chat_prompt(tokenizer: Any, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                continue_final: bool = False, prefill: bool = True, **extra: Any) -> str:
    """The prompt text of a chat through the tokenizer's template. A final assistant message is continued
    (see `with_prefill`) rather than closed and followed by a new assistant turn: always with
    `continue_final` (vLLM's `continue_final_message`, which insists on one), and by default (`prefill`,
    llama-server's --prefill-assistant) whenever the chat ends with one."""
    ends_with_assistant = bool(messages) and messages[-1].get("role") == "assistant"
    if continue_final and not ends_with_assistant:
        raise ChatTemplateError("'continue_final_message' needs the last message to be the assistant's")
    if ends_with_assistant and (continue_final or prefill):
        head, text = with_prefill(messages)
        source = getattr(tokenizer, "chat_template", None)
        if isinstance(source, str) and is_xml_tool_call_template(source):
            opening = xml_tool_call_continuation(source, messages[-1])
            return str(tokenizer.apply_chat_template(head, add_generation_prompt=False, **extra)) + opening
        return str(tokenizer.apply_chat_template(head, add_generation_prompt=True, **extra)) + text
    return str(tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra))


def is_xml_tool_call_template(source: str) -> bool:
    """Whether llama.cpp takes `source` for its Qwen3-Coder format (XML tool calls, ``<function=name>``
    and ``<parameter=name>`` on lines of their own: Qwen3-Coder, Qwen3.5, Nemotron Nano 3)."""
    return ("<tool_call>" in source and "<function=" in source and "<parameter=" in source
            and "'<tool_call><function=' ~ tool_call.name ~ '>'" not in source)


def xml_tool_call_continuation(source: str, final: dict[str, Any]) -> str:
    """How llama.cpp continues a final assistant message under a Qwen3-Coder-format template: the turn's
    opening, then (templates that think) its reasoning inside an open ``<think>``, closed only when the
    message has content, which follows. The template renders the messages before it without a generation
    prompt, so thinking is open whether or not `enable_thinking` is set."""
    content, reasoning = join_text_parts(final.get("content"), "\n\n"), str(final.get("reasoning_content") or "")
    continues_reasoning = bool(reasoning) and not content  # llama-server's "auto" continuation
    opening = "<|im_start|>assistant\n"
    if "<think>" in source:
        opening += "<think>\n" + reasoning + ("" if continues_reasoning else "\n</think>\n\n")
    return opening + content


# Variables every render sets itself; chat_template_kwargs may not replace them.
_RESERVED_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools", "documents", "bos_token", "eos_token"})


def template_variables(value: Any, where: str) -> dict[str, Any]:
    """`chat_template_kwargs` (a request field, or --chat-template-kwargs): extra variables for the
    template, such as Qwen3's `enable_thinking`. A JSON object whose keys are not the render's own."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ChatTemplateError(f"{where} must be a JSON object of template variables")
    reserved = sorted(set(value) & _RESERVED_VARIABLES)
    if reserved:
        raise ChatTemplateError(f"{where}: {', '.join(reserved)} is set by the request itself, not as a template variable")
    if isinstance(value.get("enable_thinking"), str):
        # a template's `enable_thinking is false` would take "false" for thinking on; llama-server refuses it
        raise ChatTemplateError(f'{where}: invalid type for "enable_thinking" (expected boolean, got string)')
    return dict(value)
