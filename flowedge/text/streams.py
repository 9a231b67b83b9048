"""Text as an answer streams out: token ids to printable pieces as they arrive (`TextStream`, holding back a
split UTF-8 character), and those pieces cut at the first stop string (`StopText`, holding back a tail that
may start one). Nothing here knows about sockets or the engine."""
from __future__ import annotations

from collections.abc import Callable


class TextStream:
    """Turns token ids into printable text pieces as they arrive (holds back split UTF-8 characters).

    What has been shown after any number of ids is a function of those ids alone, never of how they were
    fed in (one at a time, a verified run at once, or a whole answer's held part after a head failover):
    the decoded text less its trailing replacement characters, which are the bytes of a character not yet
    complete. A new head that feeds the tokens a client holds therefore stands where the old head's stream
    stood, and sends on exactly the text the client lacks."""

    def __init__(self, tokenizer, sink: Callable[[str], None]) -> None:
        self.tokenizer, self.sink = tokenizer, sink
        self.ids: list[int] = []
        self.shown = 0

    def __call__(self, new_ids: list[int]) -> None:
        self.ids.extend(new_ids)
        self._emit(final=False)

    def flush(self) -> None:
        """Show whatever is held back (the answer ended inside a character)."""
        self._emit(final=True)

    def _emit(self, final: bool) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not final:
            text = text.rstrip("\ufffd")   # a character still split: what comes before it is settled
        if len(text) > self.shown:
            self.sink(text[self.shown:])
            self.shown = len(text)


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
