"""The composition root: parses flags, builds objects, wires them. No logic of its own beyond that."""
from __future__ import annotations

import json
import logging
import sys

import click

from flowedge.core.config import LM_HEAD_PLACES, PREDRAFT_MODES
from flowedge.errors import ConfigError, FlowedgeError
from flowedge.node.node_config import DEFAULT_WIRE_DTYPE, WIRE_DTYPES
from flowedge.threads import set_threads

log = logging.getLogger("flowedge")

DEFAULT_MODEL = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"


# the extra (setup.cfg) that brings each optional package: a lean install names what to add
EXTRA_OF = {**dict.fromkeys(("torch", "transformers", "gguf", "safetensors", "psutil"), "node"),
            **dict.fromkeys(("fastapi", "uvicorn", "prometheus_client", "starlette", "pydantic"), "http"),
            "bitsandbytes": "nf4", "matplotlib": "bench"}


class _Root(click.Group):
    """Turn every FlowedgeError into one line on stderr and exit status 1; so is a package that a lean
    install left out (the line names the extra that brings it)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except FlowedgeError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
        except ModuleNotFoundError as e:
            top = (e.name or "").split(".")[0]
            if top not in EXTRA_OF:
                raise
            extra = EXTRA_OF[top]   # not on PyPI: flowedge installs from a checkout or its wheel (README)
            click.echo(f"error: `flowedge {ctx.invoked_subcommand}` needs {top}, which this install lacks: install "
                       f"flowedge with its `{extra}` extra (from a checkout: pip install -e '.[{extra}]')", err=True)
            sys.exit(1)


@click.group(cls=_Root)
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@click.version_option(package_name="flowedge")
def main(verbose: int) -> None:
    """flowedge: serve an LLM split across edge devices with pipelined tree speculation."""
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


sampling_options = [
    click.option("--max-new-tokens", default=64, show_default=True, type=int),
    click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy."),
    click.option("--top-k", default=0, show_default=True, type=int, help="0 = off."),
    click.option("--top-p", default=1.0, show_default=True, type=float, help="1 = off."),
    click.option("--seed", default=None, type=int),
]


def with_sampling(f):
    for opt in reversed(sampling_options):
        f = opt(f)
    return f


@main.command()
@click.argument("prompt")
@click.option("--model", default=DEFAULT_MODEL, show_default=True, help="Registry name, HF model dir or .gguf file.")
@click.option("--draft", default=DEFAULT_DRAFT, show_default=True,
              help="Draft model (same tokenizer), or a draft head: head:NAME or a head file (`flowedge draft-head`).")
@click.option("--strategy", default="ar", show_default=True,
              help="ar | tree (one process), or any pipeline strategy (simulated cluster).")
@with_sampling
@click.option("--tree-topk", default=None, type=int, help="Draft tree: children per expanded node.")
@click.option("--tree-depth", default=None, type=int, help="Draft tree depth d0.")
@click.option("--tree-nodes", default=None, type=int, help="Draft tree size L (nodes kept, root included).")
@click.option("--nodes", default=5, show_default=True, type=int, help="Simulated cluster size (pipeline strategies).")
@click.option("--profile", default="orin-nano-8gb", show_default=True, help="Device profile (pipeline strategies).")
@click.option("--link", default=None, help="Link profile (default: the device profile's).")
@click.option("--quant", default="int4", show_default=True,
              type=click.Choice(["none", "int4", "nf4", "auto"]),
              help="Base model weights: int4 = W4A16 (stored packed), none = 16-bit checkpoint, nf4 = "
                   "bitsandbytes at load; the reference `ar` and every strategy use the same.")
@click.option("--no-chat", is_flag=True, help="Send the prompt raw instead of through the chat template.")
@click.option("--threads", default=None, type=int, help="torch threads (default: all cores).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def generate(prompt, model, draft, strategy, max_new_tokens, temperature, top_k, top_p, seed,
             tree_topk, tree_depth, tree_nodes, nodes, profile, link, quant, no_chat, threads, as_json):
    """Generate text for PROMPT in this process (reference `ar`, one-node `tree`, or a simulated cluster)."""
    from flowedge.core.sampling import SamplingParams
    from flowedge.generate import GenerateRequest, run_generate

    set_threads(threads)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    req = GenerateRequest(prompt=prompt, model=model, draft=draft, strategy=strategy,
                          max_new_tokens=max_new_tokens, params=params, chat=not no_chat,
                          tree_topk=tree_topk, tree_depth=tree_depth, tree_nodes=tree_nodes,
                          nodes=nodes, profile=profile, link=link, quant=quant)
    stream = None if as_json else (lambda text: click.echo(text, nl=False))
    out = run_generate(req, on_text=stream)
    if as_json:
        click.echo(json.dumps(out))
    else:
        click.echo()


@main.command()
@click.option("--model", default=DEFAULT_MODEL, show_default=True)
@click.option("--draft", default=DEFAULT_DRAFT, show_default=True,
              help="Draft model or draft head (head:NAME); 'oracle': each drafting strategy also runs as "
                   "<name>@oracle with perfect proposals (the reference answer) at this default draft's cost "
                   "(sim driver, T=0).")
@click.option("--strategies", default="ar-pp,naive-pp,pruned-pp,flowspec-nosbd,flowspec,pipedec,auto",
              show_default=True)
@click.option("--prompts", "prompt_file", default=None, type=click.Path(exists=True, dir_okay=False),
              help='A .jsonl file with one {"prompt": ...} per line.')
@click.option("--dataset", "datasets", multiple=True,
              help="mt-bench | humaneval | mt-bench:CATEGORY (writing, roleplay, reasoning, math, coding, "
                   "extraction, stem, humanities; repeatable).")
@click.option("--samples", default=10, show_default=True, type=int, help="Prompts per dataset.")
@click.option("--max-new-tokens", default=128, show_default=True, type=int)
@click.option("--temperature", default=0.0, show_default=True, type=float)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--nodes", default=5, show_default=True, type=int)
@click.option("--profile", default="orin-nano-8gb", show_default=True)
@click.option("--link", default=None)
@click.option("--path", "compute_path", default=None,
              help="Stages' kernel path from the device profile (e.g. hf-bnb4, mlc); default: the profile's.")
@click.option("--driver", default="sim", show_default=True, type=click.Choice(["sim", "zmq"]),
              help="sim: virtual clock from --profile; zmq: a local cluster of real processes, wall clock.")
@click.option("--wire-dtype", default=DEFAULT_WIRE_DTYPE, show_default=True,
              type=click.Choice(WIRE_DTYPES), help="zmq driver: hidden states on the wire.")
@click.option("--verify", default="stages", show_default=True, type=click.Choice(["stages", "oracle"]),
              help="sim driver: stages = real stage math; oracle = base logits along the accepted path only "
                   "(same tokens and simulated time, far less CPU; see flowedge/sim/oracle.py).")
@click.option("--tree-size", default="profile", show_default=True, type=click.Choice(["profile", "paper"]),
              help="flowspec's initial tree: sized from the profile's costs, or --tree-nodes/--tree-depth as given "
                   "(FlowSpec A.1). Baselines always use the given sizes.")
@click.option("--tree-nodes", default=None, type=int)
@click.option("--tree-depth", default=None, type=int)
@click.option("--tree-topk", default=None, type=int)
@click.option("--segment-size", default=None, type=int, help="l_max: most nodes per segment (default 16).")
@click.option("--draft-width", default=None, type=int,
              help="Nodes per best-first draft call in flowspec's expansions (default: as many as cost the same "
                   "as top-k on the profile, --tree-size profile; else top-k).")
@click.option("--lookup-tokens", default=None, type=int,
              help="Rows of each such call that run a prompt-lookup guess of the best path ahead (default 4; 0 = off).")
@click.option("--lm-head-at", default="auto", show_default=True, type=click.Choice(LM_HEAD_PLACES),
              help="Where the base lm_head chooses tokens; auto = each strategy's choice "
                   "(last stage, except naive-pp's one batched call on node 0).")
@click.option("--predraft", default="off", show_default=True, type=click.Choice(PREDRAFT_MODES),
              help="flowspec/auto: draft the next expansion while segments are in flight, in node 0's idle gaps "
                   "(idle) or on a drafter device beside node 0 (drafter: sim driver only).")
@click.option("--predraft-calls", default=None, type=int, help="Draft calls per pre-draft job (default 2).")
@click.option("--out", "out_dir", default="bench-out", show_default=True, type=click.Path(file_okay=False))
@click.option("--threads", default=None, type=int)
@click.option("--concurrency", default=None,
              help="Comma-separated numbers of concurrent requests (e.g. 1,2,4,8): every prompt arrives at once "
                   "and up to that many share the pipeline with dynamic batching; 1 = one at a time. Writes "
                   "table.md and concurrency.png.")
def bench(model, draft, strategies, prompt_file, datasets, samples, max_new_tokens, temperature, seed,
          nodes, profile, link, compute_path, driver, wire_dtype, verify, tree_size, tree_nodes, tree_depth, tree_topk,
          segment_size, draft_width, lookup_tokens, lm_head_at, predraft, predraft_calls, out_dir, threads,
          concurrency):
    """Run strategies side by side on the same prompts and cluster; write results.json, table.md, timeline.png."""
    from pathlib import Path

    from flowedge.bench.runner import BenchConfig, run_bench
    from flowedge.core.config import SpecConfig

    set_threads(threads)
    names = _bench_strategies(strategies, temperature, oracle_draft=draft == ORACLE_DRAFT, driver=driver)
    if draft == ORACLE_DRAFT:
        draft = DEFAULT_DRAFT
    prompts = _bench_prompts(prompt_file, datasets, samples)
    spec = SpecConfig().with_(tree_nodes=tree_nodes, tree_depth=tree_depth, topk=tree_topk, l_max=segment_size,
                              draft_width=draft_width, lookup_tokens=lookup_tokens, lm_head_at=lm_head_at,
                              predraft=predraft, predraft_calls=predraft_calls)
    cfg = BenchConfig(model=model, draft=draft, strategies=names, max_new_tokens=max_new_tokens,
                      temperature=temperature, seed=seed, nodes=nodes, profile=profile, link=link,
                      path=compute_path, verify=verify, tree_size=tree_size, spec=spec)
    say = lambda s: click.echo(s, err=True)  # noqa: E731
    if concurrency:
        levels = _levels(concurrency)
        if driver == "zmq":
            from flowedge.bench.zmq_concurrency import run_concurrency_zmq

            run_concurrency_zmq(cfg, prompts, levels, Path(out_dir), say, wire_dtype=wire_dtype, threads=threads or 0)
        else:
            from flowedge.bench.concurrency import run_concurrency

            run_concurrency(cfg, prompts, levels, Path(out_dir), say=say)
        click.echo((Path(out_dir) / "table.md").read_text())
        click.echo(f"results: {out_dir}/results.json, plot: {out_dir}/concurrency.png", err=True)
        return
    if driver == "zmq":
        from flowedge.bench.zmq_driver import run_bench_zmq

        run_bench_zmq(cfg, prompts, Path(out_dir), say, wire_dtype=wire_dtype, threads=threads or 0)
    else:
        run_bench(cfg, prompts, Path(out_dir), say=say)
    click.echo((Path(out_dir) / "table.md").read_text())
    click.echo(f"results: {out_dir}/results.json" + (f", timeline: {out_dir}/timeline.png" if driver == "sim" else ""),
               err=True)


def _bench_strategies(text: str, temperature: float, *, oracle_draft: bool, driver: str) -> tuple[str, ...]:
    """The strategies `bench` runs, each checked; with `--draft oracle` each drafting one also runs with
    perfect proposals (sim/oracle_draft.py)."""
    from flowedge.bench.runner import ORACLE_SUFFIX
    from flowedge.engine.strategies import make_strategy

    names = tuple(s.strip() for s in text.split(",") if s.strip())
    for name in names:
        make_strategy(name.removesuffix(ORACLE_SUFFIX))
    if any(n.endswith(ORACLE_SUFFIX) for n in names) and temperature != 0:
        raise ConfigError(f"<strategy>{ORACLE_SUFFIX} needs --temperature 0 (its proposals are the reference answer)")
    if not oracle_draft:
        return names
    if driver != "sim" or temperature != 0:
        raise ConfigError("--draft oracle needs the sim driver and --temperature 0 (its proposals are the "
                          "reference answer)")
    return names + tuple(f"{n}{ORACLE_SUFFIX}" for n in names if make_strategy(n).needs_draft)


def _bench_prompts(prompt_file: str | None, datasets: tuple[str, ...], samples: int) -> list:
    from flowedge.datasets import load_prompt_file, load_prompts

    prompts = list(load_prompt_file(prompt_file)) if prompt_file else []
    for ds in datasets:
        prompts += load_prompts(ds, samples)
    if not prompts:
        raise ConfigError("no prompts: give --prompts FILE.jsonl and/or --dataset mt-bench|humaneval")
    return prompts


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--concurrency takes comma-separated integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise ConfigError(f"--concurrency levels must be >= 1, got {text!r}")
    return levels


ORACLE_DRAFT = "oracle"


def _attach_commands() -> None:
    """Attach the commands that live next to the code they drive."""
    from flowedge.api.http_command import http
    from flowedge.launch.cluster_commands import COMMANDS
    from flowedge.distill.draft_head_commands import draft_head
    from flowedge.models.model_commands import models, split
    from flowedge.plan.plan_command import plan
    from flowedge.systemd.systemd_commands import systemd_group
    from flowedge.transport.keys_commands import keys

    for command in (models, split, keys, plan, *COMMANDS, http, systemd_group, draft_head):
        main.add_command(command)


_attach_commands()

if __name__ == "__main__":
    main()
