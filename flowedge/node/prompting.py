"""From a client's request to the model's prompt ids, and stop strings over the answer's text.

The head calls `prompt_ids` once per request and feeds each new text piece through a `StopText`;
nothing here knows about sockets or the engine.
"""
from __future__ import annotations

from flowedge.errors import PromptError


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


class StopText:
    """Cuts a stream of text pieces at the first occurrence of any stop string.

    `feed` returns the text that is safe to show now: a tail that might be the start of a stop string
    is held back until the next piece decides it. After a hit (`hit` is True) everything is dropped."""

    def __init__(self, stops: list[str] | tuple[str, ...] = ()) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""
        self.hit = False

    def feed(self, piece: str) -> str:
        if self.hit:
            return ""
        if not self.stops:
            return piece
        text = self.held + piece
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.hit, self.held = True, ""
            return text[:min(found)]
        keep = max(self._partial(text, s) for s in self.stops)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def finish(self, piece: str = "") -> str:
        """The last piece plus whatever was held back (the answer ended without a stop string)."""
        out = self.feed(piece)
        out, self.held = out + self.held, ""
        return out

    @staticmethod
    def _partial(text: str, stop: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of `stop`."""
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                return k
        return 0
