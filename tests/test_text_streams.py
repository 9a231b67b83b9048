"""The text stream's pieces depend on the token ids alone, not on how they were fed in: a head that took
over feeds the tokens a client holds in one call, where the old head fed them as they were verified, and
both must stand at the same place or the client gets text twice (seen in a soak: a tiny model's answer
held an unfinished UTF-8 character when the head was killed, and the HTTP stream repeated its start)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from flowedge.text.streams import TextStream


class ByteTokenizer:
    """Token id n is the byte n: split characters and invalid bytes, as a byte-level BPE model makes them."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def shown_after_each_feed(ids: list[int], cuts: list[int]) -> list[tuple[int, str]]:
    pieces: list[str] = []
    stream = TextStream(ByteTokenizer(), pieces.append)
    seen, start = [], 0
    for end in [*sorted(set(cuts)), len(ids)]:
        if end <= start:
            continue
        stream(ids[start:end])
        start = end
        seen.append((end, "".join(pieces)))
    stream.flush()
    seen.append((-1, "".join(pieces)))
    return seen


UTF8_PIECES = st.lists(st.sampled_from(["a", "é", "€", "😀", "_", " "]), max_size=12).map(
    lambda chars: list("".join(chars).encode()))
BYTES = st.one_of(UTF8_PIECES, st.lists(st.integers(0, 255), max_size=24))


@settings(max_examples=300, deadline=None)
@given(ids=BYTES, cuts_a=st.lists(st.integers(0, 24), max_size=8), cuts_b=st.lists(st.integers(0, 24), max_size=8))
def test_what_is_shown_after_some_ids_does_not_depend_on_how_they_were_fed(ids, cuts_a, cuts_b):
    a = dict(shown_after_each_feed(ids, cuts_a))
    b = dict(shown_after_each_feed(ids, cuts_b))
    for end in set(a) & set(b):
        assert a[end] == b[end], (ids, end)
    assert a[-1] == b[-1] == ByteTokenizer().decode(ids)   # all of it once flushed


def test_a_stream_fed_what_a_client_holds_sends_only_what_it_lacks():
    """"hé" held up to the first byte of "é", then the rest: the old rule showed nothing for the held part
    fed at once (it ended inside a character), so everything, the client's "h" included, went out again."""
    ids = list("héllo".encode())
    client: list[str] = []
    old_head = TextStream(ByteTokenizer(), client.append)
    for i in ids[:2]:
        old_head([i])
    rest: list[str] = []
    new_head = TextStream(ByteTokenizer(), rest.append)
    new_head(ids[:2])
    assert "".join(rest) == "".join(client) == "h"
    rest.clear()
    new_head(ids[2:])
    new_head.flush()
    assert "".join(client) + "".join(rest) == "héllo"
