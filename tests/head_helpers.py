"""A tiny draft head for the tiny pair, self-distilled in a few seconds (the tests' head drafter)."""
from __future__ import annotations

from pathlib import Path

from flowedge.distill.trainer import TrainConfig, Trainer, prepare_records
from flowedge.engine.local import stop_ids
from flowedge.models.draft_head_io import save_head
from flowedge.models.stage import StageModel
from flowedge.text.prompts import load_tokenizer


def tiny_config(base: Path, root: Path, **kw) -> TrainConfig:
    fields = dict(text_tokens=0, seq_len=32, answers=12, answer_tokens=32, answer_batch=6, holdout=2,
                  intermediate=64, draft_vocab=224, levels=3, epochs=10.0, lr=3e-3, eval_every=20, checkpoint_every=20)
    fields.update(kw)
    return TrainConfig(base, root / "work", root / "tiny-head.safetensors", **fields)


def train_tiny_head(base: Path, root: Path, **kw) -> Path:
    """Answers of the tiny base to a few instructions, a few training steps, the W8A16 head file."""
    cfg = tiny_config(base, root, **kw)
    model = StageModel.load(base)
    stops = stop_ids(model.config)
    prepare_records(cfg, model, load_tokenizer(base), stops)
    trainer = Trainer(cfg, model, stops)
    trainer.run()
    save_head(trainer.head, cfg.out)
    return cfg.out
