"""Node 0's draft calls batched across requests: one packed forward of the draft model for all of them.

Node 0 is the busy device under flowspec (~90% on the Jetson profile with one request), and a draft call
on a memory-bound device costs about the same for 1 or 16 rows, so several requests' calls should share
one forward. The strategies call the drafter deep inside their handlers, one call after another; instead
of rewriting them as coroutines, `DraftBatcher.run_step` runs each request's handler in its own thread
and every `Drafter._run` call goes through `forward`, which waits until every handler still running has
made its next call (or finished), then runs them all as one forward (packed rows, each drafter
attending over its own KV cache: `StageModel.forward_packed`) and hands each its rows. The k-th batch
holds the k-th call of every handler still running, packed in handler order, so a step is deterministic.
With one handler the call runs alone, exactly as without the batcher. Threads only wait on each other
here: torch runs the forward with the GIL released, and the handlers' Python bookkeeping is small next to it.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch

from flowedge.models.kv_cache import CacheLike
from flowedge.models.stage import StageModel, bool_to_float_mask

log = logging.getLogger(__name__)

T = TypeVar("T")

BATCHES_REMEMBERED = 100_000   # batch sizes kept for reports (a long-running daemon keeps counts only)


@dataclass
class _Call:
    """One drafter's pending forward (mutable: the batch fills in the result)."""
    order: int
    cache: CacheLike
    tokens: torch.Tensor      # [n]
    positions: torch.Tensor   # [n]
    allowed: torch.Tensor     # [n, past + n] bool
    result: torch.Tensor | None = None
    charge: tuple[int, int, float] | None = None   # the batch's cost, booked by its first call only
    error: BaseException | None = None


class DraftBatcher:
    def __init__(self, model: StageModel) -> None:
        self.model = model
        self._cond = threading.Condition()
        self._live = 0                       # handlers of the current step that may still call
        self._pending: list[_Call] = []
        self._local = threading.local()
        self.batch_sizes: deque[int] = deque(maxlen=BATCHES_REMEMBERED)   # requests per forward, recent
        self.forwards = 0    # packed draft forwards run, and the requests' calls they held (all time)
        self.calls = 0

    def counts(self) -> dict:
        """All-time draft forwards and the calls they held (calls / forwards = requests per draft call)."""
        return {"forwards": self.forwards, "calls": self.calls}

    def run_step(self, handlers: list[Callable[[], T]]) -> list[T]:
        """Run the handlers side by side, batching their draft calls; results in handler order."""
        if len(handlers) <= 1:
            return [h() for h in handlers]
        results: list = [None] * len(handlers)
        errors: list[BaseException | None] = [None] * len(handlers)
        with self._cond:
            self._live = len(handlers)

        def work(i: int) -> None:
            self._local.order = i
            try:
                results[i] = handlers[i]()
            except BaseException as e:   # re-raised in the caller's thread below
                errors[i] = e
            finally:
                with self._cond:
                    self._live -= 1
                    self._fire_if_ready()

        threads = [threading.Thread(target=work, args=(i,), name=f"draft-step-{i}") for i in range(len(handlers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with self._cond:
            self._live = 0
        for e in errors:
            if e is not None:
                raise e
        return results

    def forward(self, cache, tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor
                ) -> tuple[torch.Tensor, tuple[int, int, float] | None]:
        """One drafter's call: [n] tokens -> [n, V] log-probs, run in the next batch; plus the batch's
        (rows, context, seconds) for the first call in it (None for the others), so each batched forward
        is charged once, by the request that leads it."""
        call = _Call(getattr(self._local, "order", 0), cache, tokens, positions, allowed)
        with self._cond:
            self._pending.append(call)
            self._fire_if_ready()
            while call.result is None and call.error is None:
                self._cond.wait()
        if call.error is not None or call.result is None:   # the batch failed
            raise call.error or RuntimeError("a draft call woke without its result")
        return call.result, call.charge

    def _fire_if_ready(self) -> None:
        """(Lock held.) Every live handler is waiting on a call: run them all as one forward."""
        if not self._pending or len(self._pending) < self._live:
            return
        batch, self._pending = sorted(self._pending, key=lambda c: c.order), []
        try:
            outs, charge = self._packed(batch)
            for call, out in zip(batch, outs):
                call.result = out
            batch[0].charge = charge
        except BaseException as e:   # every waiter sees the failure
            for call in batch:
                call.error = e
        self._cond.notify_all()

    @torch.inference_mode()
    def _packed(self, batch: list[_Call]) -> tuple[list[torch.Tensor], tuple[int, int, float]]:
        t0 = time.perf_counter()
        sizes = [c.tokens.numel() for c in batch]
        context = sum(c.cache.length for c in batch)
        h = self.model.embed(torch.cat([c.tokens for c in batch]))
        positions = torch.cat([c.positions for c in batch])
        masks = [bool_to_float_mask(c.allowed, h.dtype) for c in batch]
        h = self.model.forward_packed(h, positions, masks, [c.cache for c in batch])
        logp = torch.log_softmax(self.model.logits(h), dim=-1)
        self.batch_sizes.append(len(batch))
        self.forwards += 1
        self.calls += len(batch)
        return list(logp.split(sizes)), (sum(sizes), context, time.perf_counter() - t0)
