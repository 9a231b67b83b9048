"""The NEON tiles (aarch64; dotprod and i8mm where the target has them), cross-compiled and run under qemu:
tests/native/tiles_check.c checks every row's bits against the row alone for each pass shape, at 1, 2 and
5 threads, and the outputs against the portable build of the same sources (int8 activations bit for
bit). Skipped, saying so, without Debian's gcc-aarch64-linux-gnu and qemu-user (`make test` installs
them when it runs as root)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "flowedge" / "kernels"
HARNESS = ROOT / "tests" / "native" / "tiles_check.c"
CROSS_CC, QEMU, SYSROOT = "aarch64-linux-gnu-gcc", "qemu-aarch64", "/usr/aarch64-linux-gnu"
FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-std=gnu11")   # build.py's, less -shared / -fPIC
SOURCES = ("w4a16", "w8a16", "int8act")
# the reference: the portable build, its entry points renamed so both builds link into one program
RENAMED = ("w4a16_linear", "w8a16_linear", "w4a8_linear", "w8a8_linear", "w4a16_isa", "w8a16_isa", "int8act_isa")
REFERENCE = ("-DFLOWEDGE_PORTABLE", *(f"-D{name}=ref_{name}" for name in RENAMED))
TIMEOUT_S = 120

pytestmark = pytest.mark.skipif(
    shutil.which(CROSS_CC) is None or shutil.which(QEMU) is None,
    reason=f"needs {CROSS_CC} and {QEMU} (apt-get install gcc-aarch64-linux-gnu qemu-user; make test does as root)")


def compile_check(march: str, out: Path) -> Path:
    """tiles_check built for `march` against both builds of the three kernel sources."""
    objects = []
    for name in SOURCES:
        for prefix, extra in (("", ()), ("ref_", REFERENCE)):
            obj = out / f"{prefix}{name}.o"
            run([CROSS_CC, *FLAGS, f"-march={march}", *extra, "-c", "-o", str(obj), str(KERNELS / f"{name}.c")])
            objects.append(str(obj))
    program = out / "tiles_check"
    run([CROSS_CC, *FLAGS, f"-march={march}", "-o", str(program), str(HARNESS), *objects, "-lm"])
    return program


def run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert done.returncode == 0, f"{' '.join(cmd)}:\n{done.stdout}{done.stderr}"
    return done.stdout


@pytest.mark.parametrize("march,int8_tiles", [
    ("armv8-a", "portable"),            # Cortex-A53/A72 (Raspberry Pi 3/4): no dotprod
    ("armv8.2-a+dotprod", "neon-dotprod"),  # Cortex-A76/A78 (Raspberry Pi 5, Jetson Orin)
    ("armv8.6-a+i8mm", "neon-i8mm"),    # Neoverse V1/N2, Cortex-A710 and later
])
def test_neon_tiles_are_row_and_thread_invariant_and_agree_with_the_portable_build(march, int8_tiles, tmp_path):
    program = compile_check(march, tmp_path)
    report = run([QEMU, "-cpu", "max", "-L", SYSROOT, str(program)])
    assert report.splitlines()[0] == f"tiles: w4a16 neon, w8a16 neon, int8act {int8_tiles}"
    assert report.count("\nok ") == 12   # 4 kernels x 3 group sizes
