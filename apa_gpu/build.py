"""Compile ``cuda/`` with nvcc into cached cubins (one per build variant).

The kernel must be built with our own flags (numerics.md §1.2): CuPy's NVRTC path always adds
``-ftz=true``, which would flush binary32 subnormals. So nvcc compiles each variant to a cubin, and
``cupy.RawModule(path=...)`` loads it.

Cache: ``$APA_GPU_CACHE`` or ``~/.cache/apa_gpu``; the file name carries a hash of every file in
``cuda/``, the flags, the variant's defines and the nvcc version, so an edit anywhere rebuilds.

Sources: ``$APA_GPU_SOURCES`` names another copy of ``cuda/`` to build instead (an edited copy being
checked with ``apa check``, or one with a planted bug that the check must catch).

``APA_GPU_BACKEND`` (``cuda``, the default, or ``sim``) chooses the build product and the backend
that runs it (``apa_gpu.device``): ``sim`` builds the CPU simulator instead (``cuda/sim/``: the same
kernel sources compiled by g++ into a shared library), for checking everything but the tensor cores
without a GPU.

CLI::

    python -m apa_gpu.build            # build every variant (parallel) into the cache
    python -m apa_gpu.build --report   # the same, then print each kernel's registers and spills
    python -m apa_gpu.build --check    # compile every variant into a temporary dir, nothing cached
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

CUDA_DIR = Path(__file__).resolve().parent.parent / "cuda"


def sources_dir() -> Path:
    """The kernel sources to build: ``$APA_GPU_SOURCES``, else the repository's ``cuda/``."""
    d = os.environ.get("APA_GPU_SOURCES")
    if not d:
        return CUDA_DIR
    path = Path(d).expanduser()
    if not (path / "apa.cu").is_file():
        raise BuildError(f"APA_GPU_SOURCES={d}: not a copy of cuda/ (it has no apa.cu)")
    return path

# numerics.md §1: no FMA contraction, subnormals kept, correctly rounded division.
FLAGS = (
    "-cubin",
    "-arch=sm_90a",
    "-O3",
    "-std=c++17",
    "--fmad=false",
    "--ftz=false",
    "--prec-div=true",
    "--prec-sqrt=true",
    "-lineinfo",
)

# The head dims the kernel implements (cuda/common.cuh refuses any other APA_D; tests/kernel/test_gpu_build.py
# checks the two agree), a subset of the spec's apa_emu.geometry.HEAD_DIMS.
SUPPORTED_D = (64, 128, 256)
BACKENDS = ("cuda", "sim")


def backend_name() -> str:
    """$APA_GPU_BACKEND: "cuda" (cubins run through CuPy, the default) or "sim" (the CPU simulator)."""
    name = os.environ.get("APA_GPU_BACKEND", "cuda")
    if name not in BACKENDS:
        raise ValueError(f"APA_GPU_BACKEND={name!r}: expected one of {', '.join(BACKENDS)}")
    return name


@dataclass(frozen=True)
class Variant:
    """One compiled variant of ``cuda/apa.cu`` (everything else is a run-time argument)."""

    d: int = 128
    trace: bool = False
    p2_f32: bool = False
    p2_s32: bool = False
    exp2_fast: bool = False

    def defines(self) -> tuple[str, ...]:
        return (
            f"-DAPA_D={self.d}",
            f"-DAPA_TRACE={int(self.trace)}",
            f"-DAPA_P2_F32={int(self.p2_f32)}",
            f"-DAPA_P2_S32={int(self.p2_s32)}",
            f"-DAPA_EXP2_FAST={int(self.exp2_fast)}",
        )

    @property
    def name(self) -> str:
        return f"apa_d{self.d}_t{int(self.trace)}_p{int(self.p2_f32)}_s{int(self.p2_s32)}_e{int(self.exp2_fast)}"


PROBE = "probe"  # cuda/probe.cu: MMA and primitive probes for the tests
SFU = "sfu"  # cuda/sfu.cu: the special-function instructions (apa_gpu/sfu.py); the GPU only


def all_variants() -> list[Variant]:
    return [
        Variant(d, trace, p2, s32, fast)
        for d in SUPPORTED_D
        for trace in (False, True)
        for p2 in (False, True)
        for s32 in (False, True)
        for fast in (False, True)
    ]


class BuildError(RuntimeError):
    pass


def find_nvcc() -> str:
    """nvcc from $APA_NVCC, PATH, $CUDA_PATH/$CUDA_HOME or /usr/local/cuda."""
    cands = [os.environ.get("APA_NVCC"), shutil.which("nvcc")]
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            cands.append(str(Path(os.environ[env]) / "bin" / "nvcc"))
    cands.append("/usr/local/cuda/bin/nvcc")
    for c in cands:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return c
    raise BuildError("nvcc not found: set APA_NVCC or put the CUDA toolkit's bin/ on PATH")


@lru_cache(maxsize=None)
def nvcc_version(nvcc: str) -> str:
    r = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise BuildError(f"{nvcc} --version failed: {r.stderr.strip()}")
    return r.stdout.strip().splitlines()[-1]


def cache_dir() -> Path:
    d = os.environ.get("APA_GPU_CACHE")
    return Path(d).expanduser() if d else Path.home() / ".cache" / "apa_gpu"


def sources_hash() -> str:
    h, root = hashlib.sha256(), sources_dir()
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.suffix in (".cu", ".cuh", ".h", ".cpp"):
            h.update(str(p.relative_to(root)).encode())
            h.update(b"\0")
            h.update(p.read_bytes())
            h.update(b"\0")
    return h.hexdigest()


# ---- CPU simulator (cuda/sim) --------------------------------------------------------------
# -fno-gnu-unique: __shared__ arrays are function-local statics there (cuda_sim.h), and g++ would
# merge those of inline functions across every library of the process, so that the d = 64 and the
# d = 128 simulators loaded side by side shared (and overran) one array.
SIM_FLAGS = ("-std=c++20", "-O2", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared", "-pthread",
             "-fno-gnu-unique", "-Wno-unknown-pragmas", "-DAPA_SIM")


def build_sim(variant=Variant()) -> Path:
    """The simulator library of ``variant`` (g++), cached like the cubins."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or "g++"
    if variant == SFU:
        raise BuildError("cuda/sfu.cu runs on the GPU only: the CPU simulator has no special-function unit")
    if variant == PROBE:
        src, defines, name = sources_dir() / "sim" / "sim_probe.cpp", (), "sim_probe"
    else:
        src, defines, name = sources_dir() / "sim" / "sim_apa.cpp", variant.defines(), "sim_" + variant.name
    ver = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout.splitlines()[:1]
    key = _key(sources_hash(), src.name, " ".join(SIM_FLAGS), " ".join(defines), *ver)

    def make(tmp: Path) -> None:
        cmd = [cxx, *SIM_FLAGS, *defines, "-o", str(tmp), str(src)]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise BuildError(f"simulator build failed ({' '.join(cmd)}):\n{r.stdout}{r.stderr}")

    return _cached(cache_dir() / f"{name}-{key}.so", make)


def _source_and_defines(variant) -> tuple[Path, tuple[str, ...], str]:
    if variant in (PROBE, SFU):
        return sources_dir() / f"{variant}.cu", (), variant
    return sources_dir() / "apa.cu", variant.defines(), variant.name


def _key(*parts: str) -> str:
    """Cache key of a build: everything that can change its output."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def _cached(path: Path, make) -> Path:
    """``path`` if it exists, else ``make(tmp)`` and an atomic rename: concurrent builders race
    harmlessly and a failed build leaves nothing behind."""
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        make(Path(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def compile_to(variant, out: Path, *, verbose: bool = False, extra: tuple[str, ...] = ()) -> str:
    """Compile one variant to ``out``; returns the compiler's diagnostic output."""
    nvcc = find_nvcc()
    src, defines, _ = _source_and_defines(variant)
    cmd = [nvcc, *FLAGS, *defines, *extra, "-o", str(out), str(src)]
    if verbose:
        cmd.insert(1, "-Xptxas=-v")
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise BuildError(f"nvcc failed ({' '.join(cmd)}):\n{r.stdout}{r.stderr}")
    return r.stdout + r.stderr


def build(variant=Variant()) -> Path:
    """The cubin of ``variant`` (a Variant, PROBE or SFU), compiled on first use and cached (the
    simulator library instead under APA_GPU_BACKEND=sim)."""
    if backend_name() == "sim":
        return build_sim(variant)
    nvcc = find_nvcc()
    src, defines, name = _source_and_defines(variant)
    key = _key(sources_hash(), src.name, " ".join(FLAGS), " ".join(defines), nvcc_version(nvcc))

    def make(tmp: Path) -> None:
        log = compile_to(variant, tmp, verbose=True)
        tmp.with_name(f"{name}-{key}.log").write_text(log)

    return _cached(cache_dir() / f"{name}-{key}.cubin", make)


def ptxas_report(text: str) -> list[str]:
    """The per-kernel lines of a -Xptxas=-v log: name, registers, stack, spills."""
    lines, name = [], None
    for line in text.splitlines():
        if "Compiling entry function" in line:
            name = line.split("'")[1]
        elif "spill" in line and name:
            spill = line.strip()
        elif "Used" in line and name:
            lines.append(f"{name:20s} {line.split(':', 1)[1].strip()}; {spill}")
            name = None
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compile every variant to a temp dir and report")
    ap.add_argument("--report", action="store_true", help="print the ptxas report of every cached variant")
    ap.add_argument("-j", type=int, default=os.cpu_count() or 4)
    args = ap.parse_args(argv)
    variants = [PROBE, SFU, *all_variants()]
    if args.check:
        with tempfile.TemporaryDirectory() as td:
            def one(v):
                name = _source_and_defines(v)[2]
                return name, compile_to(v, Path(td) / f"{name}.cubin", verbose=True)

            with ThreadPoolExecutor(args.j) as ex:
                results = list(ex.map(one, variants))
        for name, log in results:
            print(f"== {name}")
            for line in ptxas_report(log):
                print("  " + line)
        return 0
    if backend_name() == "sim":
        variants.remove(SFU)
    with ThreadPoolExecutor(args.j) as ex:
        paths = list(ex.map(build, variants))
    for v, p in zip(variants, paths):
        print(p)
        log = p.with_suffix(".log")
        if args.report and log.is_file():
            for line in ptxas_report(log.read_text()):
                print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
