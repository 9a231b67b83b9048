"""The head's partition plan: which layers each stage serves, the shard files it hands out, and the
models node 0 itself holds (embedding + lm_head of the base model, the draft model, the tokenizer)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from flowedge.daemon.config import NodeConfig
from flowedge.daemon.shard_fetch import ShardFile, head_file, stage_files
from flowedge.engine.drafter import load_draft_model
from flowedge.errors import ModelError
from flowedge.models.shards import Manifest, _layer_counts, split_model
from flowedge.models.stage import StageModel, StageParts, load_config

log = logging.getLogger(__name__)


@dataclass
class Plan:
    split_dir: Path
    ranges: list[tuple[int, int]]
    shards: list[ShardFile]
    head_file: ShardFile          # embedding + final norm + lm_head: also sent to a token-choosing last stage
    head_model: StageModel
    draft_model: StageModel | None
    tokenizer: object
    base_config: object


def split_dir_for(home: Path, base_dir: Path, counts: list[int]) -> Path:
    return home / "shards" / f"{base_dir.name}-{'-'.join(map(str, counts))}"


def ensure_split(base_dir: Path, counts: list[int], out: Path, model_name: str) -> Manifest:
    """Reuse a complete split with these layer counts, else write one (atomically, with progress)."""
    try:
        manifest = Manifest.load(out)
        if [s.end - s.start for s in manifest.stages] == counts:
            return manifest
    except ModelError:
        pass
    log.info("splitting %s into %d stages %s -> %s", base_dir.name, len(counts), counts, out)
    return split_model(base_dir, len(counts), out, layers=counts, progress=lambda m: log.info("split: %s", m),
                       model_name=model_name)


def prepare_plan(config: NodeConfig, home: Path) -> Plan:
    from flowedge.models.resolve import resolve_model
    from flowedge.runner import load_tokenizer

    base_dir = resolve_model(config.model)
    n_layers = int(load_config(base_dir).num_hidden_layers)
    counts = _layer_counts(n_layers, config.stages, list(config.layers) or None)
    out = split_dir_for(home, base_dir, counts)
    manifest = ensure_split(base_dir, counts, out, config.model)
    ranges = [(s.start, s.end) for s in manifest.stages]
    shards = [stage_files(out, k) for k in range(1, len(ranges) + 1)]
    head_model = StageModel.load(out, StageParts(0, 0, embed=True, head=True))
    draft = load_draft_model(resolve_model(config.draft), config.draft_quant) if config.draft else None
    return Plan(out, ranges, shards, head_file(out), head_model, draft, load_tokenizer(out), load_config(out))
