"""Node configuration: one dataclass, read from TOML (`/etc/flowedge/flowedge.toml` by default).

Every key is optional except what the role needs; unknown keys are an error (a typo must not
silently fall back to a default). A file is checked by pydantic (`config_file.NodeFile`) before it
becomes a `NodeConfig`, whose own checks cover configs built in code and the rules across keys. See
`flowedge/data/flowedge.toml.example` (installed with the package, `EXAMPLE_CONFIG`) for a commented file.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from flowedge.core.config import DRAFT_QUANTS, LM_HEAD_PLACES, STRATEGY_NAMES
from flowedge.costs.profiles import list_devices
from flowedge.errors import ConfigError, ModelError
from flowedge.home import flowedge_home   # (the one $FLOWEDGE_HOME resolver)
from flowedge.models.registry import MODELS
from flowedge.transport.addresses import DEFAULT_PORT, split_addr

DEFAULT_CONFIG_PATH = Path("/etc/flowedge/flowedge.toml")
# the commented example, package data (ships in the wheel): copy it to DEFAULT_CONFIG_PATH and edit
EXAMPLE_CONFIG = Path(__file__).resolve().parents[1] / "data" / "flowedge.toml.example"
ROLES = ("head", "stage", "drafter", "standby")
WIRE_DTYPES = ("float16", "bfloat16", "float32")
# hidden states on the wire: the stages' activation dtype, so a pipelined answer is the one-process answer;
# float16/bfloat16 halve the bytes but round the residual stream between stages
DEFAULT_WIRE_DTYPE = "float32"
QUANTS = ("none", "int4", "nf4", "auto")
TREE_SIZES = ("profile", "paper")
# pre-drafting (engine/predraft.py): off | idle (in node 0's gaps) | drafter (on a joined drafter node;
# node 0 drafts alone while none is joined)
PREDRAFT_MODES = ("off", "idle", "drafter")
MAX_CLIENT_WEIGHT = 1000


@dataclass(frozen=True)
class NodeConfig:
    role: str = "head"
    head: str = f"127.0.0.1:{DEFAULT_PORT}"   # head: where to bind (host:port); stage: where to join
    node_id: str = ""                         # default: hostname-pid
    device: str = "x86-cpu"                   # device profile name (reported in status)
    threads: int = 0                          # torch threads; 0 = all cores
    keys_dir: str = ""                        # default: $FLOWEDGE_HOME/keys
    cluster: str = "flowedge"                 # the name the head announces on the LAN (mDNS), `join --cluster`
    discovery: bool = True                    # head: announce itself by mDNS (node/discovery.py)
    insecure: bool = False
    # Liveness, both ways (Paranoid Pirate): heartbeats every heartbeat_ms; a peer silent for
    # stage_timeout_s (= heartbeat_ms x the liveness count: 500 ms x 4) is dead. A stage uses the same
    # limit for the head (then re-joins). Clients with work in progress heartbeat too.
    heartbeat_ms: int = 500
    stage_timeout_s: float = 2.0              # a stage (or, seen from a stage, the head) silent this long is dead
    # head only: the request scheduler (engine/scheduler.py, driven by node/head_requests.py)
    client_timeout_s: float = 10.0            # a client with a request in progress silent this long has left
    recovery_s: float = 30.0                  # a request in flight waits this long for a lost stage's slot to be
                                              # filled (queued ones keep their place: their clients' timeouts)
    replan_on_loss: bool = True               # a slot still empty near the end of recovery_s: re-plan the model
                                              # onto the surviving stages if they can hold it (node/shrink.py)
    stall_timeout_s: float = 120.0            # a running request with no pipeline output this long is replayed
    max_concurrent: int = 4                   # requests in the pipeline at once (stages batch them); the rest queue
    kv_budget_tokens: int = 0                 # KV tokens a stage holds for all its requests; 0 = from each
                                              # stage's free memory (node/kv_budget.py); else also a cap
    max_queued_per_client: int = 32           # requests one client may have waiting; past it "busy" (0: no cap)
    client_weights: dict[str, float] = field(default_factory=dict)   # client name -> its share of the
                                              # starts (1 if not named; engine/fair_queue.py)
    # head only
    model: str = "qwen2.5-coder-1.5b"
    draft: str = "qwen2.5-coder-0.5b"
    stages: int = 2                           # stage nodes in the plan (the head is node 0)
    layers: list[int] = field(default_factory=list)   # layers per stage; empty = planned from the
                                              # stages' devices and free memory (flowedge/plan/)
    context: int = 4096                       # tokens of KV cache the planner reserves on every stage
    strategy: str = "auto"                    # for prompts that name none (flowspec or ar-pp: engine/auto_policy.py)
    wire_dtype: str = DEFAULT_WIRE_DTYPE      # hidden states on the wire (see DEFAULT_WIRE_DTYPE)
    quant: str = "int4"                       # stage weights: int4 (W4A16 shards, the default) | none (16-bit
                                              # shards) | nf4 (16-bit shards, bitsandbytes at load) | auto
    draft_quant: str = "auto"                 # draft model, lm_head included: auto (int4 where it runs) |
                                              # int4 | nf4 | none; lossless either way (engine/drafter.py)
    tree_nodes: int = 0                       # 0 = the engine's default (FlowSpec A.1)
    tree_size: str = "profile"                # flowspec's first tree: profile (sized from the devices'
                                              # profiles, costs/sizing.py) | paper (FlowSpec's d0 = 6)
    lookup_tokens: int = 4                    # draft-call rows for prompt-lookup guesses (core/lookup.py); 0 = off
    predraft: str = "off"                     # off | idle: draft the next expansion in node 0's gaps while
                                              # segments are in flight | drafter: on a drafter node
                                              # (`flowedge join --drafter`; engine/predraft.py)
    lm_head_at: str = "auto"                  # where tokens are chosen: auto (the strategy's choice; the
                                              # last stage then also holds the lm_head) | head | last-stage
    # stage only
    stage: int = 0                            # preferred slot in the plan (1..stages); 0 = first free
    data_port: int | str = 0                  # a port, or a range "5560-5569" (the first free); 0 = any free port.
                                              # Listens on the interface the head is reached through
    advertise: str = ""                       # host others reach this stage at; default: that interface's address
    same_host: bool = False                   # read the head's shard files directly (flowedge up)
    memory_offer_gib: float = 0.0             # memory this node offers the cluster (what the planner may fill);
                                              # 0 = what the OS reports free when it joins
    # a standby head (node/standby.py) and the nodes that follow it
    heads: list[str] = field(default_factory=list)   # stage/drafter: the head and its standbys, tried in turn
    listen: str = ""                          # standby: where it serves once it takes over (host:port)
    failover_s: float = 1.5                   # standby: the head silent this long is lost, and it takes over

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"role must be one of {list(ROLES)}, got {self.role!r}")
        if self.wire_dtype not in WIRE_DTYPES:
            raise ConfigError(f"wire_dtype must be one of {list(WIRE_DTYPES)}, got {self.wire_dtype!r}")
        if self.quant not in QUANTS:
            raise ConfigError(f"quant must be one of {list(QUANTS)}, got {self.quant!r}")
        if self.draft_quant not in DRAFT_QUANTS:
            raise ConfigError(f"draft_quant must be one of {list(DRAFT_QUANTS)}, got {self.draft_quant!r}")
        if self.lm_head_at not in LM_HEAD_PLACES:
            raise ConfigError(f"lm_head_at must be one of {list(LM_HEAD_PLACES)}, got {self.lm_head_at!r}")
        if self.tree_size not in TREE_SIZES:
            raise ConfigError(f"tree_size must be one of {list(TREE_SIZES)}, got {self.tree_size!r}")
        if self.stages < 1:
            raise ConfigError(f"stages must be >= 1, got {self.stages}")
        if self.context < 1:
            raise ConfigError(f"context must be >= 1, got {self.context}")
        if self.predraft not in PREDRAFT_MODES:
            raise ConfigError(f"predraft must be one of {list(PREDRAFT_MODES)}, got {self.predraft!r}")
        if self.lookup_tokens < 0:
            raise ConfigError(f"lookup_tokens must be >= 0, got {self.lookup_tokens}")
        if self.layers and len(self.layers) != self.stages:
            raise ConfigError(f"layers lists {len(self.layers)} stages but stages = {self.stages}")
        if self.heartbeat_ms < 10 or self.stage_timeout_s * 1000 < 2 * self.heartbeat_ms:
            raise ConfigError("heartbeat_ms must be >= 10 and stage_timeout_s at least two heartbeats")
        if self.max_concurrent < 1:
            raise ConfigError(f"max_concurrent must be >= 1, got {self.max_concurrent}")
        check_client_weights(self.client_weights)
        if self.max_queued_per_client < 0:
            raise ConfigError(f"max_queued_per_client must be >= 0 (0 = no cap), got {self.max_queued_per_client}")
        if self.memory_offer_gib < 0:
            raise ConfigError(f"memory_offer_gib must be >= 0 (0 = the free memory), got {self.memory_offer_gib}")
        if self.kv_budget_tokens < 0:
            raise ConfigError(f"kv_budget_tokens must be >= 0 (0 = from free memory), got {self.kv_budget_tokens}")
        for name in ("client_timeout_s", "recovery_s", "stall_timeout_s"):
            if not getattr(self, name) * 1000 >= 2 * self.heartbeat_ms:
                raise ConfigError(f"{name} must be at least two heartbeats ({2 * self.heartbeat_ms} ms)")
        if self.strategy not in STRATEGY_NAMES:
            raise ConfigError(f"strategy must be one of {', '.join(STRATEGY_NAMES)}; got {self.strategy!r}")
        if self.device not in list_devices() and not Path(self.device).suffix == ".toml":
            raise ConfigError(f"device must be a profile ({', '.join(list_devices())}) or a .toml file; "
                              f"got {self.device!r}")
        for addr in self.heads + ([self.listen] if self.listen else []):
            split_addr(addr)
        if self.role in ("head", "standby"):
            check_model("model", self.model)
            check_draft(self.draft, self.predraft)
        split_addr(self.head)
        self.data_ports()

    def with_(self, **changes) -> "NodeConfig":
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def data_ports(self) -> tuple[int, int]:
        """`data_port` as (first, last); (0, 0) = any free port."""
        v = self.data_port
        text = str(v).strip() if type(v) in (int, str) else ""
        first, sep, last = text.partition("-")
        if first.isdigit() and (not sep or last.isdigit()):
            lo, hi = int(first), int(last if sep else first)
            if (lo, hi) == (0, 0) or 0 < lo <= hi < 65536:
                return lo, hi
        raise ConfigError(f"data_port must be a port (1-65535), a range like \"5560-5569\" or 0 (any), got {v!r}")

    @property
    def name(self) -> str:
        return self.node_id or f"{os.uname().nodename}-{os.getpid()}"

    @property
    def keys_path(self) -> Path:
        return Path(self.keys_dir).expanduser() if self.keys_dir else flowedge_home() / "keys"


def check_client_weights(weights: object) -> None:
    """`client_weights`: a table of client names (as `flowedge status` lists them) to weights in (0, 1000]."""
    if not isinstance(weights, dict) or not all(
            isinstance(k, str) and type(v) in (int, float) and 0 < v <= MAX_CLIENT_WEIGHT for k, v in weights.items()):
        raise ConfigError(f"client_weights must map client names to weights in (0, {MAX_CLIENT_WEIGHT}], "
                          f"e.g. {{\"http:key-3f2a9c01b7de\" = 4}}; got {weights!r}")


def check_model(key: str, spec: str) -> None:
    """A model the head can resolve without asking anyone: a known name, a Hugging Face directory or a
    .gguf file (what models/resolve.py takes), so a typo fails at once, not after the processes start."""
    path = Path(spec).expanduser()
    if spec in MODELS or (path.is_dir() and (path / "config.json").is_file()) or \
            (path.is_file() and path.suffix.lower() == ".gguf"):
        return
    raise ConfigError(f"{key} {spec!r} is not a known model ({', '.join(sorted(MODELS))}), a Hugging Face "
                      f"directory with config.json, or a .gguf file")


def check_draft(spec: str, predraft: str) -> None:
    """Node 0's draft: a draft model (`check_model`) or a draft head (`head:NAME` or a head file) that
    exists; a head drafts from features only node 0 holds, so no drafter node can pre-draft for it."""
    from flowedge.models.draft_head_spec import is_head_spec, resolve_head

    if not is_head_spec(spec):
        check_model("draft", spec)
        return
    try:
        resolve_head(spec)
    except ModelError as e:
        raise ConfigError(f"draft {spec!r}: {e}") from None
    if predraft == "drafter":
        raise ConfigError("predraft = \"drafter\" needs a draft model: a draft head drafts from the base's "
                          "features, which only node 0 has")
