"""Installable anywhere: the wheel carries its data files and its type marker, a client or a planner never
imports torch, and the wheel alone (no extras, a clean venv) is a working, typed client and planner."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GATEWAY = ROOT / "docs" / "examples" / "gateway.py"   # the example app a user's mypy --strict checks
NO_TORCH = """
import sys
from flowedge import AsyncClient, Client, ContextOverflow, RequestFailed
from flowedge.client import async_client
from flowedge.transport import protocol as p
client = Client("127.0.0.1:1", insecure=True)
frames = p.PromptRequest(request_id=1, text="hi", max_new_tokens=4).to_frames()
chunk = p.decode(p.TokenChunk(request_id=1, token_ids=[7, 70_000], text="x", done=True).to_frames())
assert chunk.token_ids == (7, 70_000), chunk
print(json.dumps(sorted(m for m in ("torch", "transformers") if m in sys.modules)))
"""


def test_client_and_text_protocol_do_not_import_torch():
    proc = subprocess.run([sys.executable, "-c", "import json\n" + NO_TORCH], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


def _setup_cfg() -> dict[str, list[str]]:
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = lambda text: [x.split("#")[0].strip() for x in text.splitlines() if x.split("#")[0].strip()]
    reqs = {"install": lines(cfg["options"]["install_requires"])}
    reqs.update({k: lines(v) for k, v in cfg["options.extras_require"].items()})
    return reqs


def _name(req: str) -> str:
    return req.split("[")[0].split(">")[0].split("<")[0].split("=")[0].strip().lower()


def test_the_base_install_is_the_client_and_the_test_extra_has_every_other_one():
    """Before: `pip install flowedge` pulled torch, bitsandbytes, matplotlib and the HTTP stack (1.4 GB)
    for a gateway that only needs the client; accelerate was required and never imported. It is back in
    `bench` (and so `test`) only: a fresh CI venv without it failed the GGUF-oracle tests."""
    reqs = _setup_cfg()
    assert sorted(map(_name, reqs["install"])) == ["click", "msgpack", "numpy", "pyzmq"]
    for extra, want in (("node", "torch"), ("http", "fastapi"), ("nf4", "bitsandbytes"), ("bench", "matplotlib")):
        assert want in map(_name, reqs[extra]), extra
    test = set(map(_name, reqs["test"]))
    for extra in ("node", "http", "nf4", "bench"):
        assert set(map(_name, reqs[extra])) <= test, extra   # `make test` installs .[test] only
    # accelerate only where transformers' GGUF loading (the fp32 oracle) runs: never on a node or a client
    assert "accelerate" not in {_name(r) for k in ("install", "node", "http", "nf4") for r in reqs[k]}
    assert "accelerate" in map(_name, reqs["bench"])


def test_a_command_whose_extra_is_missing_says_which_extra_to_install(tmp_path):
    """A lean install's `flowedge http` / `serve`: one line naming the extra, not a traceback."""
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "uvicorn.py").write_text("raise ModuleNotFoundError('no uvicorn here', name='uvicorn')\n")
    proc = subprocess.run([sys.executable, "-m", "flowedge", "http"], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": f"{blocker}:{ROOT}"})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: `flowedge http` needs uvicorn, which this install lacks: install flowedge with its `http` extra "
        "(from a checkout: pip install -e '.[http]')")


def _source_copy(dest: Path) -> Path:
    """The tracked source tree (no build outputs, no venv), so the build leaves the checkout clean."""
    ignore = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "bench-out",
                                    ".hypothesis", "tests", "docs")
    shutil.copytree(ROOT, dest, ignore=ignore)
    return dest


def _fresh_venv(path: Path) -> Path:
    """A new venv that sees this interpreter's packages (torch, transformers...) through a .pth file,
    but not the flowedge checkout: only what the wheel installs."""
    venv.EnvBuilder(with_pip=False).create(path)
    python = path / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    deps = [p for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]) if p]
    (Path(site) / "test-deps.pth").write_text("\n".join(dict.fromkeys(deps)) + "\n")
    return python


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `make wheel` builds, built once for this module from a copy of the tracked source."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = _source_copy(tmp / "src")
    # offline when this venv has setuptools (torch pulls it in); else pip fetches it for an isolated build
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", str(src),
                    "-w", str(tmp / "wheels")], check=True, timeout=300, cwd=tmp)
    return next((tmp / "wheels").glob("flowedge-*.whl"))


@pytest.mark.packaging
def test_wheel_installs_and_generates_outside_the_source_tree(tmp_path, tiny_pair, wheel):
    python = _fresh_venv(tmp_path / "venv")
    # --force-reinstall: the .pth above makes the checkout's own (editable) flowedge look installed already
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--force-reinstall", str(wheel)], check=True, timeout=300)
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FLOWEDGE_PROFILES")}
    env.update(OMP_NUM_THREADS="1", FLOWEDGE_HOME=str(tmp_path / "home"))
    where = subprocess.run([str(python), "-c", "import flowedge; print(flowedge.__file__)"], env=env,
                           cwd=run_dir, capture_output=True, text=True, check=True).stdout
    assert str(tmp_path / "venv") in where and str(ROOT) not in where
    base, draft = tiny_pair
    proc = subprocess.run([str(tmp_path / "venv" / "bin" / "flowedge"), "generate", "hello", "--model", str(base),
                           "--draft", str(draft), "--strategy", "flowspec", "--max-new-tokens", "8", "--nodes", "3",
                           "--threads", "1", "--json"], env=env, cwd=run_dir, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["new_tokens"] > 0 and out["sim_tokens_per_s"] > 0
    if shutil.which(os.environ.get("CC") or "gcc"):   # the wheel carries the kernel's C source and builds it
        assert list((tmp_path / "home" / "kernels").glob("w4a16-*.so")), proc.stderr[-2000:]
    example = subprocess.run([str(python), "-c", "from flowedge.node.node_config import EXAMPLE_CONFIG; from "
                              "flowedge.launch.config_file import load_node_config; "
                              "print(load_node_config(EXAMPLE_CONFIG).role)"],
                             env=env, cwd=run_dir, capture_output=True, text=True)
    assert example.stdout.strip() == "head", example.stderr
    # the device profiles and the systemd units (top-level folders in a checkout) are the wheel's own copies
    shipped = subprocess.run([str(python), "-c", "from flowedge import systemd; from flowedge.costs.profiles import "
                              "list_devices, profiles_dir; print(profiles_dir(), systemd.HERE, len(list_devices()), "
                              "all((systemd.HERE / u).is_file() for u in systemd.UNITS))"],
                             env=env, cwd=run_dir, capture_output=True, text=True)
    profiles, units, devices, all_units = shipped.stdout.split()
    assert str(tmp_path / "venv") in profiles and str(tmp_path / "venv") in units, shipped.stdout + shipped.stderr
    assert int(devices) >= 6 and all_units == "True", shipped.stdout


@pytest.mark.packaging
def test_the_wheel_alone_in_a_clean_venv_is_a_client_and_a_planner_without_torch(tmp_path, wheel):
    """What a gateway host or a buyer-to-be runs: the wheel without extras in a venv of its own (no
    system site-packages, nothing of this one), its four dependencies resolved from PyPI as a user's pip
    resolves them. Then `flowedge plan` for a registry model on device profiles, the client imports, and
    mypy --strict on the example gateway app against the installed package (its py.typed)."""
    venv.EnvBuilder(with_pip=True).create(tmp_path / "clean")
    python, bin_dir = tmp_path / "clean" / "bin" / "python", tmp_path / "clean" / "bin"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FLOWEDGE_PROFILES", "VIRTUAL_ENV")}
    env.update(FLOWEDGE_HOME=str(tmp_path / "home"))
    run = lambda *args: subprocess.run([str(a) for a in args], env=env, cwd=tmp_path, capture_output=True,
                                       text=True, timeout=600)
    pip = run(python, "-m", "pip", "install", "-q", wheel)
    assert pip.returncode == 0, f"installing the wheel (pyzmq, msgpack, numpy, click from PyPI):\n{pip.stderr[-3000:]}"
    probe = run(python, "-c", "import importlib.util, flowedge\nfrom flowedge import AsyncClient, Client\n"
                "Client('127.0.0.1:1', insecure=True).close()\n"
                "print(flowedge.__file__, importlib.util.find_spec('torch') is None)")
    assert probe.returncode == 0, probe.stderr
    where, no_torch = probe.stdout.split()
    assert where.startswith(str(tmp_path / "clean")) and no_torch == "True"   # the venv's own flowedge, no torch
    for command in ("plan", "prompt", "status"):
        helped = run(bin_dir / "flowedge", command, "--help")
        assert helped.returncode == 0 and "Usage: flowedge" in helped.stdout, helped.stderr
    plan = run(bin_dir / "flowedge", "plan", "--model", "qwen2.5-coder-1.5b", "--devices",
               "orin-nano-8gb,orin-nano-8gb", "--json")
    assert plan.returncode == 0, plan.stderr
    report = json.loads(plan.stdout)
    assert report["layers"] == 28 and sum(s["count"] for s in report["stages"]) == 28
    assert report["predicted_tokens_per_s"]["ar-pp (analytic)"] > 0
    app = tmp_path / "app"
    app.mkdir()
    shutil.copy(GATEWAY, app)
    mypy = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--python-executable", str(python),
                           "--cache-dir", str(tmp_path / "mypy-cache"), GATEWAY.name], cwd=app, env=env,
                          capture_output=True, text=True, timeout=300)
    assert mypy.returncode == 0, mypy.stdout + mypy.stderr   # before: "missing library stubs or py.typed marker"


# ---- light on purpose: no torch where a client or a planner runs, and typed for the apps using it -----
LIGHT_COMMANDS = """
import json, sys
from click.testing import CliRunner
from flowedge.cli import main
runner = CliRunner()
for args in (["plan", "--model", "llama-2-7b", "--devices", "orin-nano-8gb,orin-nano-8gb"],
             ["prompt", "--help"], ["status", "--help"]):
    result = runner.invoke(main, args)
    assert result.exit_code == 0, (args, result.output)
print(json.dumps(sorted(m for m in ("torch", "transformers") if m in sys.modules)))
"""


def test_plan_prompt_and_status_do_not_import_torch(tmp_path):
    """`flowedge plan` is for before buying anything: a whole plan (the pair not cached here, so no
    simulation) and the client commands start without torch, though this venv has it."""
    proc = subprocess.run([sys.executable, "-c", LIGHT_COMMANDS], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "FLOWEDGE_HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


def test_plan_without_torch_gives_the_analytic_figure_and_says_why(monkeypatch):
    """The pair cached but no torch (a client install): the plan, not an install error."""
    from click.testing import CliRunner

    from flowedge.cli import main
    from flowedge.models import registry

    monkeypatch.setattr(registry, "is_cached", lambda entry, home=None: True)
    monkeypatch.setitem(sys.modules, "torch", None)   # `import torch` raises ModuleNotFoundError
    result = CliRunner().invoke(main, ["plan", "--model", "llama-2-7b", "--devices", "orin-nano-8gb,orin-nano-8gb",
                                       "--json"])
    assert result.exit_code == 0, result.output
    assert list(json.loads(result.stdout)["predicted_tokens_per_s"]) == ["ar-pp (analytic)"]
    assert "the simulated figures need torch (the `node` extra)" in result.stderr


def test_the_package_says_it_is_typed():
    assert (ROOT / "flowedge" / "py.typed").is_file()
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert "py.typed" in cfg["options.package_data"]["flowedge"].split()
    assert "include flowedge/py.typed" in (ROOT / "MANIFEST.in").read_text().splitlines()


def test_a_gateway_app_type_checks_under_mypy_strict(tmp_path):
    """docs/examples/gateway.py, as a user's mypy --strict sees the client; a copy with one type mistake
    fails, so the check is not passing for want of types (an Any would let the mistake through). The
    answers' module and the package root, what every such app imports, are held to --strict themselves."""
    broken = tmp_path / "broken_gateway.py"
    source = GATEWAY.read_text()
    assert "rate = answer.wall_tokens_per_s or 0.0" in source
    broken.write_text(source.replace("rate = answer.wall_tokens_per_s or 0.0", "rate: str = answer.usage"))
    proc = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--cache-dir",
                           str(tmp_path / "cache"), str(GATEWAY), str(broken), "flowedge/__init__.py",
                           "flowedge/client/client_answer.py"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, "MYPYPATH": str(ROOT)})
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and errors[0].startswith(f"{broken}:") and '"Usage"' in errors[0], proc.stdout
