"""The head's training forward: every position of a sequence as a draft root, unrolled `steps` levels deep.

At inference a tree node d levels below the root (position r) runs with its parent's predicted feature
as input and attends over the committed context (rows 0..r, fed the base's true features) and its own
ancestors. Training reproduces that for every root at once (EAGLE-3's training-time test, written here
from its description): level 0 is the teacher-forced sequence (row p: token t_p, feature f_{p-1}, causal
attention); level s (s >= 1) has one row per root p, token t_{p+s}, feature = level s-1's output at p,
attending over level-0 rows 0..p and its own chain (levels 1..s at p). Every level's row p predicts
f_{p+s} and the base's choice after it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flowedge.models.decoder import Rotary
from flowedge.models.draft_head import DraftHead

REG_WEIGHT = 0.2          # feature regression beside the soft cross-entropy
LEVEL_DECAY = 0.8         # weight of level s: LEVEL_DECAY ** s


@dataclass
class LevelOut:
    roots: torch.Tensor   # [R] the root position of each row (level s row r sits at roots[r] + s)
    out: torch.Tensor     # [R, H] predicted features (row r predicts f_{roots[r] + s})
    k: torch.Tensor       # [Hkv, R, D] (rotated) keys of the level's rows
    v: torch.Tensor       # [Hkv, R, D]


def _attend(q: torch.Tensor, roots: torch.Tensor, base: LevelOut, chain: list[LevelOut], group: int) -> torch.Tensor:
    # q [Hq, R, D]; level-0 keys up to each row's root, each chain level's key of the same root -> [R, Hq * D]
    hq, r, d = q.shape
    k0, v0 = base.k.repeat_interleave(group, 0), base.v.repeat_interleave(group, 0)
    seen = torch.arange(k0.shape[1], device=q.device)[None, :] <= roots[:, None]   # [R, T]
    scores = [(q @ k0.transpose(1, 2) / math.sqrt(d)).masked_fill(~seen, float("-inf"))]
    kv = [(c.k.repeat_interleave(group, 0), c.v.repeat_interleave(group, 0)) for c in chain]
    scores += [(q * k).sum(-1, keepdim=True) / math.sqrt(d) for k, _ in kv]
    probs = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)
    t = k0.shape[1]
    out = probs[..., :t] @ v0
    for j, (_, v) in enumerate(kv):
        out = out + probs[..., t + j: t + j + 1] * v
    return out.transpose(0, 1).reshape(r, hq * d)


def _level(head: DraftHead, embedded: torch.Tensor, feats_in: torch.Tensor, roots: torch.Tensor, level: int,
           base: LevelOut | None, chain: list[LevelOut]) -> LevelOut:
    """One level's rows through the head (base None: this is level 0, its own causal base)."""
    cfg, layer = head.config, head.layer
    attn = layer.self_attn
    r = embedded.shape[0]
    x = head.fuse_inputs(embedded, feats_in)
    h = layer.input_layernorm(x)
    rotary = Rotary.at((roots + level).cpu(), cfg.head_dim, cfg.rope_theta, h.dtype)   # tables on the CPU
    rotary = Rotary(rotary.cos.to(h.device), rotary.sin.to(h.device))
    q = rotary.apply(attn.q_proj(h).reshape(r, cfg.num_attention_heads, cfg.head_dim)).transpose(0, 1)
    k = rotary.apply(attn.k_proj(h).reshape(r, cfg.num_key_value_heads, cfg.head_dim)).transpose(0, 1)
    v = attn.v_proj(h).reshape(r, cfg.num_key_value_heads, cfg.head_dim).transpose(0, 1)
    me = LevelOut(roots, x, k, v)
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    a = _attend(q, roots, base or me, chain + ([me] if base is not None else []), group)
    x = x + attn.o_proj(a)
    x = x + layer.mlp(layer.post_attention_layernorm(x))
    me.out = head.norm(x)
    return me


def unrolled(head: DraftHead, embedded: torch.Tensor, feats: torch.Tensor, steps: int,
             roots: torch.Tensor | None = None) -> list[LevelOut]:
    """embedded [T, H] (the base's embedding of each token), feats [T, H] (its features) -> one LevelOut per
    level: level 0 over every position, deeper levels over `roots` (default: every position) that still
    have a token s places on. Level s row r predicts f_{roots[r] + s}."""
    t = embedded.shape[0]
    prev = torch.cat([torch.zeros_like(feats[:1]), feats[:-1]])   # f_{p-1}; zeros before the first token
    every = torch.arange(t, device=embedded.device)
    base = _level(head, embedded, prev, every, 0, None, [])
    roots = every if roots is None else roots.to(embedded.device)
    levels, chain, last = [base], list[LevelOut](), base.out[roots]     # chain levels and `last` align with `roots`
    for s in range(1, min(steps, t)):
        keep = roots < t - s
        roots, last = roots[keep], last[keep]
        if roots.numel() == 0:
            break
        chain = [_rows(c, keep) for c in chain]
        lvl = _level(head, embedded[roots + s], last, roots, s, base, chain)
        chain.append(lvl)
        levels.append(lvl)
        last = lvl.out
    return levels


def _rows(level: LevelOut, keep: torch.Tensor) -> LevelOut:
    """The rows of a chain level whose roots the next level keeps."""
    return LevelOut(level.roots[keep], level.out[keep], level.k[:, keep], level.v[:, keep])


@dataclass
class Losses:
    total: torch.Tensor
    hits: list[int]       # per level: rows whose top-1 is the base's argmax
    rows: list[int]       # per level: rows scored


def losses(head: DraftHead, levels: list[LevelOut], feats: torch.Tensor, top_idx: torch.Tensor,
           top_p: torch.Tensor, level0_rows: torch.Tensor | None = None) -> Losses:
    """Soft cross-entropy against the base's top-k (renormalised over those in the draft vocabulary) plus
    feature regression, per level. top_idx [T, k]: the base's choices as draft-vocabulary indices (-1
    outside it); top_p [T, k] their probabilities; `level0_rows`: the level-0 rows scored (default all)."""
    total = torch.zeros((), device=feats.device)
    hits, rows = [], []
    for s, lvl in enumerate(levels):
        out, at = lvl.out, lvl.roots + s
        if s == 0 and level0_rows is not None:
            out, at = out[level0_rows], at[level0_rows]
        idx, p = top_idx[at], top_p[at].float()
        p = torch.where(idx >= 0, p, torch.zeros_like(p))
        logp = torch.log_softmax(head.logits(out), dim=-1)
        picked = logp.gather(1, idx.clamp(min=0))
        ce = -(p * picked).sum() / p.sum().clamp(min=1e-6)
        reg = F.smooth_l1_loss(out, feats[at].float())
        total = total + LEVEL_DECAY ** s * (ce + REG_WEIGHT * reg)
        hits.append(int((logp.argmax(-1) == idx[:, 0]).sum()))
        rows.append(int(at.numel()))
    return Losses(total, hits, rows)
