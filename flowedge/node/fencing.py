"""Split brain ruled out: the fencing term, and the one rule every node that takes a head's orders keeps.

Every head runs under a term: a head started as such has term 1; a standby that takes over runs under
the highest term it has seen plus one. The head puts its term on its WELCOME and on every HEARTBEAT, and
a node binds its control connection to the term of the WELCOME it accepted (everything later on that
connection is that head's). The rule (`TermGuard`, no I/O):

- a node obeys only the highest term it has seen: a WELCOME or HEARTBEAT with a lower term is refused
  with `StaleTerm` (the node answers REFUSE naming it and joins another head);
- an equal or higher term is obeyed, and a higher one becomes the highest.

So once any stage has joined the new head, a deposed head that comes back (or was only cut off) can
never again drive that stage: its term is lower. Term 0 is an older head's (before 1.8): obeyed only
while no term has been seen. The highest term lives in the node's memory: a restarted stage starts over.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from flowedge.errors import StaleTerm

log = logging.getLogger(__name__)

FIRST_TERM = 1


@dataclass
class TermGuard:
    """The highest term this node has obeyed, and which head spoke it."""
    highest: int = 0
    head: str = ""

    def obey(self, term: int, head: str = "") -> None:
        """Take a head's word under `term`; StaleTerm if a higher term has been seen."""
        if term < self.highest:
            raise StaleTerm(term, self.highest, head)
        if term > self.highest:
            if self.highest:
                log.warning("fencing: term %d (%s) replaces term %d (%s)", term, head or "?", self.highest,
                            self.head or "?")
            self.highest = term
        if head:
            self.head = head


def next_term(seen: int) -> int:
    """The term a standby takes over with, having seen `seen`."""
    return max(seen, FIRST_TERM - 1) + 1
