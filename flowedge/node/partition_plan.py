"""The head's partition plan: which layers each stage serves, the shard files it hands out, and the
models node 0 itself holds (embedding + lm_head of the base model, the draft model, the tokenizer).

When the head starts it splits by layer count (or by the configured `layers`), so it can load its own
parts and serve a homogeneous cluster at once. Once every slot holds a stage, the stages' Hellos say
which device each one is and how much memory it has free: `Replanner` then asks the planner
(flowedge/plan/partition.py) for the split that fits every stage and makes the slowest one fastest, and
re-splits in a background thread (cached per layer counts, `split_dir_for`) when that split fits where
the current one does not, or is at least `MIN_GAIN` faster. A manual `layers` is never overridden.

Splits are cached under `$FLOWEDGE_HOME/shards/`, keyed by the model's content (models/content_hash.py),
not by its directory's name: a split is reused only when its manifest names the very model being
served, else it is cut again (and the mismatch logged).
"""
from __future__ import annotations

import logging
import re
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from flowedge.engine.drafter import resolve_draft_quant
from flowedge.engine.head_drafter import draft_source, is_head, load_draft
from flowedge.errors import ConfigError, ModelError
from flowedge.models.config import ModelConfig
from flowedge.models.content_hash import SHORT, memo_at, model_sha256, short
from flowedge.models.draft_head import DraftHead
from flowedge.models.packing import storage_quant
from flowedge.models.shards import MANIFEST, Manifest, is_referenced
from flowedge.models.split import layer_counts, split_model
from flowedge.models.stage import StageModel, StageParts, load_config
from flowedge.node.node_config import NodeConfig
from flowedge.node.shard_fetch import ShardFile, head_file, stage_files

log = logging.getLogger(__name__)


@dataclass
class Plan:
    split_dir: Path
    ranges: list[tuple[int, int]]
    shards: list[ShardFile]
    head_file: ShardFile          # embedding + final norm + lm_head: also sent to a token-choosing last stage
    head_model: StageModel
    draft_model: StageModel | DraftHead | None   # a draft model or a draft head (models/draft_head.py)
    tokenizer: object
    base_config: ModelConfig
    draft_files: tuple[ShardFile, ShardFile] | None = None   # the draft as a one-stage split: (layers, head
                                                            # file) a drafter fetches (predraft = drafter)
    model_sha256: str = ""        # the base model's content key: in status, checked when a stage joins

    @property
    def counts(self) -> list[int]:
        return [b - a for a, b in self.ranges]


def split_dir_for(home: Path, base_dir: Path, source_sha256: str, counts: list[int], quant: str = "none") -> Path:
    """The split's directory: named by the model's directory (for people) and its content key (for the
    cache: two models in directories of one name never share a split)."""
    counts_text = "-".join(map(str, counts))
    return home / "shards" / f"{base_dir.name}-{short(source_sha256)}-{counts_text}{'-int4' if quant == 'int4' else ''}"


def ensure_split(base_dir: Path, counts: list[int], out: Path, model_name: str, quant: str = "none",
                 source_sha256: str | None = None) -> Manifest:
    """Reuse a complete split of this very model (content key `source_sha256`, hashed here unless given)
    with these layer counts and storage `quant` (none | int4: W4A16 shards), else write one (atomically,
    with progress)."""
    source_sha256 = source_sha256 or model_sha256(base_dir)
    prune_copied_splits(out, base_dir)
    manifest = _reusable(out, counts, quant, source_sha256)
    if manifest is not None:
        return manifest
    log.info("splitting %s (sha256 %s…) into %d stages %s -> %s", base_dir.name, short(source_sha256),
             len(counts), counts, out)
    return split_model(base_dir, len(counts), out, layers=counts, progress=lambda m: log.info("split: %s", m),
                       model_name=model_name, quant=quant, source_sha256=source_sha256)


def _reusable(out: Path, counts: list[int], quant: str, source_sha256: str) -> Manifest | None:
    """The split in `out` if it was cut from the model `source_sha256` as asked, else None (a split of
    another model is logged: it is never served)."""
    try:
        manifest = Manifest.load(out)
    except ModelError:
        return None
    if manifest.source_sha256 != source_sha256:
        log.warning("%s was cut from %s, not from the model being served (sha256 %s…): splitting again", out,
                    f"model sha256 {short(manifest.source_sha256)}…" if manifest.source_sha256 else
                    "a model of unrecorded content (an older flowedge)", short(source_sha256))
        return None
    if [s.end - s.start for s in manifest.stages] == counts and manifest.quant == quant and \
            is_referenced(out):   # a split that copies the checkpoint (older flowedge) is redone
        return manifest
    return None


def prune_copied_splits(out: Path, base_dir: Path) -> None:
    """Remove the other splits of this model that an older flowedge made beside `out` (float32 or copies
    of the checkpoint, up to 6.7 GB each for the real 1.5B): the head only ever makes splits of references
    now, and redoes one in seconds when its layer counts come back."""
    pattern = re.compile(rf"^{re.escape(base_dir.name)}(-[0-9a-f]{{{SHORT}}})?(-\d+)+(-int4)?$")
    if not out.parent.is_dir():
        return
    for old in out.parent.iterdir():
        if old == out or not pattern.match(old.name) or not (old / MANIFEST).is_file() or is_referenced(old):
            continue
        size = sum(p.stat().st_size for p in old.iterdir() if p.is_file())
        log.info("removing %s: a split copying the checkpoint, made by an older flowedge (%.2f GB)", old, size / 1e9)
        shutil.rmtree(old, ignore_errors=True)


def prepare_plan(config: NodeConfig, home: Path) -> Plan:
    from flowedge.models.resolve import resolve_model
    from flowedge.text.prompts import load_tokenizer

    base_dir = resolve_model(config.model, quant=config.quant)
    n_layers = int(load_config(base_dir).num_hidden_layers)
    counts = layer_counts(n_layers, config.stages, list(config.layers) or None)
    stored = storage_quant(config.quant)
    model_sha = model_sha256(base_dir, memo_at(home))
    log.info("model %s: content sha256 %s…", config.model, short(model_sha))
    out = split_dir_for(home, base_dir, model_sha, counts, stored)
    manifest = ensure_split(base_dir, counts, out, config.model, stored, model_sha)
    ranges = [(s.start, s.end) for s in manifest.stages]
    shards = [stage_files(out, k) for k in range(1, len(ranges) + 1)]
    head_model = StageModel.load(out, StageParts(0, 0, embed=True, head=True))
    draft_quant = resolve_draft_quant(config.draft_quant)
    draft_dir = draft_source(config.draft, draft_quant) if config.draft else None
    draft = load_draft(draft_dir, out, draft_quant) if draft_dir is not None else None   # a head: `out`'s lm_head
    served = draft_split(draft_dir, config.draft, draft_quant, home) \
        if draft_dir is not None and not is_head(draft) and config.predraft == "drafter" else None
    return Plan(out, ranges, shards, head_file(out), head_model, draft, load_tokenizer(out), load_config(out),
                served, model_sha)


def draft_split(draft_dir: Path, name: str, draft_quant: str, home: Path) -> tuple[ShardFile, ShardFile]:
    """The draft model as a one-stage split (references into its checkpoint: nothing is copied) that a
    drafter holding no copy of it fetches from the head, checksummed and cached, as a stage fetches its
    shard: the layers' file and the head file (embedding, final norm, lm_head)."""
    counts = [int(load_config(draft_dir).num_hidden_layers)]
    stored = storage_quant(draft_quant)
    draft_sha = model_sha256(draft_dir, memo_at(home))
    out = split_dir_for(home, draft_dir, draft_sha, counts, stored)
    ensure_split(draft_dir, counts, out, name, stored, draft_sha)
    return stage_files(out, 1), head_file(out)


MIN_GAIN = 0.03   # re-split for a bottleneck at least 3% faster (or when the current split does not fit)


def plan_inputs(config: NodeConfig, base_config: Any, hellos: list):
    """The planner's inputs (flowedge/plan/partition.py) for the stages that joined, in slot order, from
    their Hellos (device profile, free memory); None when a device has no shipped profile."""
    from flowedge.plan.planned_cluster import objective_for, step_tokens_for
    from flowedge.plan.partition import PlanInputs, stage_devices
    from flowedge.costs.profiles import load_link, load_named_device

    try:
        profiles = [load_named_device(h.device) for h in hellos]
    except ConfigError as err:
        log.info("keeping the split by layer count: %s", err)
        return None
    devices = stage_devices(profiles, [h.free_memory_bytes or None for h in hellos], quant=config.quant)
    return PlanInputs(base_config, devices, quant=config.quant, context=config.context,
                      step_tokens=step_tokens_for(config.strategy), last_stage_head=config.lm_head_at != "head",
                      last_stage_runs_head=config.lm_head_at == "last-stage",
                      link=load_link(profiles[0].default_link), objective=objective_for(config.strategy))


def planned_counts(config: NodeConfig, base_config: Any, current: list[int], hellos: list) -> list[int] | None:
    """Layer counts for the stages that joined (in slot order), or None to keep `current`: a manual
    `layers`, a device no shipped profile describes, a plan too small a gain, or one that cannot fit
    (logged as an error with the shortfall; the current split is then kept and may fail to load)."""
    from flowedge.plan.partition import PlanError, plan_partition

    if config.layers:
        return None
    inputs = plan_inputs(config, base_config, hellos)
    if inputs is None:
        return None
    _warn_unused(inputs, hellos)
    try:
        best = plan_partition(inputs)
    except PlanError as err:
        log.error("no split fits the stages that joined: %s", err)
        return None
    fits, now_s = inputs.evaluate(current)
    best_s = best.objective_s(inputs.objective)
    if best.counts == current or (fits and best_s > now_s * (1 - MIN_GAIN)):
        return None
    log.info("planned split for %s: %s (%s %.1f ms, was %s at %.1f ms%s)", [h.device for h in hellos],
             best.counts, inputs.objective, 1e3 * best_s, current, 1e3 * now_s,
             "" if fits else ", which does not fit")
    return best.counts


def _warn_unused(inputs, hellos: list) -> None:
    """Every slot serves layers in the daemon (a plan with fewer stages needs `stages` lowered): say which
    joined devices the planner would leave out, and why, so the operator can."""
    from flowedge.plan.partition import PlanError, plan_partition

    try:
        idle = plan_partition(replace(inputs, allow_idle=True)).unused
    except PlanError:
        return
    for u in idle:
        log.warning("stage %d (%s, node %s) slows the pipeline: %s; stop that node and set stages = %d",
                    u.index + 1, u.device, hellos[u.index].node_id, u.reason, len(hellos) - len(idle))


class Replanner:
    """Re-splits for the devices that joined, off the head's event loop (a split can take minutes)."""

    def __init__(self, config: NodeConfig, home: Path) -> None:
        self.config, self.home = config, home
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replan")
        self.pending: tuple[list[int], Future] | None = None
        self.decided: dict[tuple, list[int] | None] = {}   # per (stages that joined, current split)

    @property
    def busy(self) -> bool:
        return self.pending is not None

    def plan_for(self, plan: Plan, hellos: list) -> Plan | None:
        """The plan to assign now: `plan` if it stays, a re-split one once written, None while splitting."""
        key = (tuple((h.node_id, h.device, h.free_memory_bytes) for h in hellos), tuple(plan.counts))
        if key not in self.decided:
            self.decided[key] = planned_counts(self.config, plan.base_config, plan.counts, hellos)
        counts = self.decided[key]
        if counts is None:
            self.pending = None
            return plan
        if self.pending is None or self.pending[0] != counts:
            self.pending = (counts, self.pool.submit(resplit, plan, counts, self.config, self.home))
        future = self.pending[1]
        if not future.done():
            return None
        self.pending = None
        try:
            return future.result()
        except Exception as err:   # a failed split leaves the working plan in place
            log.error("re-split to %s failed, keeping %s: %s", counts, plan.counts, err)
            return plan

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def resplit(plan: Plan, counts: list[int], config: NodeConfig, home: Path) -> Plan:
    """`plan` with the layers split as `counts` (the models node 0 holds are the same in every split). A
    model changed on disk since `plan` was made is not split: node 0 holds the old one's embedding."""
    from flowedge.models.resolve import resolve_model

    base_dir = resolve_model(config.model, quant=config.quant)
    if model_sha256(base_dir, memo_at(home)) != plan.model_sha256:
        raise ModelError(f"{base_dir} changed on disk since the head loaded it (sha256 {short(plan.model_sha256)}…): "
                         "restart the head to serve the new model")
    stored = storage_quant(config.quant)
    out = split_dir_for(home, base_dir, plan.model_sha256, counts, stored)
    manifest = ensure_split(base_dir, counts, out, config.model, stored, plan.model_sha256)
    ranges = [(st.start, st.end) for st in manifest.stages]
    return replace(plan, split_dir=out, ranges=ranges, shards=[stage_files(out, k) for k in range(1, len(ranges) + 1)],
                   head_file=head_file(out))
