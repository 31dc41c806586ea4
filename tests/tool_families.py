"""A small chat template per model family, in that family's style (how it renders
``tools=`` and assistant ``tool_calls``), with its special tokens and end-of-turn token:
``FAMILIES[name] = (template, specials, eos)``; ``MISTRAL_V03``, a mistral template that
is not prefix-stable, as Mistral v0.3's real one. Shared by tests/chat/test_tool_formats.py,
tests/chat/test_moving_templates.py, tests/env/test_trajectory_templates.py and
tests/agents/test_agent.py; it sits at tests/, beside conftest.py, whose folder
pytest puts on ``sys.path``."""

from rollart.testing import CHATML_SPECIALS

# -- one template per family, in that family's style ------------------------------------
# Qwen2.5/Hermes: tools in the system turn, calls as <tool_call> JSON blocks
HERMES = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n"
    "{{ t | tojson }}{% endfor %}\n</tools>\n\nFor each function call, return a json "
    "object within <tool_call></tool_call> XML tags<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls %}{% set c = c.function %}"
    "{{ '<tool_call>\\n{\"name\": \"' + c.name + '\", \"arguments\": ' }}"
    "{{ c.arguments | tojson }}{{ '}\\n</tool_call>' }}{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
# Llama-3.1: "Environment: ipython", tools in the first user turn, a call is the JSON
# {"name", "parameters"} as the whole turn, tool results in ipython turns
LLAMA31 = (
    "{{ bos_token }}<|start_header_id|>system<|end_header_id|>\n\n"
    "{% if tools %}Environment: ipython\n{% endif %}"
    "{% if messages[0].role == 'system' %}{{ messages[0].content | trim }}{% endif %}"
    "<|eot_id|>"
    "{% for m in messages %}{% if m.role == 'system' %}"
    "{% elif m.role == 'user' and loop.index0 <= 1 and tools %}"
    "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please "
    "respond with a JSON for a function call. Respond in the format {\"name\": function "
    "name, \"parameters\": dictionary of argument name and its value}.\n\n"
    "{% for t in tools %}{{ t | tojson(indent=4) }}\n\n{% endfor %}"
    "{{ m.content | trim }}<|eot_id|>"
    "{% elif m.role == 'assistant' and m.tool_calls %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for c in m.tool_calls %}{% set c = c.function %}"
    "{{ '{\"name\": \"' + c.name + '\", ' }}{{ '\"parameters\": ' }}"
    "{{ c.arguments | tojson }}{{ '}' }}{% endfor %}<|eot_id|>"
    "{% elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n"
    "{{ m.content }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}"
    "<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}")

MISTRAL_SPECIALS = ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                    "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
# Mistral v0.3: [AVAILABLE_TOOLS] list, [TOOL_CALLS] then a JSON list, [TOOL_RESULTS]
# (the tools go before the first user turn here, not the last: prefix-stable)
MISTRAL = (
    "{{ bos_token }}{% if tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{% endif %}{% for m in messages %}"
    "{% if m.role == 'system' %}{{ m.content }}\n\n"
    "{% elif m.role == 'user' %}[INST] {{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS] ["
    "{% for c in m.tool_calls %}{% set c = c.function %}"
    "{{ '{\"name\": \"' + c.name + '\", \"arguments\": ' }}{{ c.arguments | tojson }}"
    "{{ '}' }}{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS] {{ {'content': m.content} | tojson }}"
    "[/TOOL_RESULTS]"
    "{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}")

# Mistral v0.3 as its real template behaves: strict user/assistant alternation (tool
# messages and assistant turns with tool_calls aside; anything else raises), the
# [AVAILABLE_TOOLS] block before the LAST user turn (it moves as the conversation grows),
# a system message folded into the first user turn (the real one folds it into the
# last), no generation prompt, " content</s>" for an assistant turn: not prefix-stable
MISTRAL_V03 = (
    "{% if messages[0].role == 'system' %}{% set system = messages[0].content %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set loop_messages = messages %}"
    "{% endif %}{% set users = loop_messages | selectattr('role', 'equalto', 'user') | list %}"
    "{% set ns = namespace(i=0) %}{% for m in loop_messages %}"
    "{% if not (m.role == 'tool' or m.tool_calls) %}"
    "{% if (m.role == 'user') != (ns.i % 2 == 0) %}{{ raise_exception('After the optional "
    "system message, conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% set ns.i = ns.i + 1 %}{% endif %}{% endfor %}"
    "{{ bos_token }}{% for m in loop_messages %}"
    "{% if m.role == 'user' %}"
    "{% if tools and m == users[-1] %}[AVAILABLE_TOOLS] {{ tools | tojson }}"
    "[/AVAILABLE_TOOLS]{% endif %}"
    "{% if loop.first and system is defined %}[INST] {{ system }}\n\n{{ m.content }}[/INST]"
    "{% else %}[INST] {{ m.content }}[/INST]{% endif %}"
    "{% elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS] ["
    "{% for c in m.tool_calls %}{% set c = c.function %}"
    "{{ '{\"name\": \"' + c.name + '\", \"arguments\": ' }}{{ c.arguments | tojson }}"
    "{{ '}' }}{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}"
    "{% elif m.role == 'assistant' %} {{ m.content | trim }}{{ eos_token }}"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS] {{ {'content': m.content} | tojson }}"
    "[/TOOL_RESULTS]"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported, with the "
    "exception of an initial optional system message!') }}{% endif %}{% endfor %}")

# Qwen3-Coder: tools as XML, calls as <tool_call><function=...><parameter=...>
QWEN3_CODER = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n<function>\n"
    "<name>{{ t.function.name }}</name>\n</function>{% endfor %}\n</tools>\n\n"
    "If you choose to call a function ONLY reply in the following format:\n<tool_call>\n"
    "<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
    "</parameter>\n</function>\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls %}{% set c = c.function %}"
    "{{ '<tool_call>\\n<function=' + c.name + '>\\n' }}"
    "{% for k, v in c.arguments.items() %}{{ '<parameter=' + k + '>\\n' }}"
    "{% if v is mapping or (v is sequence and v is not string) %}{{ v | tojson }}"
    "{% else %}{{ v | string }}{% endif %}{{ '\\n</parameter>\\n' }}{% endfor %}"
    "{{ '</function>\\n</tool_call>' }}{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

FAMILIES = {  # name: (template, specials, eos)
    "hermes": (HERMES, CHATML_SPECIALS, "<|im_end|>"),
    "llama3": (LLAMA31, LLAMA_SPECIALS, "<|eot_id|>"),
    "mistral": (MISTRAL, MISTRAL_SPECIALS, "</s>"),
    "qwen3_coder": (QWEN3_CODER, CHATML_SPECIALS, "<|im_end|>"),
}
