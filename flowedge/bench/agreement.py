"""Teacher-forced top-1 agreement: does the W4A16 model pick the token the float32 model picks?

An independent check of the int4 path: every other W4A16 reference is our own staged model, so a wrong int4
model would pass those. Here both models read the same token sequences (a prompt and a continuation) in one
forward each, and at every position we compare their argmax; a correct W4A16 model agrees almost always
(ties and near-ties aside).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

Logits = Callable[[list[int]], torch.Tensor]   # token ids [n] -> logits [n, V] for every position


@dataclass(frozen=True, slots=True)
class Agreement:
    positions: int
    agreed: int

    @property
    def rate(self) -> float:
        return self.agreed / self.positions if self.positions else 0.0


def top1_agreement(reference: Logits, candidate: Logits, sequences: Sequence[list[int]], first: int = 0) -> Agreement:
    """Compare argmax over positions [first, n) of every sequence (first: skip the prompt's)."""
    positions = agreed = 0
    for ids in sequences:
        want = reference(ids)[first:].argmax(-1)
        got = candidate(ids)[first:].argmax(-1)
        positions += int(want.numel())
        agreed += int((want == got).sum())
    return Agreement(positions, agreed)


def stage_logits(model) -> Logits:
    """A whole-model StageModel as a Logits function (one causal forward over the sequence)."""
    from flowedge.models.stage import bool_to_float_mask, causal_mask

    def run(ids: list[int]) -> torch.Tensor:
        t = torch.tensor(ids)
        h = model.forward_layers(model.embed(t), torch.arange(len(ids)), bool_to_float_mask(causal_mask(len(ids), 0)),
                                 model.new_cache(len(ids)))
        return model.logits(h)
    return run


def transformers_logits(model) -> Logits:
    """A transformers causal LM (the float32 oracle) as a Logits function."""
    @torch.inference_mode()
    def run(ids: list[int]) -> torch.Tensor:
        return model(input_ids=torch.tensor([ids])).logits[0].float()
    return run
