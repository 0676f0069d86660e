"""Chat formats known by name, for `--chat-template NAME`: the formats llama.cpp builds into its C++ for
models whose GGUF lacks a template (or carries a broken one), written here as Jinja so they go through
the one renderer every model template uses.

Each renders exactly what llama.cpp's built-in formatter of the same name produces for plain
{role, content} messages. Their shared quirks are llama.cpp's: several formats have no assistant
opening and ignore `add_generation_prompt` (the llama 2 and Mistral families, MiniCPM, Orion, Hunyuan),
some trim message text of ASCII whitespace, and roles a format does not know are dropped or passed
through as that formatter does. tests/test_named_templates.py checks them against the expected outputs
in llama.cpp's own chat-template test.
"""

from __future__ import annotations

# C's isspace() set, which llama.cpp trims; Jinja's bare `trim` would also strip Unicode spaces.
_TRIM = r"trim(' \t\n\r\x0b\x0c')"


def _each(body: str, generation: str = "", before: str = "") -> str:
    """A template that renders `before`, `body` per message (as `m`, its text as `c`), then `generation`
    when a generation prompt is asked for."""
    gen = f"{{% if add_generation_prompt %}}{{{{ {generation} }}}}{{% endif %}}" if generation else ""
    head = f"{{{{ {before} }}}}" if before else ""
    return f"{head}{{% for m in messages %}}{{% set c = m.content %}}{body}{{% endfor %}}{gen}"


def _by_role(cases: dict[str, str], default: str | None = None) -> str:
    """One expression per role; roles not listed render `default` (nothing when None)."""
    parts = []
    for i, (role, expr) in enumerate(cases.items()):
        parts.append(f"{{% {'if' if i == 0 else 'elif'} m.role == '{role}' %}}{{{{ {expr} }}}}")
    if default is not None:
        parts.append(f"{{% else %}}{{{{ {default} }}}}")
    return "".join(parts) + "{% endif %}"


def _llama2(system: bool, bos_inside: bool, strip: bool) -> str:
    # A turn opens before the first message and again after each assistant (or other) message.
    text = f"m.content | {_TRIM}" if strip else "m.content"
    opener = "'<s>[INST] '" if bos_inside else "'[INST] '"
    sys_expr = r"'<<SYS>>\n' + c + '\n<</SYS>>\n\n'" if system else r"c + '\n'"
    return ("{{ '[INST] ' }}{% for m in messages %}" f"{{% set c = {text} %}}"
            "{% if not loop.first and loop.previtem.role not in ['system', 'user'] %}"
            f"{{{{ {opener} }}}}{{% endif %}}"
            + _by_role({"system": sys_expr, "user": "c + ' [/INST]'"}, "c + '</s>'")
            + "{% endfor %}")


def _mistral(leading: str, trailing: str, trim_assistant: bool) -> str:
    reply = f"(c | {_TRIM})" if trim_assistant else "c"
    return ("{% for m in messages %}{% set c = m.content %}"
            "{% if loop.first or loop.previtem.role not in ['system', 'user'] %}"
            f"{{{{ '{leading}[INST]{trailing}' }}}}{{% endif %}}"
            + _by_role({"system": r"c + '\n\n'", "user": f"c + '{leading}[/INST]'"},
                       f"'{trailing}' + {reply} + '</s>'")
            + "{% endfor %}")


def _mistral_v7(space: str) -> str:
    return _each(_by_role({"system": f"'[SYSTEM_PROMPT]{space}' + c + '[/SYSTEM_PROMPT]'",
                           "user": f"'[INST]{space}' + c + '[/INST]'"}, f"'{space}' + c + '</s>'"))


def _header(open_: str, close: str, end: str, trim: bool = False) -> str:
    """Formats of the shape <open>role<close>text<end>, the generation prompt <open>assistant<close>."""
    text = f"(c | {_TRIM})" if trim else "c"
    return _each(f"{{{{ '{open_}' + m.role + '{close}' + {text} + '{end}' }}}}", f"'{open_}assistant{close}'")


_T = _TRIM
_BAILING_ROLE = "('HUMAN' if m.role == 'user' else m.role | upper)"

# ChatML, the default for models without a template, lives in modelfile/chat_template.py beside these.
NAMED_TEMPLATES: dict[str, str] = {
    "llama2": _llama2(system=False, bos_inside=False, strip=False),
    "llama2-sys": _llama2(system=True, bos_inside=False, strip=False),
    "llama2-sys-bos": _llama2(system=True, bos_inside=True, strip=False),
    "llama2-sys-strip": _llama2(system=True, bos_inside=False, strip=True),
    "mistral-v1": _mistral(" ", " ", trim_assistant=False),
    "mistral-v3": _mistral("", " ", trim_assistant=True),
    "mistral-v3-tekken": _mistral("", "", trim_assistant=False),
    "mistral-v7": _mistral_v7(" "),
    "mistral-v7-tekken": _mistral_v7(""),
    "phi3": _header("<|", r"|>\n", r"<|end|>\n"),
    "phi4": _header("<|im_start|>", "<|im_sep|>", "<|im_end|>"),
    "falcon3": _header("<|", r"|>\n", r"\n"),
    "zephyr": _header("<|", r"|>\n", r"<|endoftext|>\n"),
    "monarch": _each(r"{{ ('' if loop.first else '<s>') + m.role + '\n' + c + '</s>\n' }}", r"'<s>assistant\n'"),
    # Gemma has no system role: system text (trimmed, concatenated) opens the next non-model turn.
    "gemma": ("{% set ns = namespace(sys='') %}{% for m in messages %}"
              f"{{% if m.role == 'system' %}}{{% set ns.sys = ns.sys + (m.content | {_T}) %}}{{% else %}}"
              "{% set role = 'model' if m.role == 'assistant' else m.role %}"
              r"{{ '<start_of_turn>' + role + '\n' }}"
              r"{% if ns.sys and role != 'model' %}{{ ns.sys + '\n\n' }}{% set ns.sys = '' %}{% endif %}"
              f"{{{{ (m.content | {_T}) + '<end_of_turn>' + '\\n' }}}}{{% endif %}}{{% endfor %}}"
              r"{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"),
    "orion": ("{% set ns = namespace(sys='') %}{% for m in messages %}"
              "{% if m.role == 'system' %}{% set ns.sys = ns.sys + m.content %}"
              r"{% elif m.role == 'user' %}{{ 'Human: ' }}{% if ns.sys %}{{ ns.sys + '\n\n' }}{% set ns.sys = '' %}"
              r"{% endif %}{{ m.content + '\n\nAssistant: </s>' }}"
              "{% else %}{{ m.content + '</s>' }}{% endif %}{% endfor %}"),
    "openchat": _each(_by_role({"system": "c + '<|end_of_turn|>'"},
                               "'GPT4 Correct ' + (m.role[:1] | upper) + m.role[1:] + ': ' + c + '<|end_of_turn|>'"),
                      "'GPT4 Correct Assistant:'"),
    "vicuna": _each(_by_role({"system": r"c + '\n\n'", "user": r"'USER: ' + c + '\n'",
                              "assistant": r"'ASSISTANT: ' + c + '</s>\n'"}), "'ASSISTANT:'"),
    "vicuna-orca": _each(_by_role({"system": r"'SYSTEM: ' + c + '\n'", "user": r"'USER: ' + c + '\n'",
                                   "assistant": r"'ASSISTANT: ' + c + '</s>\n'"}), "'ASSISTANT:'"),
    "deepseek": _each(_by_role({"system": "c", "user": r"'### Instruction:\n' + c + '\n'",
                                "assistant": r"'### Response:\n' + c + '\n<|EOT|>\n'"}), r"'### Response:\n'"),
    "deepseek2": _each(_by_role({"system": r"c + '\n\n'", "user": r"'User: ' + c + '\n\n'",
                                 "assistant": "'Assistant: ' + c + '<｜end▁of▁sentence｜>'"}), "'Assistant:'"),
    "deepseek3": _each(_by_role({"system": r"c + '\n\n'", "user": "'<｜User｜>' + c",
                                 "assistant": "'<｜Assistant｜>' + c + '<｜end▁of▁sentence｜>'"}), "'<｜Assistant｜>'"),
    "deepseek-ocr": _each("{{ c }}"),
    "command-r": _each(_by_role({role: f"'<|START_OF_TURN_TOKEN|><|{token}|>' + (c | {_T}) + '<|END_OF_TURN_TOKEN|>'"
                                 for role, token in (("system", "SYSTEM_TOKEN"), ("user", "USER_TOKEN"),
                                                     ("assistant", "CHATBOT_TOKEN"))}),
                       "'<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>'"),
    "llama3": _header("<|start_header_id|>", r"<|end_header_id|>\n\n", "<|eot_id|>", trim=True),
    "llama4": _header("<|header_start|>", r"<|header_end|>\n\n", "<|eot|>", trim=True),
    "chatglm3": _each(r"{{ '<|' + m.role + '|>\n ' + c }}", "'<|assistant|>'", before="'[gMASK]sop'"),
    "chatglm4": _each(r"{{ '<|' + m.role + '|>\n' + c }}", r"'<|assistant|>\n'", before="'[gMASK]<sop>'"),
    "glmedge": _each(r"{{ '<|' + m.role + '|>\n' + c }}", "'<|assistant|>'"),
    "minicpm": _each(_by_role({"user": f"'<用户>' + (c | {_T}) + '<AI>'"}, f"c | {_T}")),
    "exaone3": _each(_by_role({"system": f"'[|system|]' + (c | {_T}) + '[|endofturn|]\\n'",
                               "user": f"'[|user|]' + (c | {_T}) + '\\n'",
                               "assistant": f"'[|assistant|]' + (c | {_T}) + '[|endofturn|]\\n'"}), "'[|assistant|]'"),
    "exaone4": _each(_by_role({"system": f"'[|system|]' + (c | {_T}) + '[|endofturn|]\\n'",
                               "user": f"'[|user|]' + (c | {_T}) + '\\n'",
                               "assistant": f"'[|assistant|]' + (c | {_T}) + '[|endofturn|]\\n'",
                               "tool": f"'[|tool|]' + (c | {_T}) + '[|endofturn|]\\n'"}), "'[|assistant|]'"),
    "exaone-moe": _each(_by_role({role: f"'<|{role}|>\\n' + (c | {_T}) + '<|endofturn|>\\n'"
                                  for role in ("system", "user", "assistant", "tool")}), r"'<|assistant|>\n'"),
    # RWKV ends a prompt that ends with a user message with "Assistant:", whatever add_generation_prompt says.
    "rwkv-world": _each(_by_role({"system": f"'System: ' + (c | {_T}) + '\\n\\n'",
                                  "user": f"'User: ' + (c | {_T}) + '\\n\\n' + ('Assistant:' if loop.last else '')",
                                  "assistant": f"'Assistant: ' + (c | {_T}) + '\\n\\n'"})),
    "granite": _each(r"{{ '<|start_of_role|>' + m.role + '<|end_of_role|>' + ('<|tool_call|>' if "
                     r"m.role == 'assistant_tool_call' else '') + c + '<|end_of_text|>\n' }}",
                     "'<|start_of_role|>assistant<|end_of_role|>'"),
    "granite-4.0": _each(r"{{ ('<|start_of_role|>assistant<|end_of_role|><|tool_call|>' if m.role == "
                         r"'assistant_tool_call' else '<|start_of_role|>' + m.role + '<|end_of_role|>') + c"
                         r" + '<|end_of_text|>\n' }}", "'<|start_of_role|>assistant<|end_of_role|>'"),
    # The system message counts only in first place; later ones, and other roles, are dropped.
    "gigachat": ("{{ '<s>' }}{% for m in messages %}{% set c = m.content %}"
                 "{% if loop.first and m.role == 'system' %}{{ c + '<|message_sep|>' }}"
                 "{% elif m.role == 'user' %}{{ 'user<|role_sep|>' + c + '<|message_sep|>available functions"
                 "<|role_sep|>[]<|message_sep|>' }}"
                 "{% elif m.role == 'assistant' %}{{ 'assistant<|role_sep|>' + c + '<|message_sep|>' }}{% endif %}"
                 "{% endfor %}{% if add_generation_prompt %}{{ 'assistant<|role_sep|>' }}{% endif %}"),
    "megrez": _header("<|role_start|>", "<|role_end|>", "<|turn_end|>"),
    "yandex": _each(_by_role({"user": r"' Пользователь: ' + c + '\n\n'", "assistant": r"' Ассистент: ' + c + '\n\n'"}),
                    "' Ассистент:[SEP]'"),
    "bailing": _each(f"{{{{ '<role>' + {_BAILING_ROLE} + '</role>' + c }}}}", "'<role>ASSISTANT</role>'"),
    "bailing-think": _each(f"{{{{ '<role>' + {_BAILING_ROLE} + '</role>' + c }}}}", "'<role>ASSISTANT</role><think>'"),
    "bailing2": _each(f"{{{{ '<role>' + {_BAILING_ROLE} + '</role>' + c + '<|role_end|>' }}}}", "'<role>ASSISTANT</role>'",
                      before="('' if messages and messages[0].role == 'system' else "
                             "'<role>SYSTEM</role>detailed thinking off<|role_end|>')"),
    "smolvlm": _each(_by_role({"system": r"c + '\n\n'", "user": r"'User: ' + c + '<end_of_utterance>\n'"},
                              r"'Assistant: ' + c + '<end_of_utterance>\n'"), "'Assistant:'", before="'<|im_start|>'"),
    "hunyuan-moe": _each(_by_role({"system": "'<|startoftext|>' + c + '<|extra_4|>'",
                                   "assistant": "c + '<|eos|>'"}, "'<|startoftext|>' + c + '<|extra_0|>'")),
    "gpt-oss": _each("{{ '<|start|>' + m.role + '<|message|>' + c + ('<|return|>' if m.role == 'assistant' "
                     "else '<|end|>') }}", "'<|start|>assistant'"),
    "hunyuan-dense": _each("{% if loop.first and m.role == 'system' %}{{ c + '<｜hy_place▁holder▁no▁3｜>' }}{% endif %}"
                           + _by_role({"assistant": "'<｜hy_Assistant｜>' + c + '<｜hy_place▁holder▁no▁2｜>'",
                                       "user": "'<｜hy_User｜>' + c + '<｜hy_Assistant｜>'"})),
    "hunyuan-vl": _each("{% if not (loop.first and m.role == 'system') %}"
                        + _by_role({"user": "c + '<｜hy_User｜>'", "assistant": "c + '<｜hy_Assistant｜>'"})
                        + "{% else %}{{ c + '<｜hy_place▁holder▁no▁3｜>' }}{% endif %}",
                        before="'<｜hy_begin▁of▁sentence｜>'"),
    "kimi-k2": _each(_by_role({"system": "'<|im_system|>system<|im_middle|>'", "user": "'<|im_user|>user<|im_middle|>'",
                               "assistant": "'<|im_assistant|>assistant<|im_middle|>'",
                               "tool": "'<|im_system|>tool<|im_middle|>'"}) + "{{ c + '<|im_end|>' }}",
                     "'<|im_assistant|>assistant<|im_middle|>'"),
    "seed_oss": _each(f"{{{{ '<seed:bos>' + m.role + '\\n' + ((c | {_T}) if m.role == 'assistant' else c)"
                      " + '<seed:eos>' }}", r"'<seed:bos>assistant\n'"),
    "grok-2": _each(_by_role({"system": f"'System: ' + (c | {_T}) + '<|separator|>\\n\\n'",
                              "user": f"'Human: ' + (c | {_T}) + '<|separator|>\\n\\n'",
                              "assistant": r"'Assistant: ' + c + '<|separator|>\n\n'"}), "'Assistant:'"),
    "pangu-embedded": _each("{% if loop.first and m.role != 'system' %}{{ '[unused9]系统：[unused10]' }}{% endif %}"
                            + _by_role({role: f"'[unused9]{label}：' + c + '[unused10]'" for role, label in
                                        (("system", "系统"), ("user", "用户"), ("assistant", "助手"),
                                         ("tool", "工具"), ("function", "方法"))}), "'[unused9]助手：'"),
    "solar-open": _each("{{ '<|begin|>' + m.role + '<|content|>' + c + '<|end|>' }}", "'<|begin|>assistant'"),
}
NAMED_TEMPLATES["granite-4.1"] = NAMED_TEMPLATES["granite-4.0"]  # the same format in llama.cpp
