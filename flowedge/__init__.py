"""flowedge: serve an LLM split across small edge devices with pipelined tree speculation."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flowedge.client.client_answer import Answer, Chunk, Stats, Usage
from flowedge.errors import (BackendUnavailable, Busy, ClusterNotReady, ConfigError, ContextOverflow, FlowedgeError,
                             ModelError, ProtocolError, RequestFailed, StageLost)

if TYPE_CHECKING:   # for type checkers: at run time `__getattr__` imports them when first asked
    from flowedge.client.async_client import AsyncClient
    from flowedge.client.sync_client import Client

__version__ = "0.1.0"

__all__ = ["__version__", "Client", "AsyncClient", "Answer", "Chunk", "Usage", "Stats", "FlowedgeError",
           "RequestFailed", "ContextOverflow", "ClusterNotReady", "Busy", "ConfigError", "ModelError",
           "ProtocolError", "StageLost", "BackendUnavailable"]


def __getattr__(name: str) -> Any:
    # Lazy so `import flowedge` stays cheap (no torch, no zmq) for the CLI and the client.
    # The errors and the answers are plain classes (their modules import nothing heavy), so they are eager.
    if name == "Client":
        from flowedge.client.sync_client import Client

        return Client
    if name == "AsyncClient":
        from flowedge.client.async_client import AsyncClient

        return AsyncClient
    raise AttributeError(name)
