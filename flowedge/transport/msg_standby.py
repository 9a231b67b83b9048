"""Head -> standby messages (1.8): the request log and the head's state, which a standby head follows so
that it can take over (node/standby.py). Both carry the head's fencing term (node/fencing.py).

The log is keyed by whom a request belongs to on the wire: the client's node id (its HELLO) and the
request id on that client's connection. A client that reconnects to the new head sends the same pair
again (PromptRequest.resumed), which is how the two are matched."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar

from flowedge.transport.codec import MESSAGE_OPTIONS, TOKENS, Message, _fail, _ints, _str, _tokens

MAX_MEMBERS = 256


@dataclass(**MESSAGE_OPTIONS)
class LogEntry(Message):
    """Tokens of request (`client`, `request_id`) committed at positions [start, start + len(tokens)); `done`:
    the request was answered in full (kept a while: a client that missed the end gets it from the new head);
    `failed`: it ended with an error or was cancelled, and is forgotten."""

    TYPE: ClassVar[str] = "log-entry"
    MIN_MINOR: ClassVar[int] = 8
    WIRE: ClassVar[dict[str, str]] = {"tokens": TOKENS}
    term: int
    client: str
    request_id: int
    start: int = 0
    tokens: tuple[int, ...] = ()
    done: bool = False
    failed: bool = False

    def __post_init__(self) -> None:
        _ints(self, "term", "request_id", "start")
        _str(self, "client", max_len=256)
        _tokens(self, "tokens")
        for name in ("done", "failed"):
            if type(getattr(self, name)) is not bool:
                raise _fail(self, name, "a bool")


@dataclass(**MESSAGE_OPTIONS)
class HeadState(Message):
    """The head's term and membership, sent to a standby every heartbeat period (its liveness, too)."""

    TYPE: ClassVar[str] = "head-state"
    MIN_MINOR: ClassVar[int] = 8
    term: int
    head_id: str
    stages: list[str] = field(default_factory=list)   # node ids of the stages, slot order ("" for an empty slot)
    ready: bool = False
    layers: list[int] = field(default_factory=list)   # the plan's layer count per slot (changes with a re-plan)

    def __post_init__(self) -> None:
        _ints(self, "term")
        _str(self, "head_id", max_len=256)
        if not isinstance(self.stages, (list, tuple)) or len(self.stages) > MAX_MEMBERS or not all(
                isinstance(s, str) and len(s) <= 256 for s in self.stages):
            raise _fail(self, "stages", f"at most {MAX_MEMBERS} node ids")
        object.__setattr__(self, "stages", list(self.stages))
        if type(self.ready) is not bool:
            raise _fail(self, "ready", "a bool")
        if not isinstance(self.layers, (list, tuple)) or len(self.layers) > MAX_MEMBERS or not all(
                type(n) is int and 0 < n < 1 << 16 for n in self.layers):
            raise _fail(self, "layers", f"at most {MAX_MEMBERS} layer counts, each 1..65535")
        object.__setattr__(self, "layers", list(self.layers))


# A standby refuses every HELLO at its own address until it takes over (a client trying addresses in turn
# moves on at once); the refusal's wording is fixed so that `flowedge status` asked there can read it back.
STANDBY_REFUSAL = re.compile(r"(?P<name>\S+) is a standby, not the head \(the head is at (?P<head>\S+?)"
                             r"(?:, term (?P<term>\d+))?\)")


def standby_refusal(name: str, head: str, term: int) -> str:
    """The reason a standby gives a HELLO at its own address (STANDBY_REFUSAL reads it back)."""
    return f"{name} is a standby, not the head (the head is at {head}, term {term})"
