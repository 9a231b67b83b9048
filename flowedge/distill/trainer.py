"""`flowedge draft-head train`: self-distil a draft head from its base model, resumably.

Work folder layout: `records/` (the base's features and choices, distill/store.py), `vocab.pt` (the draft
vocabulary), `checkpoint.pt` (head, optimizer, step: written every `checkpoint_every` steps and on exit),
`curve.jsonl` (held-out agreement per level against tokens trained). Re-running the same command picks up
where the last one stopped; a finished run exports the head (W8A16, models/draft_head_io.py).
"""
from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from flowedge.distill import corpus
from flowedge.distill.extract import extract_answers, extract_text
from flowedge.distill.layer_init import init_from_last_layer
from flowedge.distill.store import FeatureStore, Record, choose_vocab
from flowedge.distill.unroll import losses, unrolled
from flowedge.errors import ConfigError
from flowedge.models.draft_head import DraftHead, DraftHeadConfig, attach_lm_head, lm_head_rows
from flowedge.progress import Progress

log = logging.getLogger(__name__)

WARMUP_STEPS = 20
ROOTS_PER_STEP = 160   # draft roots unrolled per training sequence
LEVEL0_ROWS = 256      # level-0 rows scored per training sequence
INITS = ("last-layer", "random")


@dataclass(frozen=True)
class TrainConfig:
    base_dir: Path
    work: Path
    out: Path
    text_tokens: int = 40_000       # teacher-forced tokens from installed packages' code and docs
    seq_len: int = 512
    answers: int = 32               # instructions the base answers (corpus.INSTRUCTIONS, in order)
    answer_tokens: int = 160
    answer_batch: int = 8
    holdout: int = 4                # of those answers, kept out of training: the curve's yardstick
    intermediate: int = 3072        # the head's MLP width (smaller than the base's: a smaller file and call)
    draft_vocab: int = 32768
    levels: int = 3                 # training-time-test depth (distill/unroll.py)
    epochs: float = 2.0
    lr: float = 1e-3
    checkpoint_every: int = 50
    eval_every: int = 50
    max_minutes: float | None = None   # stop training (checkpoint, export) after this long
    seed: int = 0
    device: str = "auto"            # where the head trains: auto = CUDA when present, else the CPU
    init: str = "random"   # the head's first weights: random, or the base's last layer (distill/layer_init.py)

    def __post_init__(self) -> None:
        if self.answers <= self.holdout or self.holdout < 1:
            raise ConfigError(f"need more answers ({self.answers}) than held out ({self.holdout}), and one held out")
        sizes = (self.seq_len, self.answer_tokens, self.levels, self.intermediate, self.draft_vocab)
        if min(sizes) < 1 or self.epochs <= 0:
            raise ConfigError("sizes, levels and epochs must be positive")
        if self.init not in INITS:
            raise ConfigError(f"init must be one of {', '.join(INITS)} (got {self.init!r})")
        if len(corpus.INSTRUCTIONS) < self.answers:
            raise ConfigError(f"at most {len(corpus.INSTRUCTIONS)} answers (one per built-in instruction)")


def train_device(name: str) -> torch.device:
    """`auto`: CUDA when this torch has it, else the CPU (the base's features are always computed on the CPU)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def prepare_records(cfg: TrainConfig, model, tokenizer, stops: set[int]) -> FeatureStore:
    """The base's answers and the teacher-forced text, extracted once (resumes where it stopped)."""
    from flowedge.text.prompts import encode_prompt

    store = FeatureStore(cfg.work / "records")
    prompts = [encode_prompt(tokenizer, text, chat=True) for text in corpus.INSTRUCTIONS[: cfg.answers]]
    bar = Progress("base answers", cfg.answers * cfg.answer_tokens, unit="tokens")
    extract_answers(model, store, prompts, cfg.answer_tokens, stops, cfg.answer_batch, bar.advance)
    bar.finish()
    n_text = cfg.text_tokens // cfg.seq_len
    bar = Progress("base features over text", n_text * cfg.seq_len, unit="tokens")
    chunks = corpus.token_chunks(tokenizer, corpus.site_packages(), cfg.seed, cfg.seq_len)
    extract_text(model, store, chunks, n_text, bar.advance)
    bar.finish()
    return store


def split_records(store: FeatureStore, cfg: TrainConfig) -> tuple[list[Path], list[Path]]:
    answers = store.paths("answer")
    held = answers[len(answers) - cfg.holdout:]
    return [p for p in store.paths() if p not in held], held


class Trainer:
    def __init__(self, cfg: TrainConfig, model, stops: set[int]) -> None:
        self.cfg, self.model = cfg, model
        self.store = FeatureStore(cfg.work / "records")
        self.train_paths, self.held_paths = split_records(self.store, cfg)
        if not self.train_paths:
            raise ConfigError(f"no training records in {self.store.root}")
        self.vocab = self._vocab(stops)
        head_cfg = DraftHeadConfig.for_base(model.config, cfg.intermediate, self.vocab.numel())
        torch.manual_seed(cfg.seed)
        self.head = DraftHead(head_cfg)
        self.head.vocab_ids.copy_(self.vocab)
        self.head.init_from_base(model.norm.weight)
        if cfg.init == "last-layer":
            init_from_last_layer(self.head, model.layers[-1], model.config.hidden_size)
        attach_lm_head(self.head, lm_head_rows(cfg.base_dir, self.vocab).float(), quantize=False)
        self.device = train_device(cfg.device)
        self.head.to(self.device)
        self.index_of = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
        self.index_of[self.vocab] = torch.arange(self.vocab.numel())
        params = [p for n, p in self.head.named_parameters() if not n.startswith("lm_head.")]
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
        self.total_steps = max(1, math.ceil(cfg.epochs * len(self.train_paths)))
        self.step, self.tokens = 0, 0
        self.records: dict[Path, Record] = {}
        self._resume()

    def _vocab(self, stops: set[int]) -> torch.Tensor:
        path = self.cfg.work / "vocab.pt"
        if path.is_file():
            return torch.load(path, weights_only=True)
        vocab = choose_vocab(self.store, self.train_paths, self.cfg.draft_vocab, self.model.config.vocab_size, stops)
        torch.save(vocab, path)
        return vocab

    # ---- checkpoints ----------------------------------------------------------------------------------
    def _ckpt(self) -> Path:
        return self.cfg.work / "checkpoint.pt"

    def _resume(self) -> None:
        if not self._ckpt().is_file():
            return
        raw = torch.load(self._ckpt(), weights_only=False, map_location=self.device)
        self.head.load_state_dict(raw["head"], strict=False)
        self.opt.load_state_dict(raw["opt"])
        self.step, self.tokens = raw["step"], raw["tokens"]
        log.info("resumed at step %d (%d tokens trained)", self.step, self.tokens)

    def checkpoint(self) -> None:
        state = {k: v for k, v in self.head.state_dict().items() if not k.startswith("lm_head.")}
        tmp = self._ckpt().with_name("checkpoint.pt.tmp")
        torch.save({"head": state, "opt": self.opt.state_dict(), "step": self.step, "tokens": self.tokens,
                    "config": {k: str(v) for k, v in asdict(self.cfg).items()}}, tmp)
        tmp.replace(self._ckpt())

    # ---- one sequence -----------------------------------------------------------------------------------
    def _record(self, path: Path) -> Record:
        if path not in self.records:
            self.records[path] = self.store.get(path)
        return self.records[path]

    def _losses(self, rec: Record, sample: bool):
        """The record's losses; `sample`: deeper levels from ROOTS_PER_STEP random roots and level 0 scored
        on LEVEL0_ROWS random rows (the lm_head over the draft vocabulary is most of a step's cost)."""
        t = len(rec)
        roots = rows0 = None
        if sample:
            gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.step)
            roots = torch.randperm(t, generator=gen)[:ROOTS_PER_STEP].sort().values
            rows0 = torch.randperm(t, generator=gen)[:LEVEL0_ROWS]
        dev = self.device
        embedded = self.model.embed(rec.tokens).clone().to(dev)   # out of inference mode: autograd may save it
        feats = rec.features.to(dev)
        levels = unrolled(self.head, embedded, feats.float(), self.cfg.levels, roots)
        return losses(self.head, levels, feats, self.index_of[rec.top_ids].to(dev), rec.top_logp.to(dev).float().exp(),
                      None if rows0 is None else rows0.to(dev))

    def _lr(self) -> float:
        warm = min(1.0, (self.step + 1) / WARMUP_STEPS)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, self.step / self.total_steps)))
        return self.cfg.lr * warm * (0.1 + 0.9 * cosine)

    def train_step(self, path: Path) -> float:
        rec = self._record(path)
        for group in self.opt.param_groups:
            group["lr"] = self._lr()
        loss = self._losses(rec, sample=True).total
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in self.opt.param_groups for p in g["params"]], 1.0)
        self.opt.step()
        self.step += 1
        self.tokens += len(rec)
        return float(loss.detach())

    @torch.no_grad()
    def evaluate(self) -> list[float]:
        """Held-out top-1 agreement with the base's argmax, per level."""
        hits = [0] * self.cfg.levels
        rows = [0] * self.cfg.levels
        for path in self.held_paths:
            out = self._losses(self._record(path), sample=False)
            for s, (h, n) in enumerate(zip(out.hits, out.rows)):
                hits[s] += h
                rows[s] += n
        return [round(h / max(1, n), 4) for h, n in zip(hits, rows)]

    # ---- the loop ---------------------------------------------------------------------------------------
    def order(self) -> list[Path]:
        """Every step's record, epoch by epoch, each epoch in its own seeded order."""
        out: list[Path] = []
        epoch = 0
        while len(out) < self.total_steps:
            paths = list(self.train_paths)
            random.Random(self.cfg.seed + epoch).shuffle(paths)
            out += paths
            epoch += 1
        return out[: self.total_steps]

    def run(self) -> None:
        cfg, t0 = self.cfg, time.monotonic()
        order = self.order()
        bar = Progress("training the draft head", self.total_steps, unit="steps")
        bar.update(self.step)
        recent: list[float] = []
        if self.step == 0:
            self._log_curve([], t0)
        while self.step < self.total_steps:
            recent.append(self.train_step(order[self.step]))
            bar.update(self.step)
            if self.step % cfg.eval_every == 0 or self.step == self.total_steps:
                self._log_curve(recent, t0)
                recent = []
            if self.step % cfg.checkpoint_every == 0:
                self.checkpoint()
            if cfg.max_minutes is not None and time.monotonic() - t0 > 60 * cfg.max_minutes:
                log.warning("stopping at step %d of %d: --max-minutes %.0f reached (run again to go on)",
                            self.step, self.total_steps, cfg.max_minutes)
                if recent:
                    self._log_curve(recent, t0)
                break
        if self.step >= self.total_steps:
            bar.finish()
        self.checkpoint()

    def _log_curve(self, recent: list[float], t0: float) -> None:
        acc = self.evaluate()
        line = {"step": self.step, "tokens_trained": self.tokens, "heldout_top1": acc,
                "expected_chain": round(sum(math.prod(acc[: s + 1]) for s in range(len(acc))), 4),
                "train_loss": round(sum(recent) / len(recent), 4) if recent else None,
                "elapsed_s": round(time.monotonic() - t0, 1)}
        log.info("curve: %s", line)
        with open(self.cfg.work / "curve.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
