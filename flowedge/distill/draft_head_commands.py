"""CLI: `flowedge draft-head train` (self-distil a head), `flowedge draft-head info` (what a head file holds)."""
from __future__ import annotations

import json
from pathlib import Path

import click


@click.group("draft-head")
def draft_head() -> None:
    """Train and inspect EAGLE-style draft heads (`--draft head:NAME`)."""


@draft_head.command("train")
@click.option("--model", default="qwen2.5-coder-1.5b", show_default=True, help="The base model the head drafts for.")
@click.option("--name", default=None, help="Head name (default: the model's): `--draft head:NAME` finds it.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Head file to write (default: $FLOWEDGE_HOME/draft_heads/NAME.safetensors).")
@click.option("--work", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Records, checkpoint and curve (default: beside the head file); re-run to resume.")
@click.option("--quant", default="int4", show_default=True, type=click.Choice(["int4", "none"]),
              help="The base's weights while extracting features: the model the head will serve.")
@click.option("--text-tokens", default=40_000, show_default=True, type=int,
              help="Teacher-forced tokens from installed packages' .py/.md files.")
@click.option("--answers", default=32, show_default=True, type=int, help="Instructions the base answers itself.")
@click.option("--answer-tokens", default=160, show_default=True, type=int)
@click.option("--holdout", default=4, show_default=True, type=int, help="Answers kept out of training (the curve).")
@click.option("--seq-len", default=512, show_default=True, type=int)
@click.option("--intermediate", default=3072, show_default=True, type=int, help="The head's MLP width.")
@click.option("--draft-vocab", default=32768, show_default=True, type=int, help="Reduced vocabulary size.")
@click.option("--levels", default=3, show_default=True, type=int, help="Training-time-test depth.")
@click.option("--epochs", default=2.0, show_default=True, type=float)
@click.option("--lr", default=1e-3, show_default=True, type=float)
@click.option("--checkpoint-every", default=50, show_default=True, type=int)
@click.option("--eval-every", default=50, show_default=True, type=int)
@click.option("--max-minutes", default=None, type=float, help="Stop training after this long (then export).")
@click.option("--device", default="auto", show_default=True,
              help="Where the head trains: auto (CUDA when present), cpu, cuda.")
@click.option("--threads", default=None, type=int, help="torch threads (default: all cores).")
@click.option("--init", "init", default="random", show_default=True, type=click.Choice(["last-layer", "random"]),
              help="The head's first weights: a copy of the base's last layer, or random.")
def train(model, name, out, work, quant, text_tokens, answers, answer_tokens, holdout, seq_len, intermediate,
          draft_vocab, levels, epochs, lr, checkpoint_every, eval_every, max_minutes, device, threads, init) -> None:
    """Self-distil a draft head from MODEL: features and labels are the model's own (CUDA when present)."""
    from flowedge.distill.trainer import Trainer, TrainConfig, prepare_records
    from flowedge.engine.local import stop_ids
    from flowedge.models.draft_head_io import save_head, trained_path
    from flowedge.models.resolve import resolve_model
    from flowedge.models.stage import StageModel
    from flowedge.text.prompts import load_tokenizer
    from flowedge.threads import set_threads

    set_threads(threads)
    name = name or Path(model).stem
    out = out or trained_path(name)
    work = work or out.with_name(f"{out.stem}-work")
    base_dir = resolve_model(model, quant=quant)
    cfg = TrainConfig(base_dir, work, out, text_tokens, seq_len, answers, answer_tokens, holdout=holdout,
                      intermediate=intermediate, draft_vocab=draft_vocab, levels=levels, epochs=epochs, lr=lr,
                      checkpoint_every=checkpoint_every, eval_every=eval_every, max_minutes=max_minutes, device=device,
                      init=init)
    base = StageModel.load(base_dir, quant=quant)
    stops = stop_ids(base.config)
    prepare_records(cfg, base, load_tokenizer(base_dir), stops)
    trainer = Trainer(cfg, base, stops)
    trainer.run()
    sha = save_head(trainer.head, out)
    click.echo(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB, sha256 {sha[:12]}…): --draft head:{name}")


@draft_head.command("info")
@click.argument("spec")
def info(spec: str) -> None:
    """What the head SPEC (head:NAME or a file) is: its shape, base model, size and checksum."""
    from flowedge.models.draft_head_io import read_config, resolve_head, verify

    path = resolve_head(spec)
    cfg = read_config(path)
    click.echo(json.dumps({"path": str(path), "bytes": path.stat().st_size, "sha256": verify(path),
                           "config": cfg.to_dict()}, indent=1))
