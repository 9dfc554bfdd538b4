"""The server's /tokenize and /detokenize bodies (docs/server.md, "Tokens"), in vLLM's
shape: a client counts or inspects a prompt's tokens with the served model's own
tokenizer and chat template, without generating.
"""

from __future__ import annotations

from .api import (RequestError, chat_prompt_ids, check_fields, check_model, flag_field,
                  prompt_token_ids, token_text)

TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                   "return_token_strs"}
DETOKENIZE_FIELDS = {"model", "tokens"}


def tokenize(body, model, served, template) -> dict:
    """{"count", "max_model_len", "tokens", "token_strs"} for a `prompt` (a string, or token
    ids checked against the vocabulary) or chat `messages` rendered as the chat endpoint
    renders them. add_special_tokens (true) adds the BOS the tokenizer adds by default to a
    prompt string; add_generation_prompt (true) ends messages with the assistant's turn."""
    check_fields(body, TOKENIZE_FIELDS)
    check_model(body, served)
    if ("prompt" in body) == ("messages" in body):
        raise RequestError("give prompt or messages, exactly one of them",
                           "messages" if "messages" in body else "prompt")
    strs = flag_field(body, "return_token_strs")
    if "messages" in body:
        if "add_special_tokens" in body:
            raise RequestError("add_special_tokens applies to a prompt: messages get what the chat "
                               "template writes", "add_special_tokens")
        ids = chat_prompt_ids(body, model, template, flag_field(body, "add_generation_prompt", True))
    else:
        if "add_generation_prompt" in body:
            raise RequestError("add_generation_prompt applies to messages", "add_generation_prompt")
        add_bos = None if flag_field(body, "add_special_tokens", True) else False
        ids = prompt_token_ids(body["prompt"], model, "prompt", add_bos=add_bos)
    return {"count": len(ids), "max_model_len": model.info.max_seq_len, "tokens": ids,
            "token_strs": [token_text(model.tokenizer, t)[0] for t in ids] if strs else None}


def detokenize(body, model, served) -> dict:
    """{"prompt": the text of `tokens`} (token ids of the vocabulary; special tokens are
    left out of the text, as the completion endpoints' text leaves them out)."""
    check_fields(body, DETOKENIZE_FIELDS)
    check_model(body, served)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                               for t in tokens):
        raise RequestError("tokens must be a list of token ids", "tokens")
    vocab = model.info.vocab_size
    bad = [(i, t) for i, t in enumerate(tokens) if not 0 <= t < vocab]
    if bad:
        i, t = bad[0]
        raise RequestError(f"tokens[{i}] = {t} is out of range for vocab size {vocab}", f"tokens[{i}]")
    return {"prompt": model.tokenizer.decode(tokens)}
