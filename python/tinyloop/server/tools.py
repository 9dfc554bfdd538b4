"""Tool (function) calling on the chat endpoint (docs/server.md, "Tools"): the request's
`tools`, `tool_choice` and `parallel_tool_calls` checked, the tools rendered through the
model's chat template (its `tools` variable, as Hugging Face passes them; a template that
does not read `tools` gets them in a system message), and the calls parsed from the
answer into OpenAI's `tool_calls`.

`tool_choice` "required" or a named function constrains the answer with a grammar built
from the tools' parameter schemas (tinyloop.grammar), so its JSON is always a valid call;
"auto" lets the model answer in text or call, and a call is parsed from the text: a
`<tool_call>{...}</tool_call>` block (the Hermes and Qwen format), or an answer that is
wholly a call object `{"name": ..., "arguments": {...}}` or a list of them.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from .errors import RequestError

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclass
class ToolCalling:
    tools: list            # the request's tools, as given ({"type": "function", "function": {...}})
    choice: str            # "auto", "required" or "named"
    named: str | None      # the function of a named tool_choice
    parallel: bool

    @property
    def names(self) -> list:
        return [t["function"]["name"] for t in self.tools]

    def schema(self) -> dict:
        """The JSON schema of what a constrained answer is: one call, or with parallel
        calls a list of at least one."""
        tools = [t for t in self.tools if self.named is None or t["function"]["name"] == self.named]
        calls = [{"type": "object", "properties": {
            "name": {"const": t["function"]["name"]},
            "arguments": t["function"].get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        if self.parallel and self.named is None:
            return {"type": "array", "items": one, "minItems": 1}
        return one


def parse_tools(body: dict) -> ToolCalling | None:
    """The request's tool calling, or None when it has no tools or tool_choice is "none"."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise RequestError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    if tools is None:
        if choice not in (None, "none"):
            raise RequestError("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of function tools", "tools")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(function, dict)):
            raise RequestError(f'{where} must be {{"type": "function", "function": {{"name": ...}}}}', where)
        name = function.get("name")
        if not (isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name)):
            raise RequestError(f"{where}.function.name must be 1-64 letters, digits, _ . or -", where)
        if name in names:
            raise RequestError(f"{where}: a second tool named {name!r}", where)
        names.add(name)
        params = function.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise RequestError(f"{where}.function.parameters must be a JSON schema object", where)
    named = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        function = choice.get("function")
        if not (choice.get("type") == "function" and isinstance(function, dict)
                and function.get("name") in names):
            raise RequestError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                               '"function": {"name": one of the tools}}', "tool_choice")
        choice, named = "named", function["name"]
    elif choice not in ("none", "auto", "required"):
        raise RequestError('tool_choice must be "none", "auto", "required" or a named function',
                           "tool_choice")
    if choice == "none" or not tools:
        return None
    return ToolCalling(tools, choice, named, parallel)


def constrained(calling: ToolCalling | None) -> bool:
    return calling is not None and calling.choice in ("required", "named")


def tools_message(calling: ToolCalling) -> dict:
    """A system message listing the tools and the call format, for a chat template that
    does not read `tools` itself."""
    listed = "\n".join(json.dumps(t["function"]) for t in calling.tools)
    return {"role": "system", "content":
            "You can call these functions:\n" + listed + "\nTo call one, answer with "
            '<tool_call>{"name": NAME, "arguments": {...}}</tool_call>.'}


def held_text(request) -> bool:
    """Whether a streamed answer is held until it ends, to be parsed for tool calls."""
    return getattr(request, "tool_calling", None) is not None


def _calls(text: str, calling: ToolCalling) -> list | None:
    """The calls in the answer's text, or None when it holds none (or a malformed one)."""
    blocks = _BLOCK.findall(text)
    candidates = blocks if blocks else [text.strip()]
    calls = []
    for candidate in candidates:
        try:
            value = json.loads(candidate)
        except ValueError:
            return None
        for call in value if isinstance(value, list) else [value]:
            if not isinstance(call, dict):
                return None
            name = call.get("name")
            arguments = call.get("arguments", call.get("parameters", {}))
            if name not in calling.names or not isinstance(arguments, dict):
                return None
            calls.append((name, arguments))
    return calls or None


def chat_message(request, text: str, finish, logprobs, stream: bool = False) -> tuple:
    """(the assistant message, finish_reason, logprobs) of a chat choice: its text, or
    with tools the calls parsed from it (finish_reason "tool_calls")."""
    calling = getattr(request, "tool_calling", None)
    calls = _calls(text, calling) if calling is not None else None
    if not calls:
        return {"role": "assistant", "content": text}, finish, logprobs
    if not calling.parallel:
        calls = calls[:1]
    tool_calls = []
    for i, (name, arguments) in enumerate(calls):
        call = {"id": f"call_{secrets.token_hex(12)}", "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)}}
        tool_calls.append(dict(call, index=i) if stream else call)
    return {"role": "assistant", "content": None, "tool_calls": tool_calls}, "tool_calls", logprobs
