"""A model's chat template (its `tokenizer.chat_template` metadata, Jinja as Hugging Face
writes them), rendered in Jinja's sandbox with `messages`, `add_generation_prompt`,
`bos_token` and `eos_token`, as Hugging Face renders it. Needs the jinja2 package
(a dependency of the package); used by `tinyloop chat` and the server's chat endpoint.
"""

from __future__ import annotations

from typing import Callable

from .errors import TinyLoopError


class ChatTemplateError(TinyLoopError):
    """The template does not parse or refused the messages (its `raise_exception`)."""


class ChatTemplateUnavailable(ChatTemplateError):
    """jinja2, which renders chat templates, is not installed."""


def load_chat_template(model) -> Callable[..., str] | None:
    """A function (messages, add_generation_prompt=True, **variables) -> prompt text, or
    None when the model has no template; variables (e.g. `tools`) go to the template as
    Hugging Face passes them. It raises ChatTemplateError when it cannot render."""
    source = model.info.metadata.get("tokenizer.chat_template")
    if not source:
        return None
    try:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        def missing(messages, add_generation_prompt=True):
            raise ChatTemplateUnavailable("chat needs the jinja2 package to render the model's chat "
                                    "template (pip install jinja2)")
        return missing

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        compiled = env.from_string(source)
    except TemplateError as e:
        raise ChatTemplateError(f"the model's chat template does not parse: {e}") from None
    tok = model.tokenizer
    bos = tok.decode([tok.bos_id], skip_special_tokens=False) if tok.bos_id >= 0 else ""
    eos = tok.decode([tok.eos_id], skip_special_tokens=False) if tok.eos_id >= 0 else ""

    def render(messages: list, add_generation_prompt: bool = True, **variables) -> str:
        try:
            return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=bos, eos_token=eos, **variables)
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template refused the messages: {e}") from None
    # whether the template renders a `tools` variable (function calling, tinyloop.server.tools)
    render.reads_tools = "tools" in source
    return render
