"""Installable anywhere: the wheel carries its data files, and a text client never imports torch."""
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
NO_TORCH = """
import sys
from flowedge import AsyncClient, Client, ContextOverflow, RequestFailed
from flowedge.daemon import async_client
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
        "error: `flowedge http` needs uvicorn, which this install lacks: pip install 'flowedge[http]'")


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


@pytest.mark.packaging
def test_wheel_installs_and_generates_outside_the_source_tree(tmp_path, tiny_pair):
    src = _source_copy(tmp_path / "src")
    # offline when this venv has setuptools (torch pulls it in); else pip fetches it for an isolated build
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", str(src),
                    "-w", str(tmp_path / "wheels")], check=True, timeout=300, cwd=tmp_path)
    wheel = next((tmp_path / "wheels").glob("flowedge-*.whl"))
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
    example = subprocess.run([str(python), "-c", "from flowedge.daemon.config import EXAMPLE_CONFIG, "
                              "load_node_config; print(load_node_config(EXAMPLE_CONFIG).role)"],
                             env=env, cwd=run_dir, capture_output=True, text=True)
    assert example.stdout.strip() == "head", example.stderr
