"""Planted bugs in a copy of SageAttention's Triton source, each of which ``apa check --engine sageattention``
must catch bitwise against the recipe (numerics.md §14), with where it first shows.

For each mutant: copy the installed ``sageattention`` package to a temporary folder, apply one exact text
replacement (its ``old`` text must occur once), put that copy first on PYTHONPATH, and run the check
(``--hypothesis N --seed S``, or the dumps given) in a fresh process, so that Triton compiles the
changed kernel. The unchanged copy runs first and must pass. Prints, per mutant, CAUGHT with the
localisation line (the first differing (row, head) and its tile), or MISSED.

    APA_ENGINES=sageattention=apa_gpu.sageattention:SageEngine PYTHONPATH=$PWD \
        python tools/sage_mutants.py --hypothesis 200 --seed 1 [ID ...] [--dump FILE ...]

Exit status 0 when the baseline passes and every mutant run is caught.

Unfusing §14.6's mask from its fma is not among them: it is an equivalent mutant. On an unmasked score
fma(k_scale, s, 0) is k_scale ⊗ s, and a masked one (−10⁶) gives ex2 = 0 fused or not, so no output bit
can change; the H100 run that tried it found none in 100 problems.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
QUANT = "quant_per_block.py"
ATTN = "attn_qk_int8_per_block_causal.py"


class Mutant(NamedTuple):
    id: str
    file: str
    old: str
    new: str
    what: str


MUTANTS = (
    Mutant("quant-trunc", QUANT, "x_int8 += 0.5 * tl.where(x_int8 >= 0, 1, -1)",
           "x_int8 += 0.0 * tl.where(x_int8 >= 0, 1, -1)", "INT8 codes truncated: no +-0.5 before cvt.rzi (§14.3)"),
    Mutant("p-rtz", ATTN, "p = p.to(tl.float16)", 'p = p.to(tl.float16, fp_downcast_rounding="rtz")',
           "P to FP16 by truncation instead of cvt.rn (§14.8)"),
    Mutant("out-rtz", ATTN, "acc.to(Out.type.element_ty)",
           'acc.to(Out.type.element_ty, fp_downcast_rounding="rtz")',
           "the output to FP16 by truncation instead of cvt.rn (§14.9)"),
    Mutant("alpha-twice", ATTN, "acc = acc * alpha[:, None]", "acc = acc * alpha[:, None] * alpha[:, None]",
           "the rescale alpha applied twice to acc (§14.8)"),
    Mutant("pv-f32", ATTN, "acc += tl.dot(p, v, out_dtype=tl.float16)", "acc = tl.dot(p, v, acc)",
           "P.V accumulated in binary32 into acc: another reduction order and precision (§14.8)"),
    Mutant("lsum-rounded-p", ATTN,
           "l_ij = tl.sum(p, 1)", "l_ij = tl.sum(p.to(tl.float16).to(tl.float32), 1)",
           "the row sum of the FP16-rounded p instead of the binary32 p (§14.7)"),
    Mutant("skip-tile", ATTN, "lo, hi = 0, start_m * BLOCK_M", "lo, hi = BLOCK_N, start_m * BLOCK_M",
           "one 64-key block fewer left of the diagonal (§14.5)"),
    Mutant("scale-assoc", ATTN, "tl.dot(q, k).to(tl.float32) * q_scale * k_scale",
           "tl.dot(q, k).to(tl.float32) * (q_scale * k_scale)",
           "the two block scales multiplied first: s rounded once from another product (§14.4-§14.6)"),
)


def installed() -> Path:
    """The installed sageattention package's folder (it is never changed)."""
    spec = importlib.util.find_spec("sageattention")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("sage_mutants: sageattention is not installed (pip install -e '.[sage]')")
    return Path(next(iter(spec.submodule_search_locations)))


def planted(source: Path, where: Path, mutant: Mutant | None) -> Path:
    """A copy of the package under ``where`` with ``mutant`` applied (none: unchanged)."""
    copy = where / "sageattention"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("__pycache__"))
    if mutant is not None:
        path = copy / mutant.file
        text = path.read_text()
        if text.count(mutant.old) != 1:
            sys.exit(f"sage_mutants: {mutant.id}: {mutant.old!r} occurs {text.count(mutant.old)} times in {mutant.file}")
        path.write_text(text.replace(mutant.old, mutant.new))
    return where


def run_check(where: Path, args) -> tuple[int, str]:
    """``apa check --engine sageattention`` with the copy at ``where`` first on the path."""
    command = [sys.executable, "-m", "apa_emu.study.cli", "check", "--engine", "sageattention"]
    command += ["--hypothesis", str(args.hypothesis), "--seed", str(args.seed)] if not args.dump else args.dump
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(where), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("APA_ENGINES", "sageattention=apa_gpu.sageattention:SageEngine")
    env["TRITON_CACHE_DIR"] = str(where / "triton-cache")  # each copy compiles its own kernels
    r = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    return r.returncode, r.stdout + r.stderr


def where_line(output: str) -> str:
    lines = output.splitlines()
    first = next((i for i, line in enumerate(lines) if "first differing (row, head)" in line), None)
    if first is None:
        return (lines or ["(no output)"])[-1]
    return " | ".join(line.strip() for line in lines[first:first + 2])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ids", nargs="*", help="mutants to run (default: all): " + ", ".join(m.id for m in MUTANTS))
    p.add_argument("--hypothesis", type=int, default=100, help="generated problems per run")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dump", nargs="+", help="check these dumps instead of generated problems")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    args = p.parse_args(argv)
    unknown = set(args.ids) - {m.id for m in MUTANTS}
    if unknown:
        p.error(f"unknown mutants {sorted(unknown)}")
    source, failed = installed(), 0
    for mutant in [None, *(m for m in MUTANTS if not args.ids or m.id in args.ids)]:
        with tempfile.TemporaryDirectory(prefix="sage-mutant-") as tmp:
            rc, output = run_check(planted(source, Path(tmp), mutant), args)
        if mutant is None:
            print(f"baseline (unchanged copy): {'PASS' if rc == 0 else f'FAIL (exit {rc})'}: {where_line(output)}")
            failed += rc != 0
            continue
        verdict = "CAUGHT" if rc == 1 else "MISSED" if rc == 0 else f"ERROR (exit {rc})"
        print(f"{mutant.id} ({mutant.what}): {verdict}: {where_line(output)}", flush=True)
        failed += rc != 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
