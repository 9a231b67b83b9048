"""tools/testbed: the relay's shaping on loopback (delay, bandwidth, jitter keeping the stream in order,
stalls), and, where this process may create network namespaces, a 2-device `wifi` testbed serving a tiny
pair through the relay and leaving nothing behind, after a clean run and after its owner is killed."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.testbed import bed as bedmod  # noqa: E402
from tools.testbed import netns  # noqa: E402
from tools.testbed.presets import load_preset, preset_names  # noqa: E402
from tools.testbed.relay import LinkShape, Relay, RelaySpec, Route, precise_loop  # noqa: E402


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(1 << 16):
        writer.write(data)
        await writer.drain()
    writer.close()


async def _through_relay(shape: LinkShape, job):
    """Run job(reader, writer, relay) against an echo server behind a relay with `shape` on both directions."""
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    relay = Relay(RelaySpec(routes=(Route("127.0.0.1", 0, "127.0.0.1", server.sockets[0].getsockname()[1], "b"),),
                            links={}, peers={}, default=shape))
    await relay.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.ports()[0])
    try:
        return await job(reader, writer, relay)
    finally:
        writer.close()
        await relay.close()
        server.close()


def _run(shape: LinkShape, job):
    loop = precise_loop()
    try:
        return loop.run_until_complete(_through_relay(shape, job))
    finally:
        loop.close()


async def _round_trips(reader, writer, relay=None, n: int = 8) -> list[float]:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        writer.write(b"x")
        await writer.drain()
        await reader.readexactly(1)
        times.append(time.perf_counter() - t)
    return times


def test_the_relay_delays_each_direction():
    rtts = sorted(_run(LinkShape(delay_ms=15.0), _round_trips))
    assert rtts[0] >= 0.030                       # 15 ms each way, never less
    assert rtts[len(rtts) // 2] < 0.030 + 0.015   # and not much more (a loaded box wakes late now and then)
    assert sorted(_run(LinkShape(), _round_trips))[len(rtts) // 2] < 0.010   # guard: no delay, no wait


def test_the_relay_limits_bandwidth_with_a_token_bucket():
    size = 1_000_000

    async def bulk(reader, writer, relay):
        t = time.perf_counter()
        writer.write(b"y" * size)
        await writer.drain()
        await reader.readexactly(size)   # echoed: the bytes crossed the link both ways (full duplex)
        return time.perf_counter() - t

    expected_s = size * 8 / 40e6   # 0.2 s at 40 Mbit/s, each direction at once
    assert _run(LinkShape(bandwidth_mbps=40.0), bulk) == pytest.approx(expected_s, rel=0.35)
    assert _run(LinkShape(), bulk) < expected_s / 3   # guard: unlimited is much faster


def test_jitter_delays_but_never_reorders_and_stalls_add_their_time():
    payload = bytes(range(256)) * 400

    async def in_order(reader, writer, relay):
        for i in range(0, len(payload), 1000):
            writer.write(payload[i:i + 1000])
            await writer.drain()
            await asyncio.sleep(0)
        return await reader.readexactly(len(payload))

    assert _run(LinkShape(delay_ms=3.0, jitter_ms=3.0), in_order) == payload
    stalled = min(_run(LinkShape(stall_prob=1.0, stall_ms=25.0), _round_trips))
    assert stalled >= 0.050   # every chunk stalls, both ways


def test_the_relay_can_be_reshaped_while_connections_are_open():
    async def job(reader, writer, relay):
        before = min(await _round_trips(reader, writer, n=4))
        relay.set_default(LinkShape(delay_ms=10.0))
        return before, min(await _round_trips(reader, writer, n=4))

    before, after = _run(LinkShape(), job)
    assert before < 0.010 and after >= 0.020


def test_the_presets_come_from_the_simulators_link_file():
    assert {"lan", "wifi", "bad-wifi"} <= set(preset_names())
    assert load_preset("wifi") == LinkShape(delay_ms=5.0, jitter_ms=3.0, bandwidth_mbps=150.0)
    assert load_preset("bad-wifi").stall_prob == 0.01 and load_preset("lan").delay_ms == 0.3


# --- the whole testbed (root, network namespaces) ---------------------------------------------------------

WHY_NOT = netns.can_create()
needs_netns = pytest.mark.skipif(WHY_NOT is not None, reason=f"testbed cannot run here: {WHY_NOT}")


@needs_netns
def test_two_devices_on_wifi_answer_as_ar_and_leave_nothing(tmp_path, tiny_pair):
    from tools.testbed import sides

    base, draft = tiny_pair
    spec = bedmod.TestbedSpec(devices=2, link=load_preset("wifi"), cpus=1.0, memory_mb=2048)
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps([{"prompt_id": "p", "kind": "k", "text": "hello there", "ids": []}]))
    home = {"FLOWEDGE_HOME": str(tmp_path / "home")}
    with bedmod.Testbed(spec, tmp_path / "logs", env=home) as bed:
        sides.start_flowedge(bed, sides.FlowedgeSetup(str(base), str(draft), "flowspec"))
        (answer,) = sides.flowedge_prompts(bed, cases, 24, "flowspec")
        assert bed.groups[0].pids() and bedmod.marked_pids(spec.tag)     # guard: the checks below can fail
    ref = subprocess.run([sys.executable, "-m", "flowedge", "generate", "hello there", "--model", str(base),
                          "--strategy", "ar", "--max-new-tokens", "24", "--json"], capture_output=True, text=True,
                         check=True, env={**os.environ, **home}, cwd=ROOT)
    assert answer["token_ids"] == json.loads(ref.stdout.splitlines()[-1])["token_ids"]
    moved = json.loads((tmp_path / "logs" / "relay.stats.json").read_text())
    assert moved["d0>d1"] > 0 and moved["d1>d0"] > 0    # the pipeline crossed the relay both ways
    assert bedmod.leftovers(spec.tag) == []


@needs_netns
def test_a_killed_testbed_is_cleaned_up_and_a_terminated_one_cleans_itself(tmp_path):
    def start() -> tuple[subprocess.Popen, str]:
        proc = subprocess.Popen([sys.executable, "-m", "tools.testbed", "run", "--devices", "2", "--preset", "lan",
                                 "--logs", str(tmp_path), "--", "sleep", "60"], cwd=ROOT, start_new_session=True)
        tag = f"{proc.pid:x}"
        deadline = time.monotonic() + 20
        while f"fetb-{tag}-d1" not in netns.existing() or not (tmp_path / "relay.ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the testbed did not come up"
            time.sleep(0.1)
        (tmp_path / "relay.ready").unlink()
        return proc, tag

    proc, tag = start()
    proc.send_signal(signal.SIGTERM)        # its handlers tear everything down
    proc.wait(20)
    assert bedmod.leftovers(tag) == []

    proc, tag = start()
    os.killpg(proc.pid, signal.SIGKILL)     # no handler runs: everything stays ...
    proc.wait(5)
    assert bedmod.leftovers(tag)
    out = subprocess.run([sys.executable, "-m", "tools.testbed", "cleanup"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert tag in out and bedmod.leftovers(tag) == []   # ... until cleanup

