"""Typed errors: every failure a user or peer can cause has a class and a one-line message."""
from __future__ import annotations


class FlowedgeError(Exception):
    """Base class; the CLI prints `error: <message>` and exits non-zero for these."""


class ConfigError(FlowedgeError):
    """Invalid user configuration: flags, config file, sampling values, tree sizes."""


class ModelError(FlowedgeError):
    """A model cannot be found, downloaded, verified or loaded."""


class ChecksumError(ModelError):
    """A file's sha256 differs from the one recorded for it."""


class RequestFailed(FlowedgeError):
    """The head answered a request with an error (bad input, cluster not ready, a stage died...)."""


class ContextOverflow(RequestFailed):
    """Prompt plus requested tokens do not fit the model's context window.

    Its message starts with PREFIX, which is how a client tells it apart in the head's one-line
    error reply (the wire carries text, not classes)."""

    PREFIX = "context overflow: "

    def __init__(self, message: object = "") -> None:
        text = str(message)
        super().__init__(text if text.startswith(self.PREFIX) else self.PREFIX + text)


class ClusterNotReady(RequestFailed):
    """The cluster cannot answer now: a stage slot is empty (or loading) and did not fill in time. Worth
    retrying later; the message names the missing stage(s). Its message starts with PREFIX, as the head
    sends it."""

    PREFIX = "cluster not ready: "


class Busy(RequestFailed):
    """The head refused a request because its client already has as many waiting as it may
    (`max_queued_per_client`): nothing is wrong with the request, retry it once some have started.

    Told apart in the head's error reply by PREFIX, as ContextOverflow is."""

    PREFIX = "busy: "

    def __init__(self, message: object = "") -> None:
        text = str(message)
        super().__init__(text if text.startswith(self.PREFIX) else self.PREFIX + text)


def refusal(message: str) -> RequestFailed:
    """The typed error for a head's error reply."""
    for kind in (ContextOverflow, ClusterNotReady, Busy):
        if message.startswith(kind.PREFIX):
            return kind(message)
    return RequestFailed(message)


class HeadUnreachable(FlowedgeError):
    """A client found no head to talk to: nothing answered its HELLO, or what answered refused it or spoke
    another protocol. Retrying at once does not help (an HTTP front tells its clients not to)."""


class BackendUnavailable(FlowedgeError):
    """A quantization backend cannot run here; the message names one that can."""


class ProtocolError(FlowedgeError):
    """A peer sent a malformed frame, an unknown message type or a wrong protocol version.

    Its text is cut to MAX_CHARS whatever built it: it often quotes peer input, and a node quotes it
    back in a Refuse or ErrorReply, which must stay sendable (the 5 KB `type` that once ended the head)."""

    MAX_CHARS = 1000

    def __init__(self, message: object = "") -> None:
        super().__init__(bounded(message, self.MAX_CHARS))


class Refused(ProtocolError):
    """A peer answered, and the answer was no: it sent a Refuse (wrong keys, a slot taken...) or speaks
    another protocol version. Asking again at once gets the same answer, unlike a peer that is silent."""


class VersionMismatch(Refused):
    """A peer speaks a protocol version this node cannot read (another major, or a minor too old for a
    message type)."""


class BodyRefused(FlowedgeError):
    """An HTTP request body the front will not read: `status` is 400 (malformed or incomplete) or 413
    (over the size limit)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def bounded(text: object, max_chars: int) -> str:
    """`text` cut to at most `max_chars` characters (an ellipsis marks the cut)."""
    text = str(text)
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"


class StageLost(FlowedgeError):
    """A pipeline stage left its slot: disconnected, silent past its liveness, or replaced.

    The head's membership emits it as an event (so two with the same fields are equal) and the
    request book pauses the stage's requests on it; raised, it is the error of whatever that loss ends."""

    def __init__(self, stage: int, node_id: str = "", why: str = "lost") -> None:
        self.stage, self.node_id, self.why = stage, node_id, why
        super().__init__(self.describe())

    def describe(self) -> str:
        return f"stage {self.stage} ({self.node_id}) {self.why}" if self.node_id else f"stage {self.stage} {self.why}"

    def _key(self) -> tuple[int, str, str]:
        return self.stage, self.node_id, self.why

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._key() == self._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"StageLost({self.stage!r}, {self.node_id!r}, {self.why!r})"


class HeadRefusedStandby(FlowedgeError):
    """The head will not have this standby (it speaks an older protocol, or said why): nothing to follow."""


class StaleTerm(ProtocolError):
    """A head spoke with a fencing term lower than one this node has already obeyed: it was replaced by
    a standby (node/fencing.py), and this node does not take its orders."""

    PREFIX = "StaleTerm: "

    def __init__(self, term: int, highest: int, head: str = "") -> None:
        self.term, self.highest = term, highest
        who = f"head {head} " if head else "a head "
        super().__init__(f"{self.PREFIX}{who}speaks with fencing term {term}, but this node obeys term "
                         f"{highest} (a newer head took over)")


class HeadLost(FlowedgeError):
    """A client lost its head (the connection closed, or it went silent): with other head addresses it
    may follow the cluster to the standby that takes over (client/sync_client.py)."""


class Rejoin(FlowedgeError):
    """A stage node's head went away or re-planned: the node starts its join sequence again."""


class PlanError(ConfigError):
    """The model does not fit the devices (the message says how much memory is missing where)."""


class PromptError(FlowedgeError):
    """The request's prompt cannot be built (no chat template, a template that refuses the turns)."""


class BuildError(FlowedgeError):
    """A native kernel's C source could not be compiled or loaded here (torch's kernels serve instead)."""


class InvalidMessage(ProtocolError):
    """A decode-valid message that breaks a data-plane rule; `rule` is a short stable key."""

    def __init__(self, rule: str, detail: object) -> None:
        super().__init__(f"{rule}: {bounded(detail, 256)}")
        self.rule = rule


class ApiError(FlowedgeError):
    """The HTTP front's answer to a failed call: status, OpenAI error type, metrics outcome, code, param."""

    def __init__(self, status: int, message: str, kind: str, outcome: str, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.outcome, self.code, self.param = status, kind, outcome, code, param
        self.headers = headers or {}


class LinkError(FlowedgeError):
    """The transport cannot do what was asked (an address taken, a peer gone, the link closed)."""


class AddressInUse(LinkError):
    """No port of the asked range could be listened on."""


class PeerUnreachable(LinkError):
    """A send found no peer to take it (gone, never there, or not taking more): the message is dropped."""


class ReplicaBehind(FlowedgeError):
    """A drafter's replica lacks the committed K/V rows a pre-draft job assumes (a restarted drafter, an
    evicted request): node 0 ships the whole context next time (engine/draft_sync.py)."""


class UnfitStat(FlowedgeError):
    """A peer's heartbeat stats value that the head's schema refuses: its key is dropped and counted
    (node/peer_stats.py), never raised past the boundary."""
