"""Pre-draft jobs and answers between the engine's values (engine/draft_sync.py: DraftSnapshot,
DraftGrowth) and the wire (transport/msg_draft.py), with the checks that need the draft model: token ids
within its vocabulary, K/V rows of its layers, heads and head size, and rows checked by value (finite and
at most `MAX_KV_ABS` in magnitude). A message that passes them can be loaded into a replica or grafted
into node 0's tree without an index error or an overflow: peer input never reaches a tensor op unchecked.

Why `MAX_KV_ABS` is float16's largest value: the same draft model runs with a half-precision cache on the
boards, so an honest drafter's K/V fit float16 whatever dtype it computes in (real K/V are tens to
hundreds), while rows near float32's limit (3e38) are finite yet overflow node 0's attention to inf and
its draft scores to NaN."""
from __future__ import annotations

import torch

from flowedge.engine.draft_sync import DraftGrowth, DraftSnapshot, check_growth
from flowedge.errors import ProtocolError
from flowedge.transport import protocol as proto
from flowedge.transport.frames import dtype_name

MAX_KV_ABS = 65504.0   # float16's largest finite value (see the module docstring)


def _wire_parents(parents: torch.Tensor) -> torch.Tensor:
    return parents[1:]   # the root's parent (-1) is implied


def _parents(wire: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.tensor([-1]), wire.to(torch.long)])


def job_message(key: int, seq: int, snap: DraftSnapshot) -> proto.DraftJob:
    """Node 0's snapshot as the job for request `key`'s replica."""
    return proto.DraftJob(request_id=key, seq=seq, keep=snap.keep, calls=snap.calls, width=snap.width,
                          lookup=snap.lookup, topk=snap.topk, context=snap.context, tokens=snap.tokens,
                          parents=_wire_parents(snap.parents), log_scores=snap.log_scores, ran=snap.ran,
                          rows=snap.rows, hidden_wire=dtype_name(snap.rows.dtype))


def snapshot_of(msg: proto.DraftJob, model) -> DraftSnapshot:
    """The snapshot a job carries, checked against the drafter's draft model."""
    check_tokens(msg.context, model, "context")
    check_tokens(msg.tokens, model, "tokens")
    rows = check_rows(msg.rows, model)
    return DraftSnapshot(tuple(msg.context), msg.keep, msg.tokens.to(torch.long), _parents(msg.parents),
                         msg.log_scores.clone(), msg.ran.to(torch.long), rows, msg.topk, msg.calls, msg.width,
                         msg.lookup)


def answer_message(key: int, seq: int, growth: DraftGrowth) -> proto.DraftAnswer:
    return proto.DraftAnswer(request_id=key, seq=seq, tokens=growth.tokens, parents=_wire_parents(growth.parents),
                             log_scores=growth.log_scores, ran=growth.ran, rows=growth.rows,
                             calls=[(int(t), int(c), float(s)) for t, c, s in growth.calls],
                             hidden_wire=dtype_name(growth.rows.dtype))


def growth_of(msg: proto.DraftAnswer, snap: DraftSnapshot, model) -> DraftGrowth:
    """The growth an answer carries for the job made from `snap`, checked against node 0's draft model:
    it keeps the job's nodes first, under the same ids."""
    n = int(snap.tokens.numel())
    if msg.tokens.numel() < n or not torch.equal(msg.tokens[:n].to(torch.long), snap.tokens) or \
            not torch.equal(_parents(msg.parents)[:n], snap.parents):
        raise ProtocolError(f"draft answer {msg.seq} does not keep the job's {n} nodes first")
    check_tokens(msg.tokens, model, "tokens")
    rows = check_rows(msg.rows, model)
    growth = DraftGrowth(snap.context, msg.tokens.to(torch.long), _parents(msg.parents), msg.log_scores.clone(),
                         msg.ran.to(torch.long), rows, list(msg.calls))
    try:
        check_growth(snap, growth)   # values, not only shapes: a drafter is a peer, not trusted
    except ValueError as err:
        raise ProtocolError(f"draft answer {msg.seq}: {err}") from None
    return growth


def check_tokens(ids, model, name: str) -> None:
    vocab = int(model.config.vocab_size)
    top = max(ids) if isinstance(ids, tuple) and ids else int(ids.max()) if torch.is_tensor(ids) and ids.numel() else 0
    if top >= vocab:
        raise ProtocolError(f"draft message {name}: token id {top} outside the draft model's vocabulary ({vocab})")


def check_rows(rows: torch.Tensor, model) -> torch.Tensor:
    """K/V rows of this draft model's cache ([layers, 2, kv_heads, n, head_dim]), in its dtype."""
    cfg = model.config
    want = (int(cfg.num_hidden_layers), 2, int(cfg.num_key_value_heads), int(cfg.head_dim))
    got = (rows.shape[0], rows.shape[1], rows.shape[2], rows.shape[4])
    if got != want:
        raise ProtocolError(f"draft message rows: K/V of shape [layers, 2, kv_heads, n, head_dim] = "
                            f"{list(rows.shape)}, this draft model's are {list(want[:3])} x n x {want[3]}")
    check_row_values(rows)
    return rows.to(model.dtype)


def check_row_values(rows: torch.Tensor) -> None:
    """K/V values an attention can take: finite and within +-MAX_KV_ABS."""
    if rows.numel() and not bool(rows.isfinite().all()):
        raise ProtocolError("draft message rows: K/V values must be finite (no NaN or inf)")
    top = float(rows.abs().max()) if rows.numel() else 0.0
    if top > MAX_KV_ABS:
        raise ProtocolError(f"draft message rows: K/V values must lie within +-{MAX_KV_ABS:g}, got {top:.3g}")
