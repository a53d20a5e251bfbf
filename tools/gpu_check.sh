#!/usr/bin/env bash
# One-shot GPU check for the H200 (run from the repo root):
#
#   bash tools/gpu_check.sh            # full: build, apa check, primitives, MMA probes, kernel vs emulator, real data
#   QUICK=1 bash tools/gpu_check.sh    # smaller: fewer examples and MMA tiles, no 32k-key problem
#   GPU_TESTS=tests/kernel/test_gpu_mma.py PYTEST_K=probe bash tools/gpu_check.sh   # a subset
#   APA_GPU_BACKEND=sim QUICK=1 bash tools/gpu_check.sh   # the same on the CPU simulator, without a GPU
#                                                         # (tests marked hardware are skipped there)
#
# Writes logs, a JUnit XML and any reproducers under $OUT (the device tool's output folder) or
# /tmp/apa_gpu_check, and ends with a short summary. Reproducers replay with
#   python -m apa_gpu.replay FILE.npz
# Cubins are cached in $APA_GPU_CACHE, default ./.gpu_build (git-ignored). Building them on a CPU
# machine first saves device time: `APA_GPU_CACHE=.gpu_build python -m apa_gpu.build`, then carry
# .gpu_build to the device; the cache key includes the nvcc version, so a mismatch just rebuilds.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
# The kernel is apa_emu's engine "gpu" by the package's entry point; a checkout run from PYTHONPATH,
# not installed (as on the device), names it instead (apa_emu/engines.py).
export APA_ENGINES="${APA_ENGINES:-gpu=apa_gpu.engine:GpuEngine}"
OUTDIR="${OUT:-/tmp/apa_gpu_check}"
mkdir -p "$OUTDIR"
export APA_GPU_CACHE="${APA_GPU_CACHE:-$PWD/.gpu_build}"
export APA_GPU_REPRO_DIR="$OUTDIR/repro"
export APA_GPU_BACKEND="${APA_GPU_BACKEND:-cuda}"
PY="${PYTHON:-python3}"
QUICK="${QUICK:-0}"
if [ "$QUICK" = 1 ]; then
  export APA_GPU_EXAMPLES="${APA_GPU_EXAMPLES:-12}" APA_GPU_MMA_TILES="${APA_GPU_MMA_TILES:-100000}"
  KSEL="${PYTEST_K:-not llama}"
else
  export APA_GPU_EXAMPLES="${APA_GPU_EXAMPLES:-40}" APA_GPU_MMA_TILES="${APA_GPU_MMA_TILES:-100000}"
  KSEL="${PYTEST_K:-}"
fi
GPU_TESTS="${GPU_TESTS:-tests/kernel/test_gpu_params.py tests/kernel/test_gpu_formats.py tests/kernel/test_gpu_mma.py tests/kernel/test_gpu_fma_sites.py tests/kernel/test_gpu_budget.py tests/kernel/test_gpu_kernel.py}"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }

stamp "environment"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  "$PY" - <<'EOF'
import os, sys, numpy, numba
print("python", sys.version.split()[0], "numpy", numpy.__version__, "numba", numba.__version__,
      "backend", os.environ["APA_GPU_BACKEND"])
try:
    import cupy
    print("cupy", cupy.__version__, "runtime", cupy.cuda.runtime.runtimeGetVersion(),
          "device", cupy.cuda.runtime.getDeviceProperties(0)["name"].decode())
except Exception as e:
    print("cupy: unavailable:", e)
EOF
  nvcc --version | tail -2
} 2>&1 | tee "$OUTDIR/env.txt"

stamp "build (ptxas report in $OUTDIR/build.txt)"
"$PY" -m apa_gpu.build --report -j "$(nproc)" > "$OUTDIR/build.txt" 2>&1 || { cat "$OUTDIR/build.txt"; echo "BUILD FAILED"; exit 1; }
grep -E "cubin|apa_pass" "$OUTDIR/build.txt" | sed 's#.*/##' | head -60

stamp "apa check: the built-in dump and generated problems, kernel vs emulator, every schedule"
# The same command anyone who edits cuda/ runs (apa_emu/study/check.py); a divergence prints its
# stage, warp, tile and field and leaves a reproducer in $APA_GPU_REPRO_DIR.
CHECK_N=$([ "$QUICK" = 1 ] && echo 8 || echo 24)
CHECK_DUMP=() CHECK_WARPS=0:16  # the built-in SmolLM2 dump; the simulator runs every warp of a dump: a small one
if [ "$APA_GPU_BACKEND" = sim ]; then
  CHECK_DUMP=("$OUTDIR/check_small.apadump") CHECK_WARPS=0:3
  "$PY" -m apa_emu.study.cli synth "${CHECK_DUMP[0]}" --n 48 --kv 320 --heads 6 --kv-heads 2 --d 64 >/dev/null
fi
{
  "$PY" -m apa_emu.study.cli check "${CHECK_DUMP[@]}" --warps "$CHECK_WARPS" --workers "$(nproc)"
  c1=$?
  "$PY" -m apa_emu.study.cli check --hypothesis "$CHECK_N" --seed 0
  c2=$?
  [ "$c1" = 0 ] && [ "$c2" = 0 ]
} 2>&1 | tee "$OUTDIR/check.txt"
check_rc=${PIPESTATUS[0]}

stamp "pytest -m gpu (examples/property=$APA_GPU_EXAMPLES, MMA tiles=$APA_GPU_MMA_TILES)"
"$PY" -m pytest -q -m gpu -p no:cacheprovider --junitxml="$OUTDIR/gpu_tests.xml" -rfE \
  ${KSEL:+-k "$KSEL"} $GPU_TESTS \
  2>&1 | tee "$OUTDIR/pytest.txt" | tail -60
rc=${PIPESTATUS[0]}
[ "$check_rc" = 0 ] || rc=1

stamp "summary"
"$PY" - "$OUTDIR" <<'EOF'
import sys, pathlib, xml.etree.ElementTree as ET
out = pathlib.Path(sys.argv[1])
try:
    root = ET.parse(out / "gpu_tests.xml").getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    a = suite.attrib
    print(f"tests {a.get('tests')}  failures {a.get('failures')}  errors {a.get('errors')}  "
          f"skipped {a.get('skipped')}  time {float(a.get('time', 0)):.0f}s")
    for case in suite.iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            msg = (bad.attrib.get("message") or "").splitlines()
            print(f"  FAIL {case.attrib.get('name')}: {msg[0][:300] if msg else ''}")
except Exception as e:
    print("no junit report:", e)
repro = sorted((out / "repro").glob("*.npz")) if (out / "repro").exists() else []
print(f"reproducers: {len(repro)}" + "".join(f"\n  python -m apa_gpu.replay {p}" for p in repro[-5:]))
EOF
exit "$rc"
