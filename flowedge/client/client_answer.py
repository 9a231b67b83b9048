"""What a client gets back, typed: a streamed `Chunk`, and the `Answer` a request ends with.

    answer = client.generate("Write a haiku about routers", max_tokens=64)
    answer.text, answer.token_ids, answer.finish_reason        # "stop" | "length"
    answer.usage.prompt_tokens, answer.usage.completion_tokens  # as OpenAI's usage
    answer.stats.strategy, answer.stats.mean_accept_len         # how the cluster produced it (the head's figures)

Answers used to be dicts; `answer["token_ids"]`, `answer.get("auto")` and `answer.to_dict()` still give
that dict's values (the keys of `flowedge generate --json`, plus the client's wall-clock figures).
Plain frozen dataclasses: nothing here imports torch, zmq or the rest of flowedge.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any



@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens in and out, as OpenAI's `usage`."""
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class Stats:
    """How the cluster produced an answer, as the head measured it. `figures` holds every figure the head
    sent (these too, and the strategy's own: `auto`, `predraft`, `tree_depth`, ...)."""
    strategy: str = ""
    steps: int = 0                        # pipeline steps
    mean_accept_len: float | None = None  # tokens accepted per verification (None: nothing verified)
    wall_s: float = 0.0                   # at the head: the request's arrival to its last token
    tokens_per_s: float | None = None     # at the head
    replays: int = 0                      # times a lost stage made the head replay the request
    figures: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), compare=False)

    @classmethod
    def from_figures(cls, figures: Mapping[str, Any]) -> Stats:
        get = figures.get
        return cls(strategy=str(get("strategy") or ""), steps=int(get("steps") or 0),
                   mean_accept_len=_float_or_none(get("mean_accept_len")), wall_s=float(get("wall_s") or 0.0),
                   tokens_per_s=_float_or_none(get("tokens_per_s")), replays=int(get("replays") or 0),
                   figures=MappingProxyType(dict(figures)))


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole answer: its text and tokens, why it ended, and what it cost (client and head figures)."""
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str                   # "stop" (end of text or a stop string) | "length" (max_new_tokens)
    usage: Usage
    stats: Stats
    client_wall_s: float                 # this client's wall clock: request sent to last chunk
    first_token_s: float | None          # ... to the first token (None: no token)
    wall_tokens_per_s: float | None      # new tokens over client_wall_s

    def to_dict(self) -> dict[str, Any]:
        """The answer as the dict it used to be (what `flowedge prompt --json` prints)."""
        return {**self.stats.figures, "text": self.text, "token_ids": list(self.token_ids),
                "client_wall_s": self.client_wall_s, "wall_tokens_per_s": self.wall_tokens_per_s,
                "first_token_s": self.first_token_s}

    def __getitem__(self, key: str) -> Any:
        """`answer["token_ids"]`, as when answers were dicts (the typed fields are the way now)."""
        return self.to_dict()[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.to_dict().get(key, default)


@dataclass(frozen=True, slots=True)
class Chunk:
    """New text of a streamed answer and the token ids it came from; the last chunk of a stream carries
    the whole `answer` (and no new text)."""
    text: str
    token_ids: tuple[int, ...] = ()
    answer: Answer | None = None

    @property
    def done(self) -> bool:
        return self.answer is not None

    def __str__(self) -> str:
        return self.text


def answer_from(figures: Mapping[str, Any], text: str, token_ids: tuple[int, ...], *, client_wall_s: float,
                first_token_s: float | None) -> Answer:
    """An Answer from the head's figures for a finished request and what the client collected."""
    wall = round(client_wall_s, 4)
    stop = figures.get("finish_reason")
    return Answer(text=text, token_ids=token_ids, finish_reason=stop if isinstance(stop, str) else "stop",
                  usage=Usage(int(figures.get("prompt_tokens") or 0), len(token_ids)),
                  stats=Stats.from_figures(figures), client_wall_s=wall,
                  first_token_s=round(first_token_s, 4) if first_token_s is not None else None,
                  wall_tokens_per_s=round(len(token_ids) / client_wall_s, 3) if client_wall_s > 0 else None)


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)
