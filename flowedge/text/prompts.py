"""From words to the model's prompt ids: the tokenizer, the chat template, and the checks a prompt must pass
(its ids in the vocabulary, it and its answer within the context).

The head calls `prompt_ids` once per request (a client's text, turns or ids); `flowedge generate`, the
benchmarks and the planner call `encode_prompt` on one prompt. Nothing here knows about sockets or the
engine; the answer's text side is streams.py.
"""
from __future__ import annotations

from flowedge.errors import ContextOverflow, PromptError


def prompt_ids(tokenizer, request) -> list[int]:
    """The token ids the model sees for a PromptRequest (or anything with the same fields).

    token_ids: as given; messages: the model's chat template over the turns; text: the chat template
    over one user turn, or the plain tokenization when `raw` is set."""
    if request.token_ids is not None:
        return [int(t) for t in request.token_ids]
    if request.messages is not None:
        return chat_ids(tokenizer, request.messages)
    if request.raw:
        return list(tokenizer(request.text)["input_ids"])
    if getattr(tokenizer, "chat_template", None):
        return chat_ids(tokenizer, [{"role": "user", "content": request.text}])
    return list(tokenizer(request.text)["input_ids"])


def check_vocab(ids: list[int], vocab_size: int) -> None:
    """Token ids the models have embedding rows for: an id past them is the client's mistake (one clear
    error), not an IndexError deep in the engine."""
    bad = next((t for t in ids if t >= vocab_size), None)
    if bad is not None:
        raise PromptError(f"token id {bad} is not in the model's vocabulary (ids 0..{vocab_size - 1})")


def chat_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The chat template over `messages`, ending with the assistant's turn to speak."""
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError("this model has no chat template: send a raw prompt instead of messages")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as err:  # noqa: BLE001 - jinja errors of any kind: a template refusing these turns
        raise PromptError(f"the model's chat template refused these messages: {err}"[:500]) from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def load_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer(prompt)["input_ids"]


def check_context(prompt_len: int, max_new_tokens: int, context: int) -> None:
    if prompt_len == 0:
        raise ContextOverflow("the prompt is empty after tokenization")
    if prompt_len + max_new_tokens > context:   # OpenAI's words, which clients and their libraries match on
        raise ContextOverflow(
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{prompt_len + max_new_tokens} tokens ({prompt_len} in the messages, {max_new_tokens} in the "
            f"completion). Please reduce the length of the messages or completion "
            f"(at most {max(context - prompt_len, 0)} completion tokens fit).")
