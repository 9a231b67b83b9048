"""Client <-> head messages: PromptRequest and Cancel in, TokenChunk and ErrorReply out, and the status
pair. Torch-free, so a gateway that only sends text never imports torch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from flowedge.errors import ProtocolError
from flowedge.transport.codec import (
    MAX_HEADER_BYTES,
    MAX_LIST_ITEMS,
    MESSAGE_OPTIONS,
    Message,
    TOKENS,
    _fail,
    _float,
    _ints,
    _map,
    _str,
    _text,
    _tokens,
    too_long,
)


MAX_MESSAGES = 1024          # turns in one conversation
MAX_STOPS = 16               # stop strings in one request
MAX_STOP_CHARS = 256         # characters in one stop string
MAX_PROMPT_CHARS = MAX_HEADER_BYTES // 2   # characters of prompt text (or of all turns' content)
CHAT_ROLES = ("system", "user", "assistant")
MAX_CLIENT_CHARS = 128       # a client's name (PromptRequest.client)


@dataclass(**MESSAGE_OPTIONS)
class PromptRequest(Message):
    """Client -> head: generate up to `max_new_tokens` after `text`, `token_ids` or `messages` (exactly one).

    `top_k`/`top_p` None means no such filter; `seed` None means a random seed.
    1.3: `messages` is a conversation ([{"role": "system"|"user"|"assistant", "content": str}]) put
    through the model's chat template; `raw` sends `text` to the model as is (no template); `stop`
    ends the answer where its text first contains one of these strings (the stop string is cut off).
    1.7: `client` names whom the request is for, when a gateway (the HTTP API) asks on behalf of many:
    the head queues each client's requests in a lane of its own and caps each lane (empty: the
    connection is the client). Any node with the cluster's keys may set it.
    1.8: `resumed` >= 0 sends again a request the client began with a head that was lost: the client
    already holds that many of its tokens (`held_ids`), and the new head continues after the committed
    ones (node/replication.py). -1: a new request.
    """

    TYPE: ClassVar[str] = "prompt"
    WIRE: ClassVar[dict[str, str]] = {"token_ids": TOKENS, "held_ids": TOKENS}
    request_id: int
    max_new_tokens: int
    text: str | None = None
    token_ids: tuple[int, ...] | None = None  # [p]; a list, array or tensor is stored as a tuple
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    strategy: str = "flowspec"
    messages: list[dict[str, str]] | None = None
    stop: list[str] = field(default_factory=list)
    raw: bool = False
    client: str = ""
    resumed: int = -1
    held_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _ints(self, "request_id")
        _ints(self, "max_new_tokens", lo=1, hi=1 << 20)
        _ints(self, "resumed", lo=-1, hi=1 << 20)
        _tokens(self, "held_ids", optional=True)
        if self.held_ids is not None and len(self.held_ids) != self.resumed:
            raise _fail(self, "held_ids", f"the {self.resumed} tokens `resumed` counts")
        _str(self, "client", max_len=MAX_CLIENT_CHARS)
        if sum(x is not None for x in (self.text, self.token_ids, self.messages)) != 1:
            raise ProtocolError("prompt carries exactly one of text, token_ids or messages")
        if self.text is not None:
            _str(self, "text", max_len=MAX_PROMPT_CHARS)
        _tokens(self, "token_ids", optional=True)
        if self.text == "" or self.token_ids == ():
            raise ProtocolError("the prompt is empty")
        if self.messages is not None:
            _messages(self)
        _float(self, "temperature", 0.0, 100.0)
        _ints(self, "top_k", lo=1, hi=1 << 31, optional=True)
        _float(self, "top_p", 1e-9, 1.0, optional=True)
        _ints(self, "seed", optional=True)
        _str(self, "strategy", max_len=64)
        if not isinstance(self.stop, (list, tuple)) or len(self.stop) > MAX_STOPS or not all(
                isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop):
            raise _fail(self, "stop", f"at most {MAX_STOPS} non-empty strings of <= {MAX_STOP_CHARS} characters")
        object.__setattr__(self, "stop", list(self.stop))
        if type(self.raw) is not bool:
            raise _fail(self, "raw", "a bool")


def _messages(msg: PromptRequest) -> None:
    turns = msg.messages
    if not isinstance(turns, (list, tuple)) or not 0 < len(turns) <= MAX_MESSAGES or not all(
            isinstance(t, dict) and set(t) == {"role", "content"} and t["role"] in CHAT_ROLES
            and isinstance(t["content"], str) for t in turns):
        raise _fail(msg, "messages", f"1..{MAX_MESSAGES} maps {{role: one of {list(CHAT_ROLES)}, content: str}}")
    chars = sum(len(t["content"]) for t in turns)
    if chars > MAX_PROMPT_CHARS:
        raise too_long(msg, "messages", chars, MAX_PROMPT_CHARS)
    object.__setattr__(msg, "messages", [dict(t) for t in turns])


@dataclass(**MESSAGE_OPTIONS)
class Cancel(Message):
    """Client -> head (1.3): stop my request `request_id` (queued or running) and free its KV cache."""

    TYPE: ClassVar[str] = "cancel"
    request_id: int

    def __post_init__(self) -> None:
        _ints(self, "request_id")


@dataclass(**MESSAGE_OPTIONS)
class TokenChunk(Message):
    """Head -> client: newly committed tokens; the last chunk has done=True and carries `stats`."""

    TYPE: ClassVar[str] = "tokens"
    WIRE: ClassVar[dict[str, str]] = {"token_ids": TOKENS}
    request_id: int
    token_ids: tuple[int, ...]  # [t]; a list, array or tensor is stored as a tuple
    text: str
    done: bool
    stats: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        _ints(self, "request_id")
        _tokens(self, "token_ids")
        _str(self, "text", max_len=MAX_HEADER_BYTES // 2)
        if type(self.done) is not bool:
            raise _fail(self, "done", "a bool")
        _map(self, "stats", optional=True)


@dataclass(**MESSAGE_OPTIONS)
class ErrorReply(Message):
    """Head -> client: the request failed; `message` is the one-line error."""

    TYPE: ClassVar[str] = "error"
    request_id: int
    message: str

    def __post_init__(self) -> None:
        _ints(self, "request_id")
        _text(self, "message")


@dataclass(**MESSAGE_OPTIONS)
class StatusRequest(Message):
    """Client -> head: describe the cluster. 1.7: `timeline` asks for the head's recent past too (its
    row's `timeline`: a sample a second of the last minutes, node/timeline.py); an older head ignores it."""

    TYPE: ClassVar[str] = "status_request"
    timeline: bool = False

    def __post_init__(self) -> None:
        if type(self.timeline) is not bool:
            raise _fail(self, "timeline", "a bool")


@dataclass(**MESSAGE_OPTIONS)
class StatusReply(Message):
    """Head -> client: one map per node (id, role, stage, layers, device, load, last_seen_s...)."""

    TYPE: ClassVar[str] = "status"
    nodes: list[dict[str, Any]]

    def __post_init__(self) -> None:
        nodes = self.nodes
        if not isinstance(nodes, list) or len(nodes) > MAX_LIST_ITEMS or not all(
            isinstance(n, dict) and all(isinstance(k, str) for k in n) for n in nodes
        ):
            raise _fail(self, "nodes", "a list of maps with string keys")
