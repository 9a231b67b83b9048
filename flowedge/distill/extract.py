"""The base model's side of self-distillation: its features and choices over teacher-forced text, and its
own answers to instructions, decoded greedily several at a time (one packed forward per step: each
request attends over its own KV cache, `StageModel.forward_packed`), features recorded as they come."""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from flowedge.distill.store import FeatureStore, Record
from flowedge.models.stage import StageModel, bool_to_float_mask, causal_mask

log = logging.getLogger(__name__)

TOPK = 8   # base choices kept per position (soft labels for the head)


@torch.inference_mode()
def record_of(model: StageModel, tokens: torch.Tensor, hidden: torch.Tensor) -> Record:
    """tokens [T], the base's final hidden states there [T, H] -> a training record."""
    norm, lm_head = model.final_parts()
    feats = norm(hidden)
    top = torch.log_softmax(lm_head(feats).float(), dim=-1).topk(TOPK, dim=-1)
    return Record(tokens.to(torch.long), feats.half(), top.indices, top.values.half())


@torch.inference_mode()
def text_record(model: StageModel, tokens: list[int]) -> Record:
    """One teacher-forced sequence through the whole base model."""
    ids = torch.tensor(tokens, dtype=torch.long)
    n = ids.numel()
    h = model.forward_layers(model.embed(ids), torch.arange(n), bool_to_float_mask(causal_mask(n, 0)),
                             model.new_cache(n))
    return record_of(model, ids, h)


def extract_text(model: StageModel, store: FeatureStore, chunks: Iterable[list[int]], count: int,
                 on_tokens: Callable[[int], None] = lambda n: None) -> None:
    """Records text-00000 .. text-{count-1} (those not on disk yet) from `chunks`, in order."""
    if count < 1:
        return
    for i, chunk in enumerate(chunks):
        if not store.has("text", i):
            store.put("text", i, text_record(model, chunk))
        on_tokens(len(chunk))
        if i + 1 >= count:
            break


def extract_answers(model: StageModel, store: FeatureStore, prompts: list[list[int]], max_new: int,
                    stops: set[int], batch: int, on_tokens: Callable[[int], None] = lambda n: None) -> None:
    """Records answer-00000 ..: the base's greedy answers to `prompts`, `batch` decoded side by side."""
    todo = [i for i in range(len(prompts)) if not store.has("answer", i)]
    for a in range(0, len(todo), batch):
        group = todo[a:a + batch]
        for i, rec in zip(group, answer_records(model, [prompts[i] for i in group], max_new, stops)):
            store.put("answer", i, rec)
            on_tokens(len(rec))


@torch.inference_mode()
def answer_records(model: StageModel, prompts: list[list[int]], max_new: int, stops: set[int]) -> list[Record]:
    """Greedy answers (at most `max_new` tokens, ending at a stop token) with the features of every token
    run: a record holds the prompt and the answer's tokens but its last (chosen, never run)."""
    caches = [model.new_cache(len(p) + max_new) for p in prompts]
    hidden: list[list[torch.Tensor]] = []
    tokens = [list(p) for p in prompts]
    nxt = []
    for p, cache in zip(prompts, caches):
        n = len(p)
        h = model.forward_layers(model.embed(torch.tensor(p)), torch.arange(n),
                                 bool_to_float_mask(causal_mask(n, 0)), cache)
        hidden.append([h])
        nxt.append(int(model.logits(h[-1:])[0].argmax()))
    live = [i for i, y in enumerate(nxt) if y not in stops]
    for _ in range(max_new - 1):
        if not live:
            break
        ids = torch.tensor([nxt[i] for i in live])
        positions = torch.tensor([caches[i].length for i in live])
        masks = [torch.zeros(1, caches[i].length + 1) for i in live]
        out = model.forward_packed(model.embed(ids), positions, masks, [caches[i] for i in live])
        chosen = model.logits(out).argmax(dim=-1).tolist()
        for row, i in enumerate(live):
            tokens[i].append(nxt[i])
            hidden[i].append(out[row:row + 1])
            nxt[i] = chosen[row]
        live = [i for i in live if nxt[i] not in stops]
    return [record_of(model, torch.tensor(t), torch.cat(h)) for t, h in zip(tokens, hidden)]
