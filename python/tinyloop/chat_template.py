"""A model's chat template (its `tokenizer.chat_template` metadata, Jinja as Hugging Face
writes them), rendered as Hugging Face's `apply_chat_template` renders it: Jinja's
immutable sandbox with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension
(`{% break %}`, `{% continue %}`), `{% generation %}` blocks (rendered as their body),
the globals `raise_exception` and `strftime_now`, a `tojson` filter that keeps non-ASCII
text and takes `indent`, `separators` and `sort_keys`, and the variables `messages`,
`tools`, `documents` (None unless given), `add_generation_prompt`, `bos_token` and
`eos_token`. One renderer serves `Model.chat`, `tinyloop chat` and the server's chat
endpoint.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from .errors import TinyLoopError

if TYPE_CHECKING:
    from .model import Model


class ChatTemplateError(TinyLoopError):
    """The template does not parse or refused the messages (its `raise_exception`)."""


class ChatTemplateUnavailable(ChatTemplateError):
    """jinja2, which renders chat templates, is not installed."""


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own filter escapes <, >, & and ' for HTML and writes non-ASCII as \u escapes;
    # templates written for Hugging Face expect the text as json.dumps gives it
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    """The local time now, formatted (Llama 3.x templates write today's date)."""
    return datetime.now().strftime(format)


def _environment() -> Any:
    from jinja2 import nodes
    from jinja2.exceptions import TemplateError
    from jinja2.ext import Extension, loopcontrols
    from jinja2.parser import Parser
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlocks(Extension):
        # Hugging Face marks the assistant's tokens with {% generation %}; rendering
        # writes the block's body as it is
        tags = {"generation"}

        def parse(self, parser: Parser) -> list[nodes.Node]:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, GenerationBlocks])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template: call it with the messages (and variables) for the prompt
    text."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        #: whether the template renders a `tools` variable (function calling, server/tools.py)
        self.reads_tools = "tools" in source
        self._compiled: Any = None
        try:
            from jinja2.exceptions import TemplateError
        except ImportError:   # said when rendering: a model without chat still loads
            return
        try:
            self._compiled = _environment().from_string(source)
        except TemplateError as e:
            raise ChatTemplateError(f"the model's chat template does not parse: {e}") from None

    def __call__(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                 **variables: Any) -> str:
        """The prompt text of the conversation. `variables` (tools, documents, anything
        the template reads) go to the template as Hugging Face passes them; they win over
        bos_token and eos_token."""
        if self._compiled is None:
            raise ChatTemplateUnavailable("chat needs the jinja2 package to render the model's chat "
                                          "template (pip install jinja2)")
        from jinja2.exceptions import TemplateError
        context: dict[str, Any] = {"tools": None, "documents": None, "bos_token": self.bos_token,
                                   "eos_token": self.eos_token}
        context.update(variables)
        context.update(messages=list(messages), add_generation_prompt=add_generation_prompt)
        try:
            return str(self._compiled.render(**context))
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template refused the messages: {e}") from None


def load_chat_template(model: "Model") -> ChatTemplate | None:
    """The model's ChatTemplate, or None when the model has no template. Raises
    ChatTemplateError when the template does not parse."""
    source = model.info.metadata.get("tokenizer.chat_template")
    if not source:
        return None
    tok = model.tokenizer
    bos = tok.decode([tok.bos_id], skip_special_tokens=False) if tok.bos_id >= 0 else ""
    eos = tok.decode([tok.eos_id], skip_special_tokens=False) if tok.eos_id >= 0 else ""
    return ChatTemplate(str(source), bos, eos)
