"""Wire messages: one frozen, self-validating dataclass per message type, gathered here from their
families (msg_control.py, msg_data.py, msg_client.py, msg_draft.py, msg_standby.py; codec in codec.py). Import
messages from here:
importing this module registers every type, which `decode` needs.

Frame layout of every message (see frames.py for the tensor rules):

    frame 0   msgpack map {"v": [major, minor], "type": "<TYPE>", <scalar fields...>,
                           "tensors": {"<field>": {"dtype": ..., "shape": [...]}, ...}}
    frame 1.. one raw buffer per tensor field that is present, in the order of "tensors"

Compatibility: every header carries "v". A receiver refuses a different MAJOR version on any message
(ProtocolError "peer speaks flowedge protocol 2.0, this node speaks 1.0"); a newer minor may add
fields with defaults, and unknown header keys are ignored. A minor that changes a message's layout raises
that message's `MIN_MINOR` (1.9 renamed the data plane's `request_id` to `run_id`): an older peer's copy is
refused by name, and a stage and head whose data planes differ refuse each other at HELLO, naming both
versions (node/membership.py). `Refuse` is frozen forever ({"reason"}), so it is decoded whatever the
major version and a refused peer can always read why.

Topology: the head (node 0) feeds stage 1; stage k forwards to stage k+1; the last stage returns
hidden states to the head, or (1.2, when it holds the lm_head and the request's prefill carried
sampling params) the base model's chosen token per node. Control messages (HELLO/ASSIGN/SHARD/READY/HEARTBEAT)
go stage <-> head, client messages client <-> head, pre-draft jobs and their answers (1.5) head <-> drafter,
the request log and head state (1.8) head -> standby.

Round restarts are folded into `Prune` (there is no NewRound): a Prune whose round_id is newer than
the stage's current round commits `commit_ids` into the prefix and keeps only `keep_ids` of the tree.
One message means a restart can never overtake or be overtaken by its own prune set.

Messages are keyword-only, so a reordered field can never silently swap two integers. Index tensors
(node ids, positions, prune sets, token ids) may be any integer dtype when built locally, travel as
int16/int32 and are decoded as int64. Hidden states are decoded in their wire dtype (fp16/bf16)
without a copy; cast them to the compute dtype. Never modify a tensor in place after sending it.
"""
from __future__ import annotations

from typing import Any

from flowedge.transport.codec import (  # noqa: F401  (re-exported: the protocol's public surface)
    BYTES,
    HIDDEN,
    HIDDEN_WIRE_NAMES,
    INDEX,
    MAX_HEADER_BYTES,
    MAX_LIST_ITEMS,
    MAX_SHARD_CHUNK_BYTES,
    MAX_TEXT_CHARS,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    ROLES,
    SEGMENT_KINDS,
    SHARD_CHUNK_BYTES,
    TOKENS,
    Message,
    _fail,
    _float,
    _index,
    _ints,
    _map,
    _sha256,
    _str,
    _tokens,
    _text,
    bounded,
    quote,
    too_long,
    _version,
    check_version,
    decode,
    encode,
    is_tensor,
    version_text,
)
from flowedge.transport.msg_client import (  # noqa: F401
    CHAT_ROLES,
    MAX_MESSAGES,
    MAX_PROMPT_CHARS,
    MAX_STOP_CHARS,
    MAX_STOPS,
    Cancel,
    ErrorReply,
    PromptRequest,
    StatusReply,
    StatusRequest,
    TokenChunk,
)
from flowedge.transport.msg_control import (  # noqa: F401
    Assign,
    Heartbeat,
    Hello,
    Ready,
    Refuse,
    RequestDropped,
    ShardChunk,
    ShardRequest,
    Shutdown,
    Welcome,
)
from flowedge.transport.msg_data import Prune, Reset, Segment  # noqa: F401
from flowedge.transport.msg_standby import HeadState, LogEntry  # noqa: F401
from flowedge.transport.msg_draft import (  # noqa: F401
    DraftAnswer,
    DraftDeclined,
    DraftJob,
    DraftReady,
    DraftSetup,
)


def data_plane_refusal(peer: tuple[int, int], role: str) -> str | None:
    """Why this node and a `role` peer speaking `peer` cannot share a data plane (None: they can): the
    peer's segments and prune sets would be refused one by one (`Segment.MIN_MINOR`), so it is turned away at
    HELLO (a head refusing a stage, a stage a head's WELCOME), naming both versions."""
    if peer[0] != PROTOCOL_VERSION[0] or peer[1] >= Segment.MIN_MINOR:
        return None   # another major is refused by check_version already
    return (f"{role} speaks flowedge protocol {version_text(peer)}, this node speaks "
            f"{version_text(PROTOCOL_VERSION)}: the data plane needs {PROTOCOL_VERSION[0]}.{Segment.MIN_MINOR} or "
            f"newer on both sides (it names the engine run `run_id`): upgrade the {role}")


def __getattr__(name: str) -> Any:
    if name == "WIRE_DTYPES":   # the data plane's torch dtype table, loaded on first use
        from flowedge.transport.frames import WIRE_DTYPES

        return WIRE_DTYPES
    raise AttributeError(name)
