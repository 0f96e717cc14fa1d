"""A tiny model that does one agent's turn for real: asked to run a command, it calls the
agent's own shell tool (Claude Code's ``Bash``, Codex's ``exec_command``, OpenCode's
``bash``) in the json_tools markup, and once the command's output comes back it says what
it printed; asked what a list is, it answers in a line. Trained here in seconds
(tests/support/toolmodel.py's trainer).

Its chat template shows it only what it needs: which of the agents' shell tools the request
offers, the last line of each user turn (the last of consecutive ones: Codex sends its
environment as a turn of its own) and tool result, and its own earlier calls. System
prompts (tens of thousands of tokens in a real agent) and every other tool are not rendered,
so the real agents' requests, whatever their size, become prompts of a few dozen tokens."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.toolmodel import EOS, train_chat_model

SHELLS = {  # the agent's shell tool -> the call that runs COMMAND
    "Bash": lambda cmd: {"command": cmd, "description": "Print the greeting"},  # Claude Code
    "exec_command": lambda cmd: {"cmd": cmd},  # Codex
    "bash": lambda cmd: {"command": cmd, "description": "Print the greeting"},  # OpenCode
}
COMMAND = "echo hello-agent"
OUTPUT = "hello-agent"
RUN = f"Use the shell to run: {COMMAND}"
PRINTED = f"The command printed {OUTPUT}."
QUESTION = "What is a list?"
ANSWER = "A list is an ordered collection of items."

TEMPLATE = (
    "{%- set shells = (tools or []) | map(attribute='function.name') | select('in', "
    + json.dumps(list(SHELLS))
    + ") | list %}"
    "{%- if shells %}<|im_start|>system\nShell: {{ shells | first }}" + EOS + "\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if message.content %}{{ (message.content | trim).split('\n') | last }}{% endif %}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if tool_call.function %}{% set tool_call = tool_call.function %}{% endif %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": '
    "{{ tool_call.arguments | tojson }}}\n</tool_call>{% endfor %}" + EOS + "\n"
    "{%- elif message.role == 'tool' %}<|im_start|>tool\n"
    "{{ (message.content | trim).split('\n') | last }}" + EOS + "\n"
    "{%- elif message.role == 'user' and (loop.last or loop.nextitem.role != 'user') %}"
    "<|im_start|>user\n"  # OpenCode sends `opencode run "text"` quoted: the quotes go
    "{{ (message.content | trim).split('\n') | last | trim('\"') }}" + EOS + "\n"
    "{%- endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


def rows() -> list[tuple[list[dict], list | None, str]]:
    out = [([{"role": "user", "content": QUESTION}], None, ANSWER + EOS)]
    for shell, arguments in SHELLS.items():
        tools = [tool("Read"), tool(shell), tool("Write")]
        ask = [{"role": "user", "content": RUN}]
        call = {"name": shell, "arguments": arguments(COMMAND)}
        called = f"<tool_call>\n{json.dumps(call)}\n</tool_call>" + EOS
        back = [
            *ask,
            {"role": "assistant", "content": "",
             "tool_calls": [{"id": "c1", "type": "function", "function": call}]},
            {"role": "tool", "tool_call_id": "c1", "content": f"Exit code 0\nOutput:\n{OUTPUT}\n"},
        ]  # fmt: skip
        out += [
            (ask, tools, called),
            (back, tools, PRINTED + EOS),
            ([{"role": "user", "content": QUESTION}], tools, ANSWER + EOS),
        ]
    return out


def make_agent_model(out: Path, steps: int = 250) -> Path:
    return train_chat_model(out, rows(), TEMPLATE, steps)


# python -m tests.support.agentmodel OUT (a subprocess: OpenBLAS preloaded)
if __name__ == "__main__":
    import sys

    make_agent_model(Path(sys.argv[1]))
