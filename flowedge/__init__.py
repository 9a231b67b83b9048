"""flowedge: serve an LLM split across small edge devices with pipelined tree speculation."""
from __future__ import annotations

from flowedge.errors import (BackendUnavailable, ClusterNotReady, ConfigError, ContextOverflow, FlowedgeError,
                             ModelError, ProtocolError, RequestFailed, StageLost)

__version__ = "0.1.0"

__all__ = ["__version__", "Client", "AsyncClient", "FlowedgeError", "RequestFailed", "ContextOverflow",
           "ClusterNotReady", "ConfigError", "ModelError", "ProtocolError", "StageLost", "BackendUnavailable"]


def __getattr__(name: str):
    # Lazy so `import flowedge` stays cheap (no torch, no zmq) for the CLI and the client.
    # The errors are plain classes (flowedge.errors imports nothing), so they are imported eagerly.
    if name == "Client":
        from flowedge.daemon.client import Client

        return Client
    if name == "AsyncClient":
        from flowedge.daemon.async_client import AsyncClient

        return AsyncClient
    raise AttributeError(name)
