"""`flowedge serve | join | up | down | prompt | status` (wired into the CLI by flowedge/cli.py; `http` is
in api/http_command.py, `systemd` in systemd/systemd_commands.py)."""
from __future__ import annotations

import json
import logging
import signal
import threading
import time
from contextlib import contextmanager

import click

from flowedge.client.client_answer import Answer
from flowedge.core.config import DRAFT_QUANTS
from flowedge.errors import ConfigError, FlowedgeError
from flowedge.launch.cli_options import HEAD_OPTION, INSECURE_OPTION, KEYS_OPTION, daemon_logging, liveness_options
from flowedge.node.head_search import HeadSearch, search_lan
from flowedge.node.node_config import DEFAULT_CONFIG_PATH, DEFAULT_WIRE_DTYPE, EXAMPLE_CONFIG, ROLES, WIRE_DTYPES
from flowedge.threads import set_threads
from flowedge.transport.addresses import DEFAULT_PORT

log = logging.getLogger("flowedge")


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def handler(signum, frame):
        log.info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def _run_node(cfg, search: HeadSearch | None = None) -> None:
    from flowedge.allocator import HeapTrimmer, limit_arenas

    limit_arenas()   # before torch and zmq start their threads
    set_threads(cfg.threads or None)
    stop = _stop_on_signals()
    HeapTrimmer(stop).start()
    from flowedge.node.rejoin import run_node

    run_node(cfg, stop, search)   # a deposed head rejoins as the new head's standby


@click.command()
@click.option("--config", "config_path", default=str(DEFAULT_CONFIG_PATH), show_default=True,
              help=f"TOML node configuration (commented example: {EXAMPLE_CONFIG}).")
@click.option("--role", type=click.Choice(list(ROLES)), default=None,
              help="Override the file's role.")
@click.option("--threads", type=int, default=None, help="Torch threads for this process.")
@click.option("--cluster", default=None, help="Head: the name it announces on the LAN (default: flowedge).")
@click.option("--no-discovery", is_flag=True, help="Head: do not announce itself on the LAN (mDNS).")
@liveness_options(head=True)
def serve(config_path, role, threads, cluster, no_discovery, heartbeat_ms, stage_timeout, client_timeout, recovery,
          stall_timeout, max_concurrent, kv_budget_tokens) -> None:
    """Run one node (head, stage, drafter or standby head) as a long-lived daemon."""
    daemon_logging()
    from flowedge.launch.config_file import load_node_config   # pydantic: the node extra
    _run_node(load_node_config(config_path, role=role, threads=threads, cluster=cluster,
                               discovery=False if no_discovery else None, heartbeat_ms=heartbeat_ms,
                               stage_timeout_s=stage_timeout, client_timeout_s=client_timeout, recovery_s=recovery,
                               stall_timeout_s=stall_timeout, max_concurrent=max_concurrent,
                               kv_budget_tokens=kv_budget_tokens))


@click.command()
@click.argument("head_addr", required=False)
@click.option("--cluster", default=None, help="With no HEAD_ADDR: join the head announcing this cluster name.")
@click.option("--discover-timeout", default=30.0, show_default=True,
              help="With no HEAD_ADDR: seconds to look for a head on the LAN (mDNS).")
@click.option("--config", "config_path", default=None, help="Optional TOML file for the other settings.")
@click.option("--node-id", default=None, help="Stable name of this node (default hostname-pid).")
@click.option("--device", default=None, help="Device profile name to report (e.g. orin-nano-8gb).")
@click.option("--threads", type=int, default=None)
@click.option("--stage", type=int, default=None, help="Preferred stage slot (1..stages); default: first free.")
@click.option("--data-port", default=None,
              help="Port (or range, e.g. 5560-5569: the first free) for segments from the previous hop (default: any).")
@click.option("--advertise", default=None, help="Host other nodes reach this one at (default: guessed).")
@click.option("--same-host", is_flag=True, default=None, help="Read the head's shard files directly (same machine).")
@click.option("--drafter", is_flag=True, help="Join as a drafter: hold the head's draft model and pre-draft for "
              "node 0 (the head runs with predraft = \"drafter\"); takes no stage slot.")
@click.option("--standby", is_flag=True, help="Join as a standby head: follow the head at HEAD_ADDR and take "
              "over, serving at --listen, when it is lost (docs/operations.md).")
@click.option("--listen", default=None, help="With --standby: HOST:PORT to serve at once it takes over.")
@click.option("--heads", default=None, help="The head and its standbys, HOST:PORT,HOST:PORT: tried in turn.")
@liveness_options(head=False)
@KEYS_OPTION
@INSECURE_OPTION
def join(head_addr, cluster, discover_timeout, config_path, node_id, device, threads, stage, data_port, advertise,
         same_host, drafter, standby, listen, heads, heartbeat_ms, stage_timeout, keys_dir, insecure) -> None:
    """Start a stage node that joins the head at HEAD_ADDR (or the one found on the LAN by mDNS), fetches
    its shard and serves its layers (or, with --drafter, a drafter node)."""
    daemon_logging()
    search = None
    if not head_addr and not heads:   # found by mDNS: looked for again if it does not answer (an address given is kept)
        try:
            from flowedge.node.discovery import browse
        except ImportError:
            raise click.UsageError("finding the head on the LAN needs the zeroconf package "
                                   "(pip install zeroconf), or give its address: `flowedge join HOST:PORT`") from None
        search = search_lan(browse, cluster, discover_timeout, lambda text: click.echo(text, err=True))
        assert search.head is not None   # search_lan returns a search that found its first head
        head_addr = search.head.addr
    from flowedge.launch.config_file import load_node_config
    cfg = load_node_config(config_path, role="standby" if standby else "drafter" if drafter else None,
                           head=head_addr or (heads.split(",")[0] if heads else None), listen=listen,
                           heads=heads.split(",") if heads else None, node_id=node_id, device=device,
                           threads=threads, stage=stage, data_port=data_port, advertise=advertise,
                           same_host=same_host,
                           heartbeat_ms=heartbeat_ms, stage_timeout_s=stage_timeout, keys_dir=keys_dir,
                           insecure=insecure or None)
    _run_node(cfg if cfg.role != "head" else cfg.with_(role="stage"), search)


@click.command()
@click.option("--nodes", default=3, show_default=True, help="Head + stages.")
@click.option("--model", default="qwen2.5-coder-1.5b", show_default=True)
@click.option("--draft", default="qwen2.5-coder-0.5b", show_default=True)
@click.option("--strategy", default="auto", show_default=True)
@click.option("--port", default=DEFAULT_PORT, show_default=True)
@click.option("--threads", default=0,
              help="Torch threads per process (default: every core; the processes take turns, idle threads sleep).")
@click.option("--wire-dtype", type=click.Choice(WIRE_DTYPES), default=DEFAULT_WIRE_DTYPE,
              show_default=True, help="Hidden states on the wire: float32 (the stages' activations: exact) or a "
              "16-bit dtype (half the bytes; may flip a greedy token at a near-tie).")
@click.option("--quant", type=click.Choice(["none", "int4", "nf4", "auto"]), default="int4", show_default=True,
              help="Stage weights: int4 = W4A16 shards, none = 16-bit shards, nf4 = bitsandbytes at load.")
@click.option("--draft-quant", type=click.Choice(DRAFT_QUANTS), default="auto", show_default=True,
              help="Draft model weights, lm_head included (auto = int4 where it runs; lossless).")
@click.option("--layers", default=None, help="Layers per stage, e.g. 14,14.")
@click.option("--prompt", default=None, help="Answer this prompt (streaming), then stop the cluster.")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--detach", is_flag=True, help="Start in the background and return once ready (`flowedge down`).")
@click.option("--ready-timeout", default=1800.0, show_default=True, help="Seconds to wait for the cluster.")
@click.option("--data-port", default="0", show_default=True,
              help="The stages' data ports: a range such as 5560-5569 (each stage takes the first free one); "
                   "0 = any free port. They listen on loopback, as the head does.")
@click.option("--drafter", is_flag=True, help="Start a drafter process too, and pre-draft on it (predraft = drafter).")
@liveness_options(head=True)
@INSECURE_OPTION
def up(nodes, model, draft, strategy, port, threads, wire_dtype, quant, draft_quant, layers, prompt, max_new_tokens,
       detach, ready_timeout, data_port, drafter, heartbeat_ms, stage_timeout, client_timeout, recovery, stall_timeout,
       max_concurrent, kv_budget_tokens, insecure) -> None:
    """Start a local cluster (a head + NODES-1 stages, one process each) and serve until Ctrl-C."""
    from flowedge.launch import local_cluster
    from flowedge.client.sync_client import wait_ready

    spec = local_cluster.LocalClusterSpec(
        nodes=nodes, model=model, draft=draft, strategy=strategy, port=port, threads=threads, insecure=insecure,
        wire_dtype=wire_dtype, quant=quant, draft_quant=draft_quant, layers=_int_list(layers), data_port=data_port,
        drafter=drafter, predraft="drafter" if drafter else "off",
        **{k: v for k, v in dict(heartbeat_ms=heartbeat_ms, stage_timeout_s=stage_timeout,
                                 client_timeout_s=client_timeout, recovery_s=recovery,
                                 stall_timeout_s=stall_timeout, max_concurrent=max_concurrent,
                                 kv_budget_tokens=kv_budget_tokens).items()
                   if v is not None})
    cluster = local_cluster.start(spec, detach=detach)
    click.echo(f"starting {nodes} nodes on 127.0.0.1:{port} (logs: {cluster.run_dir})", err=True)
    try:
        t0 = time.monotonic()
        with _showing_progress(cluster) as shown:
            wait_ready(spec.addr, ready_timeout, insecure=insecure, alive=cluster.alive, why=cluster.failure,
                       progress=lambda line: shown.note(f"  {line}"), drafters=int(drafter))
        at = ("" if port == DEFAULT_PORT else f" --head {spec.addr}") + (" --insecure" if insecure else "")
        click.echo(f"cluster ready in {time.monotonic() - t0:.1f} s: `flowedge prompt TEXT{at}` or "
                   f"`flowedge status{at}`", err=True)
        if detach:
            cluster.supervise_detached()
            down_cmd = "flowedge down" + ("" if port == DEFAULT_PORT else f" --port {port}")
            click.echo(f"detached; a supervisor starts a stage that dies again (its log: "
                       f"{cluster.run_dir / local_cluster.SUPERVISOR_LOG}); stop it all with `{down_cmd}`", err=True)
            return
        if prompt is not None:
            _answer_once(spec, prompt, max_new_tokens)
            return
        click.echo("serving; a stage that dies is started again; Ctrl-C stops every node", err=True)
        _supervise(cluster)
    except KeyboardInterrupt:
        click.echo("\nstopping", err=True)
    except FlowedgeError:
        detach = False
        raise
    finally:
        if not detach:
            signal.signal(signal.SIGINT, signal.SIG_IGN)   # a second Ctrl-C must not orphan children
            cluster.stop()
            dead = [d for d in cluster.dead() if "exit 0" not in d and "exit -15" not in d]
            if dead:
                click.echo("nodes that did not stop cleanly: " + "; ".join(dead), err=True)


def _supervise(cluster) -> None:
    """`up` in the foreground: restart the stages that die (with backoff, said on stderr) while the head lives."""
    from flowedge.launch.supervisor import POLL_S, Supervisor

    supervisor = Supervisor(cluster, lambda line: click.echo(f"flowedge up: {line}", err=True))
    while not supervisor.head_exited():
        supervisor.tick()
        time.sleep(POLL_S)
    raise FlowedgeError("the head exited: " + "; ".join(cluster.dead()))


@click.command(hidden=True)
@click.option("--port", type=int, required=True, help="The port given to `flowedge up --detach`.")
def supervise(port) -> None:
    """Restart the stages of a detached local cluster that die (started by `flowedge up --detach`, stopped
    by `flowedge down`)."""
    from flowedge.home import flowedge_home
    from flowedge.launch.supervisor import watch_detached

    daemon_logging()
    watch_detached(flowedge_home() / "run" / f"up-{port}", _stop_on_signals())


def _answer_once(spec, prompt: str, max_new_tokens: int) -> None:
    """`up --prompt`: stream one answer from the cluster just started, then a summary line."""
    from flowedge.client.sync_client import Client

    with Client(spec.addr, insecure=spec.insecure) as client:
        for piece in client.stream(prompt, max_new_tokens=max_new_tokens):
            click.echo(piece, nl=False)
        res = client.last_result
    click.echo()
    if res is not None:
        click.echo(f"[{res.usage.completion_tokens} tokens in {res.client_wall_s:.1f} s{_first_token(res)}, "
                   f"{_rate(res)}, strategy {res.stats.strategy}, {spec.nodes} nodes]", err=True)


@click.command()
@click.option("--port", default=None, type=int,
              help="The port given to `flowedge up` (default: the one detached cluster there is).")
def down(port) -> None:
    """Stop a cluster started with `flowedge up --detach`."""
    from flowedge.launch import local_cluster

    click.echo(local_cluster.down(port))


@click.command()
@click.argument("text", required=False)
@HEAD_OPTION
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--temperature", default=0.0, show_default=True, type=float)
@click.option("--top-k", default=0, type=int, help="0 = off.")
@click.option("--top-p", default=1.0, type=float, help="1 = off.")
@click.option("--seed", default=None, type=int)
@click.option("--strategy", default="", help="Default: the head's configured strategy.")
@click.option("--system", default=None, help="A system prompt before the user's turn (chat template).")
@click.option("--stop", multiple=True, help="End the answer where this text appears (repeatable; cut off).")
@click.option("--conversation", "conversation_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help='A JSON list of {"role": "system"|"user"|"assistant", "content": ...} turns (instead of TEXT).')
@click.option("--raw", is_flag=True, help="Send TEXT to the model as is, without the chat template.")
@click.option("--timeout", default=300.0, show_default=True, help="Seconds of silence before giving up.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object (as `generate --json`, plus wall-clock tok/s).")
@KEYS_OPTION
@INSECURE_OPTION
def prompt(text, head, max_new_tokens, temperature, top_k, top_p, seed, strategy, system, stop, conversation_file,
           raw, timeout, as_json, keys_dir, insecure) -> None:
    """Send TEXT (or a --conversation) to a running cluster and stream the answer."""
    from flowedge.client.sync_client import Client

    messages = _conversation(conversation_file) if conversation_file else None
    if (text is None) == (messages is None):
        raise ConfigError("give either TEXT or --conversation FILE")
    with Client(head, keys_dir=keys_dir, insecure=insecure, timeout_s=timeout) as client:
        kwargs = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                      seed=seed, strategy=strategy, system=system, stop=list(stop), raw=raw, messages=messages)
        if as_json:
            click.echo(json.dumps(client.generate(text, **kwargs).to_dict()))
            return
        for piece in client.stream(text, **kwargs):
            click.echo(piece, nl=False)
        click.echo()
        res = client.last_result
        if res is not None:
            click.echo(f"[{res.usage.completion_tokens} tokens{_first_token(res)}, {_rate(res)}]", err=True)


def _first_token(answer: Answer) -> str:
    """', first token after X s' for the summary line: what a user waits before text starts."""
    first_s = answer.first_token_s
    return f", first token after {first_s:.2f} s" if first_s is not None else ""


def _rate(answer: Answer) -> str:
    rate = answer.wall_tokens_per_s
    return f"{rate:.2f} tok/s" if rate is not None else "no tok/s"


def _conversation(path: str) -> list[dict]:
    try:
        turns = json.loads(open(path, encoding="utf-8").read())
    except (OSError, ValueError) as err:
        raise ConfigError(f"--conversation {path}: not a JSON file: {err}") from None
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        raise ConfigError(f'--conversation {path}: want a JSON list of {{"role": ..., "content": ...}} maps')
    return turns


@click.command()
@HEAD_OPTION
@click.option("--json", "as_json", is_flag=True, help="Every node's row as JSON (what the dashboard reads).")
@click.option("--watch", is_flag=True, help="Refresh in place: per-node load, tokens/s, acceptance, queue.")
@click.option("--interval", default=2.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds between refreshes (--watch).")
@click.option("--iterations", default=None, type=int, hidden=True, help="Stop after this many refreshes.")
@KEYS_OPTION
@INSECURE_OPTION
def status(head, as_json, watch, interval, iterations, keys_dir, insecure) -> None:
    """Show every node: address, role, layer range, model, memory, load, last heartbeat."""
    from flowedge.launch import status_view
    from flowedge.client.sync_client import Client
    from flowedge.launch.standby_view import status_of

    with Client(head, keys_dir=keys_dir, insecure=insecure, timeout_s=10.0) as client:
        if watch:
            try:
                status_view.watch(lambda: status_of(client), lambda text: click.echo(text, color=True), interval,
                                  iterations)
            except KeyboardInterrupt:
                pass
            return
        nodes = status_of(client)   # at a standby's address: the standby's row
    if as_json:
        click.echo(json.dumps(nodes))
        return
    click.echo(status_view.render(nodes))


@contextmanager
def _showing_progress(cluster):
    """While a local cluster starts: follow its logs' progress lines (download, conversion, split,
    shard fetch) and show them here: a tqdm status line on a terminal, plain lines otherwise."""
    from flowedge.progress import NodeProgress, ProgressTail

    shown = NodeProgress()
    tail = ProgressTail(cluster.log_paths(), shown)
    stop = threading.Event()

    def follow() -> None:
        while not stop.wait(0.5):
            tail.poll()

    follower = threading.Thread(target=follow, name="progress-tail", daemon=True)
    follower.start()
    try:
        yield shown
    finally:
        stop.set()
        follower.join()
        tail.poll()
        shown.close()


def _int_list(text: str | None) -> list[int]:
    if not text:
        return []
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"--layers must be comma-separated integers, got {text!r}") from None


COMMANDS = [serve, join, up, down, prompt, status, supervise]
