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


def refusal(message: str) -> RequestFailed:
    """The typed error for a head's error reply."""
    return ContextOverflow(message) if message.startswith(ContextOverflow.PREFIX) else RequestFailed(message)


class BackendUnavailable(FlowedgeError):
    """A quantization backend cannot run here; the message names one that can."""


class ProtocolError(FlowedgeError):
    """A peer sent a malformed frame, an unknown message type or a wrong protocol version.

    Its text is cut to MAX_CHARS whatever built it: it often quotes peer input, and a node quotes it
    back in a Refuse or ErrorReply, which must stay sendable (the 5 KB `type` that once ended the head)."""

    MAX_CHARS = 1000

    def __init__(self, message: object = "") -> None:
        super().__init__(bounded(message, self.MAX_CHARS))


def bounded(text: object, max_chars: int) -> str:
    """`text` cut to at most `max_chars` characters (an ellipsis marks the cut)."""
    text = str(text)
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"


class StageLost(FlowedgeError):
    """A pipeline stage stopped answering during a request."""

    def __init__(self, stage: int, last_seen_s: float) -> None:
        super().__init__(f"stage {stage} lost (last heard {last_seen_s:.1f} s ago)")
        self.stage = stage
        self.last_seen_s = last_seen_s
