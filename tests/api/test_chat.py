"""Chat templates rendered as Hugging Face renders them (loopcontrols, strftime_now,
tojson, raise_exception, tools / documents), with real template shapes, and
Model.chat / Model.stream_chat on top of the one renderer."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

import textmodel
import tinyloop
from tinyloop.chat_template import ChatTemplate, ChatTemplateError, load_chat_template

pytest.importorskip("jinja2")

# the shape of Llama 3.1-3.3's template: today's date from strftime_now, tools as indented
# JSON in the first user message, a tool call's arguments as JSON, ipython results
LLAMA3_STYLE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools is not none %}
    {%- if messages | length == 0 %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {%- set first_user_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, respond with a JSON for a function call.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>" }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'assistant' and message.tool_calls is defined %}
        {%- if message.tool_calls | length != 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {{- message.content | tojson if message.content is mapping else message.content }}
        {{- "<|eot_id|>" }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# the shape of Qwen2.5's template: tools as one JSON line each inside <tools>, tool calls
# in <tool_call> tags, consecutive tool results gathered into one user turn
QWEN2_STYLE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\nReturn each call in <tool_call></tool_call> tags.<|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "system" and loop.first %}
        {%- continue %}
    {%- endif %}
    {%- if message.role == "user" or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- set tool_call = tool_call.function if tool_call.function is defined else tool_call %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Le temps qu'il fait à une ville (°C) <now>",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_smollm2_template_of_the_shipped_model(shipped):
    template = shipped.chat_template
    assert template is not None and shipped.chat_template is template   # compiled once
    text = template([{"role": "user", "content": "Où est Zürich?"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nOù est Zürich?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    with_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert template(with_system, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")


def test_llama3_style_template_dates_and_tools():
    template = ChatTemplate(LLAMA3_STYLE, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    assert template.reads_tools
    before = datetime.now().strftime("%d %b %Y")
    plain = template([{"role": "user", "content": "Hello"}])
    after = datetime.now().strftime("%d %b %Y")
    assert plain.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                            "Cutting Knowledge Date: December 2023\nToday Date: ")
    assert any(f"Today Date: {day}\n\n<|eot_id|>" in plain for day in (before, after))
    assert plain.endswith("<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
                          "<|start_header_id|>assistant<|end_header_id|>\n\n")
    # a date the caller gives wins over strftime_now's
    assert "Today Date: 01 Jan 2030\n" in template([{"role": "user", "content": "x"}], date_string="01 Jan 2030")

    messages = [{"role": "user", "content": "Météo à Zürich ?"},
                {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                    "name": "get_weather", "arguments": {"city": "Zürich"}}}]},
                {"role": "tool", "content": {"température": "12 °C"}}]
    text = template(messages, tools=[WEATHER])
    # tojson(indent=4) as json.dumps writes it, non-ASCII and < > kept
    assert json.dumps(WEATHER, indent=4, ensure_ascii=False) + "\n\n" in text
    assert "Le temps qu'il fait à une ville (°C) <now>" in text and "\\u00e0" not in text
    assert '{"name": "get_weather", "parameters": {"city": "Zürich"}}<|eot_id|>' in text
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n{"température": "12 °C"}<|eot_id|>' in text
    # raise_exception refuses what the template cannot write
    two_calls = [messages[0], dict(messages[1], tool_calls=messages[1]["tool_calls"] * 2)]
    with pytest.raises(ChatTemplateError, match="only supports single tool-calls"):
        template(two_calls)
    with pytest.raises(ChatTemplateError, match="no first user message"):
        template([{"role": "system", "content": "Only a system message."}], tools=[WEATHER])


def test_qwen2_style_tools_template():
    template = ChatTemplate(QWEN2_STYLE, eos_token="<|im_end|>")
    messages = [{"role": "system", "content": "Tu es serviable."},
                {"role": "user", "content": "Quel temps à Zürich ?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Genève"}}}]},
                {"role": "tool", "content": "12 °C"}, {"role": "tool", "content": "14 °C"}]
    text = template(messages, tools=[WEATHER])
    assert text == (
        "<|im_start|>system\nTu es serviable.\n\n# Tools\n\n<tools>\n"
        + json.dumps(WEATHER, ensure_ascii=False)
        + "\n</tools>\nReturn each call in <tool_call></tool_call> tags.<|im_end|>\n"
        "<|im_start|>user\nQuel temps à Zürich ?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
        '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Genève"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n12 °C\n</tool_response>\n<tool_response>\n14 °C\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # without tools (None, as Hugging Face passes it) the system message stands alone;
    # `{% continue %}` skipped it in the loop
    plain = template(messages[:2])
    assert plain == ("<|im_start|>system\nTu es serviable.<|im_end|>\n<|im_start|>user\nQuel temps à "
                     "Zürich ?<|im_end|>\n<|im_start|>assistant\n")


def test_environment_details():
    source = ("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
              "{% generation %}{{ m.content }}{% endgeneration %}|{% endfor %}"
              "{{ documents | tojson }}{{ tools is none }}"
              "{{ {'b': 1, 'a': [1, 2]} | tojson(separators=(',', ':'), sort_keys=true) }}")
    template = ChatTemplate(source)
    messages = [{"role": "user", "content": c} for c in ("one", "two", "three")]
    docs = [{"title": "Café", "text": "<b>é</b>"}]
    assert template(messages, documents=docs) == ('one|two|[{"title": "Café", "text": "<b>é</b>"}]'
                                                  'True{"a":[1,2],"b":1}')
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% for m in messages %}")
    # the sandbox: no reaching into Python internals
    with pytest.raises(Exception):
        ChatTemplate("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}")([])


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "chat.tinyloop"
    textmodel.make_text_model(path, chat_template=textmodel.CHATML)
    with tinyloop.Model(path, threads=1) as model:
        yield model


def test_model_chat_is_generate_on_the_rendered_conversation(chat_model):
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}]
    reply = chat_model.chat(messages, max_tokens=6, temperature=0, eos=False)
    # the CLI's and the server's renderer: the same template object
    assert load_chat_template(chat_model)(messages) == chat_model.chat_template(messages)
    ids = chat_model.tokenizer.encode(chat_model.chat_template(messages), add_bos=False)
    plain = chat_model.generate(ids, max_tokens=6, temperature=0, eos=False)
    assert reply.tokens == plain.tokens and reply.prompt_tokens == len(ids)
    assert reply.text == chat_model.tokenizer.decode_continuation(ids, plain.tokens)
    assert "".join(chat_model.stream_chat(messages, max_tokens=6, temperature=0, eos=False)) == reply.text
    # template variables reach the template; tools and documents too
    seen = ChatTemplate("{{ tools | tojson }}{{ documents | tojson }}{{ who }}")
    chat_model._chat_template = seen
    try:
        got = chat_model.chat(messages, tools=[{"f": "é"}], documents=["d"], chat_template_kwargs={"who": "me"},
                              max_tokens=1)
        assert got.prompt_tokens == len('[{"f": "é"}]["d"]me'.encode())   # a token per byte
    finally:
        chat_model._chat_template = load_chat_template(chat_model)


def test_model_chat_without_a_template(text_model):
    assert text_model.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        text_model.chat([{"role": "user", "content": "Hi"}])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        text_model.stream_chat([{"role": "user", "content": "Hi"}])


def test_model_chat_shipped_model_answers(shipped):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = shipped.chat(messages, max_tokens=12, temperature=0)
    assert reply.text and reply.text == "".join(shipped.stream_chat(messages, max_tokens=12, temperature=0))
    assert not reply.text.startswith("<|im_start|>")
