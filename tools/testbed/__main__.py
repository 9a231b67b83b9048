"""flowedge's testbed: N edge devices on one Linux box (root only).

Each device is a network namespace whose CPU and memory a cgroup limits (--cpus, --memory-mb, as a board's);
every byte between devices crosses a userspace relay that impairs the link (presets from
device_profiles/links.toml: lan, wifi, bad-wifi). Everything is torn down afterwards, after a failure
or a signal too; `cleanup` removes what a killed testbed left.

    python -m tools.testbed run --devices 3 --preset wifi [--each 'CMD {ip} {i}'] -- CMD ...
        CMD runs on device 0 with TESTBED_ADDRS (the devices' relayed addresses, comma-separated);
        --each starts a service on devices 1..N-1 first ({ip}: that device's own address, {i}: its index)
    python -m tools.testbed flowedge --devices 3 --preset wifi [--model M --draft D --strategy auto]
        [--prompt TEXT] [--max-new-tokens 128]      a flowedge cluster across the devices, one answer
    python -m tools.testbed bench --devices 2,3 --presets lan,wifi,bad-wifi [--sides ...] --out DIR
        flowedge vs llama.cpp RPC on the same prompts (bench.py)
    python -m tools.testbed cleanup [--all]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):   # `python tools/testbed`: make `tools.testbed` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.testbed import bed as bedmod  # noqa: E402
from tools.testbed.presets import load_preset, preset_names  # noqa: E402

log = logging.getLogger("testbed")


def common(p: argparse.ArgumentParser, many: bool = False) -> None:
    if many:
        p.add_argument("--devices", default="2,3", help="comma-separated device counts")
        p.add_argument("--presets", default="lan,wifi,bad-wifi", help=f"comma-separated, of {preset_names()}")
    else:
        p.add_argument("--devices", type=int, default=2)
        p.add_argument("--preset", default="wifi", choices=preset_names())
    p.add_argument("--cpus", type=float, default=1.0, help="CPU per device, in cores (cgroup quota)")
    p.add_argument("--memory-mb", type=int, default=4096, help="memory per device (cgroup limit)")
    p.add_argument("--logs", default=None, help="log folder (default: a new temporary one)")


def spec_of(args, devices: int, preset: str) -> bedmod.TestbedSpec:
    return bedmod.TestbedSpec(devices=devices, link=load_preset(preset), cpus=args.cpus, memory_mb=args.memory_mb)


def log_dir(args, name: str) -> Path:
    return Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix=f"testbed-{name}-"))


def cmd_run(args) -> int:
    if not args.cmd:
        raise SystemExit("give the command to run on device 0 after --")
    with bedmod.Testbed(spec_of(args, args.devices, args.preset), log_dir(args, "run")) as bed:
        for k in range(1, args.devices) if args.each else ():
            bed.spawn(k, shlex.split(args.each.format(ip=bed.local_addr(k), i=k)), f"each-{k}")
        time.sleep(0.5 if args.each else 0)
        addrs = ",".join(bed.addr(i) for i in range(args.devices))
        res = subprocess.run(bed.net.exec_prefix(bed.net.device(0)) + args.cmd,
                             env=bed.env(TESTBED_ADDRS=addrs, TESTBED_SELF=bed.local_addr(0)))
        print(f"logs: {bed.log_dir}", file=sys.stderr)
        return res.returncode


def cmd_flowedge(args) -> int:
    from tools.testbed import sides

    setup = sides.FlowedgeSetup(model=args.model, draft=args.draft, strategy=args.strategy)
    with bedmod.Testbed(spec_of(args, args.devices, args.preset), log_dir(args, "flowedge")) as bed:
        t0 = time.monotonic()
        sides.start_flowedge(bed, setup)
        print(f"cluster ready in {time.monotonic() - t0:.1f} s (logs: {bed.log_dir})", file=sys.stderr)
        cases = bed.log_dir / "cases.json"
        cases.write_text(json.dumps([{"prompt_id": "cli", "kind": "cli", "text": args.prompt, "ids": []}]))
        (answer,) = sides.flowedge_prompts(bed, cases, args.max_new_tokens, args.strategy)
        print(json.dumps(answer) if args.json else
              f"{answer['new_tokens']} tokens, {answer['decode_tokens_per_s'] or 0:.2f} tok/s decode, "
              f"strategy {answer['strategy']}")
    return 0


def cmd_bench(args) -> int:
    from tools.testbed.bench import run_bench

    return run_bench(args)


def cmd_cleanup(args) -> int:
    why = bedmod.netns.can_create()
    if why:
        raise SystemExit(f"testbed: {why}")
    removed = bedmod.cleanup(everything=args.all)
    print(f"removed testbeds: {', '.join(removed) or 'none'}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.testbed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="set up, run a command on device 0, tear down")
    common(run)
    run.add_argument("--each", default="", help="a service to start on devices 1..N-1 ({ip}, {i})")
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    fe = sub.add_parser("flowedge", help="a flowedge cluster across the devices, one prompt")
    common(fe)
    fe.add_argument("--model", default="qwen2.5-coder-1.5b")
    fe.add_argument("--draft", default="qwen2.5-coder-0.5b")
    fe.add_argument("--strategy", default="auto")
    fe.add_argument("--prompt", default="Write a Python function that checks whether a number is prime.")
    fe.add_argument("--max-new-tokens", type=int, default=128)
    fe.add_argument("--json", action="store_true")
    bench = sub.add_parser("bench", help="flowedge vs llama.cpp RPC across devices and presets")
    common(bench, many=True)
    from tools.testbed.bench import add_bench_options
    add_bench_options(bench)
    clean = sub.add_parser("cleanup", help="remove what killed testbeds left (namespaces, cgroups, processes)")
    clean.add_argument("--all", action="store_true", help="also testbeds whose owner still runs")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if getattr(args, "cmd", None) and args.cmd[:1] == ["--"]:
        args.cmd = args.cmd[1:]
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")
    handler = {"run": cmd_run, "flowedge": cmd_flowedge, "bench": cmd_bench, "cleanup": cmd_cleanup}
    return handler[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
