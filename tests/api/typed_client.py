"""A client of the public API, type-checked with `mypy --strict` by test_typing.py (it is
never run): every call and result below must type-check without casts or ignores."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import numpy.typing as npt

import tinyloop
from tinyloop.chat_template import ChatTemplate


def generate(model: tinyloop.Model) -> str:
    result: tinyloop.GenerateResult = model.generate("Once upon a time", max_tokens=8, temperature=0.0,
                                                     exit="kl:1e-3", stop=["\n"])
    tokens: list[int] = result.tokens
    depths: list[int] | None = result.depths
    rate: float = result.decode_tokens_per_s + result.acceptance_rate + result.mean_depth
    text: str | None = result.text
    for token in model.stream(tokens, max_tokens=4):
        tokens.append(token)
    pieces = "".join(model.stream_text("The capital of France is", max_tokens=4))
    batch: list[tinyloop.GenerateResult] = model.generate_batch(["a", [1, 2, 3]], max_tokens=2)
    return f"{text}{pieces}{rate}{depths}{len(batch)}"


def logprobs(model: tinyloop.Model) -> list[tuple[int, float, str | None]]:
    result = model.generate("Hello", max_tokens=4, logprobs=True, top_logprobs=3)
    out: list[tuple[int, float, str | None]] = []
    for entry in result.logprobs or []:
        out.append((entry.token, entry.logprob, entry.text))
        for top in entry.top:
            token_id, logprob = top
            out.append((top.id + token_id, top.logprob + logprob, top.text))
    return out


def chat(model: tinyloop.Model) -> str:
    messages = [{"role": "user", "content": "Hi"}]
    reply: tinyloop.GenerateResult = model.chat(messages, max_tokens=8, tools=[{"type": "function"}],
                                                chat_template_kwargs={"date_string": "1 Jan 2026"})
    template: ChatTemplate | None = model.chat_template
    prompt: str = template(messages, add_generation_prompt=True) if template is not None else ""
    return (reply.text or "") + prompt + "".join(model.stream_chat(messages, max_tokens=4))


def scoring(model: tinyloop.Model, ids: list[int]) -> float:
    logprobs: npt.NDArray[np.float32] = model.score(ids)
    lps, depths = model.score_with_depths(np.asarray(ids, dtype=np.int32), exit=tinyloop.ExitRule("kl", 1e-3))
    top_lps, top_ids, top_values = model.score_top_logprobs(ids, 3)
    embedding = model.embed(ids)
    info: tinyloop.ModelInfo = model.info
    memory: dict[str, int] = model.memory_report()
    with model.context(keep_loop_states=True) as ctx:
        logits = ctx.append(ids, depth=2)
        deeper = ctx.deepen(4)
    return float(logprobs.sum() + lps.sum() + depths.sum() + top_lps.sum() + top_ids.sum() + top_values.sum()
                 + embedding.sum() + logits.sum() + deeper.sum()) + info.d_model + memory["total_bytes"]


def structure(model: tinyloop.Model) -> bool:
    rule: tinyloop.ExitRule = tinyloop.ExitRule.parse("argmax_stable:3,min_depth=2")
    with tinyloop.Grammar(model, 'root ::= "yes" | "no"') as grammar:
        yes = grammar.accepts("yes")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    gbnf: str = tinyloop.json_schema_to_gbnf(schema)
    with tinyloop.Grammar.from_json_schema(model, schema) as typed:
        model.generate("{", grammar=typed, max_tokens=4)
    pool = tinyloop.PrefixPool(model, max_bytes=1 << 20)
    pool.add([1, 2, 3])
    matched: int = pool.lookup([1, 2, 3, 4])
    stats: dict[str, int] = pool.stats()
    with model.prefix_cache([1, 2]) as cache:
        held: int = cache.n_tokens + len(cache)
    pool.close()
    return yes and bool(gbnf) and rule.active and matched + stats["hits"] + held > 0


def configured(path: Path) -> tinyloop.Model:
    config: tinyloop.Config = tinyloop.load_config(path)
    options: dict[str, object] = config.generate_options()
    model = tinyloop.Model.from_config(config, threads=2)
    model.generate("x", **options)
    return model


async def asynchronous(path: Path) -> str:
    async with tinyloop.AsyncModel(path, threads=2) as model:
        result: tinyloop.GenerateResult = await model.generate("Hi", max_tokens=4)
        stream: tinyloop.AsyncStream[str] = model.stream_text("Hi", max_tokens=4)
        pieces = [piece async for piece in stream]
        tokens: list[int] = [token async for token in model.stream([1, 2], max_tokens=2)]
        reply = await model.chat([{"role": "user", "content": "Hi"}])
        scored = await model.run(model.model.score, tokens)
        return (result.text or "") + "".join(pieces) + (reply.text or "") + str(scored.sum())


def main() -> None:
    try:
        with tinyloop.Model.default(threads=2) as model:
            print(generate(model), logprobs(model), chat(model), scoring(model, [1, 2, 3]), structure(model))
    except tinyloop.TinyLoopError as e:
        print(e.status if isinstance(e, tinyloop.ContextFullError) else e)
    print(asyncio.run(asynchronous(Path("model.tinyloop"))), tinyloop.library_version())
