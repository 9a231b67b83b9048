"""The TOML node configuration file, validated by pydantic as the HTTP bodies are (api/schema.py).

`NodeFile` is the file's shape: strict types as TOML has them (`stages = "2"` is not a count), the
choices and ranges of each key, and unknown keys refused with the nearest known one. A failure is one
line naming the file (or the command line) and the key. What spans several keys or looks outside the
file (layers against stages, timeouts against heartbeats, a model that exists, the head's address)
stays in `NodeConfig.__post_init__`, which also guards configs built in code.

pydantic is imported here only, when a file is read: the client install (no pydantic) imports
node/node_config.py for the CLI's constants, never this module.
"""
from __future__ import annotations

import difflib
import tomllib
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flowedge.core.config import DRAFT_QUANTS, LM_HEAD_PLACES, STRATEGY_NAMES
from flowedge.node.node_config import (EXAMPLE_CONFIG, MAX_CLIENT_WEIGHT, PREDRAFT_MODES, QUANTS, ROLES, TREE_SIZES,
                                    WIRE_DTYPES, NodeConfig)
from flowedge.errors import ConfigError

_D = {f.name: (f.default if f.default is not MISSING else f.default_factory())  # type: ignore[operator]
      for f in fields(NodeConfig)}
Weight = Annotated[float, Field(gt=0, le=MAX_CLIENT_WEIGHT, allow_inf_nan=False)]
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class NodeFile(BaseModel):
    """Every key of `NodeConfig`, typed; a test holds the two key lists equal."""

    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal[ROLES] = _D["role"]   # type: ignore[valid-type]
    head: str = _D["head"]
    node_id: str = _D["node_id"]
    device: str = _D["device"]
    threads: int = Field(_D["threads"], ge=0)
    keys_dir: str = _D["keys_dir"]
    cluster: str = _D["cluster"]
    discovery: bool = _D["discovery"]
    insecure: bool = _D["insecure"]
    heartbeat_ms: int = Field(_D["heartbeat_ms"], ge=10)
    stage_timeout_s: Seconds = _D["stage_timeout_s"]
    client_timeout_s: Seconds = _D["client_timeout_s"]
    recovery_s: Seconds = _D["recovery_s"]
    replan_on_loss: bool = _D["replan_on_loss"]
    stall_timeout_s: Seconds = _D["stall_timeout_s"]
    max_concurrent: int = Field(_D["max_concurrent"], ge=1)
    kv_budget_tokens: int = Field(_D["kv_budget_tokens"], ge=0)
    max_queued_per_client: int = Field(_D["max_queued_per_client"], ge=0)
    client_weights: dict[str, Weight] = Field(default_factory=dict)
    model: str = _D["model"]
    draft: str = _D["draft"]
    stages: int = Field(_D["stages"], ge=1)
    layers: list[Annotated[int, Field(ge=1)]] = Field(default_factory=list)
    context: int = Field(_D["context"], ge=1)
    strategy: Literal[STRATEGY_NAMES] = _D["strategy"]   # type: ignore[valid-type]
    wire_dtype: Literal[WIRE_DTYPES] = _D["wire_dtype"]   # type: ignore[valid-type]
    quant: Literal[QUANTS] = _D["quant"]   # type: ignore[valid-type]
    draft_quant: Literal[DRAFT_QUANTS] = _D["draft_quant"]   # type: ignore[valid-type]
    tree_nodes: int = Field(_D["tree_nodes"], ge=0)
    tree_size: Literal[TREE_SIZES] = _D["tree_size"]   # type: ignore[valid-type]
    lookup_tokens: int = Field(_D["lookup_tokens"], ge=0)
    predraft: Literal[PREDRAFT_MODES] = _D["predraft"]   # type: ignore[valid-type]
    lm_head_at: Literal[LM_HEAD_PLACES] = _D["lm_head_at"]   # type: ignore[valid-type]
    stage: int = Field(_D["stage"], ge=0)
    data_port: int | str = _D["data_port"]
    advertise: str = _D["advertise"]
    same_host: bool = _D["same_host"]
    memory_offer_gib: float = Field(_D["memory_offer_gib"], ge=0)
    heads: list[str] = Field(default_factory=list)
    listen: str = _D["listen"]
    failover_s: Seconds = _D["failover_s"]


def read_toml(path: Path) -> dict[str, Any]:
    """The file's keys (at top level or under [flowedge]); a missing or broken file is one line."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist "
                          f"(see the commented example at {EXAMPLE_CONFIG})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    values = data.get("flowedge", data)
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: [flowedge] must be a table")
    return values


def validated(values: dict[str, Any], source: str) -> dict[str, Any]:
    """`values` checked against `NodeFile`; only the keys given come back (NodeConfig has the defaults)."""
    try:
        return NodeFile.model_validate(values).model_dump(exclude_unset=True)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {describe(exc.errors()[0])}") from None


def describe(error: Any) -> str:
    """One pydantic error as one line that names the key: 'stages must be >= 1; got 0'."""
    key = ".".join(str(part) for part in error["loc"])
    kind, ctx, got = error["type"], error.get("ctx") or {}, error.get("input")
    if kind == "extra_forbidden":
        near = difflib.get_close_matches(str(error["loc"][0]), NodeFile.model_fields, n=1)
        return f"unknown key {key!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
    if kind == "literal_error":
        return f"{key} must be one of {ctx['expected']}; got {got!r}"
    bounds = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
    if kind in bounds:
        limit = next(iter(ctx.values()))
        return f"{key} must be {bounds[kind]} {limit}; got {got!r}"
    text = str(error["msg"]).removeprefix("Input should be ")
    return f"{key} should be {text}; got {got!r}"


def load_node_config(path: Path | str | None, **overrides: Any) -> NodeConfig:
    """A TOML file's values (top level or under [flowedge]) checked by `NodeFile`, then the command line's
    `overrides` (None: not given) applied; the rules spanning keys
    (`NodeConfig.__post_init__`) see both, and their error names the file too."""
    values = validated(read_toml(Path(path)), str(path)) if path is not None else {}
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return NodeConfig(**{**values, **given})
    except ConfigError as exc:
        if path is None:
            raise
        raise ConfigError(f"{path}{' with the command line' if given else ''}: {exc}") from None
