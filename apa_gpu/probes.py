"""Single-instruction and single-primitive kernels of cuda/probe.cu, run on the selected backend for
the tests (tests/kernel/test_gpu_mma.py, tests/kernel/test_gpu_formats.py, tests/kernel/test_gpu_budget.py)."""

from __future__ import annotations

import numpy as np

from . import device
from .build import PROBE
from .params import DECLARED, F32

# cuda/probe.cu's structs, each read from its field list there (params.py), and the entry point each takes.
MMA_F32, MMA_F16 = DECLARED["ProbeMmaF32Params"], DECLARED["ProbeMmaF16Params"]
WGMMA, WGMMA_F16 = DECLARED["ProbeWgmmaParams"], DECLARED["ProbeWgmmaF16Params"]
EXP2, CODES, QUANT16 = DECLARED["ProbeExp2Params"], DECLARED["ProbeCodesParams"], DECLARED["ProbeQuant16Params"]
TABLES, PSCALE, MERGE = DECLARED["ProbeTablesParams"], DECLARED["ProbePscaleParams"], DECLARED["ProbeMergeParams"]
VOTE, BETA = DECLARED["ProbeBudgetVoteParams"], DECLARED["ProbeBudgetBetaParams"]
KERNELS = {"apa_probe_mma_f32": MMA_F32, "apa_probe_mma_f16": MMA_F16, "apa_probe_wgmma": WGMMA,
           "apa_probe_wgmma_f16": WGMMA_F16, "apa_probe_exp2": EXP2, "apa_probe_codes": CODES,
           "apa_probe_quant16": QUANT16, "apa_probe_tables": TABLES, "apa_probe_pscale": PSCALE,
           "apa_probe_merge": MERGE, "apa_probe_budget_vote": VOTE, "apa_probe_budget_beta": BETA}


def _run(name: str, blocks: int, threads: int, params: dict) -> None:
    device.launch(device.kernel(PROBE, name, KERNELS[name]), (max(1, blocks),), threads, params)


def _f32(x):
    return device.backend().xp.asarray(np.ascontiguousarray(x, dtype=F32))


def run_probe_mma(A, B, C, f16_out: bool):
    """m16n8k16 on the GPU for tiles A [T,16,16], B [T,8,16] (binary16 bits or float16), C [T,16,8]
    (float32, or float16 when f16_out). Returns D like C."""
    xp = device.backend().xp
    Ad = xp.asarray(np.ascontiguousarray(A).view(np.uint16))
    Bd = xp.asarray(np.ascontiguousarray(B).view(np.uint16))
    Cd = xp.asarray(np.ascontiguousarray(C).view(np.uint16)) if f16_out else _f32(C)
    D = xp.empty(Cd.shape, Cd.dtype)
    T = Ad.shape[0]
    _run("apa_probe_mma_f16" if f16_out else "apa_probe_mma_f32", -(-T // 4), 128, dict(A=Ad, B=Bd, C=Cd, D=D, ntiles=T))
    d = xp.asnumpy(D)
    return d.view(np.float16) if f16_out else d


def run_probe_wgmma(A, B):
    """wgmma m64n64k16 on the GPU for tiles A [T,64,16], B [T,64,16] (B[n][k]; binary16 bits or
    float16): (D from scale-d = 0, D from C = +0), each [T,64,64] float32."""
    xp = device.backend().xp
    Ad = xp.asarray(np.ascontiguousarray(A).view(np.uint16))
    Bd = xp.asarray(np.ascontiguousarray(B).view(np.uint16))
    T = Ad.shape[0]
    D0, D1 = xp.empty((T, 64, 64), np.float32), xp.empty((T, 64, 64), np.float32)
    _run("apa_probe_wgmma", T, 128, dict(A=Ad, B=Bd, D0=D0, D1=D1))
    return xp.asnumpy(D0), xp.asnumpy(D1)


def run_probe_wgmma_f16(A, B, C):
    """wgmma m64n64k16 with FP16 accumulation, A from registers, on the GPU for tiles A [T,64,16],
    B [T,64,16] (B[n][k]) and C [T,64,64] (binary16 bits or float16): D like C, float16."""
    xp = device.backend().xp
    Ad, Bd, Cd = (xp.asarray(np.ascontiguousarray(x).view(np.uint16)) for x in (A, B, C))
    D = xp.empty(Cd.shape, np.uint16)
    _run("apa_probe_wgmma_f16", Ad.shape[0], 128, dict(A=Ad, B=Bd, C=Cd, D=D))
    return xp.asnumpy(D).view(np.float16)


def run_probe_exp2(x, variant: str = "soft"):
    """exp2 of every element: "soft" (exp2s), "fast" (the hardware exp2), or the exp2s variants
    "core" (x in [0, 1)) and "nonpos" (x ≤ 0) of cuda/fpmath.cuh."""
    xp = device.backend().xp
    xd = _f32(x)
    y = xp.empty(xd.shape, np.float32)
    mode = ("soft", "fast", "core", "nonpos").index(variant)
    _run("apa_probe_exp2", -(-xd.size // 256), 256, dict(x=xd, y=y, count=xd.size, mode=mode))
    return xp.asnumpy(y)


def run_probe_codes(x):
    """(E2M1 values as binary32, E4M3 codes) of binary32 values."""
    xp = device.backend().xp
    xd = _f32(x)
    n = xd.size
    a, b = xp.empty(n, np.float32), xp.empty(n, np.uint8)
    _run("apa_probe_codes", -(-n // 256), 256, dict(x=xd, e2m1=a, e4m3=b, count=n))
    return xp.asnumpy(a).reshape(np.shape(x)), xp.asnumpy(b).reshape(np.shape(x))


def run_probe_quant16(x, lsq: bool = True):
    """quant16 of x [nblocks, 16]: (the represented values e2m1(code)·dec(sb) [nblocks, 16] as binary32,
    sb [nblocks])."""
    xp = device.backend().xp
    xd = _f32(x)
    nb = xd.shape[0]
    q, sb = xp.empty((nb, 16), np.float32), xp.empty(nb, np.uint8)
    _run("apa_probe_quant16", -(-nb // 128), 128, dict(x=xd, q=q, sb=sb, nblocks=nb, lsq=lsq))
    return xp.asnumpy(q), xp.asnumpy(sb)


def run_probe_tables():
    """(LG2 [9], UE4M3 dec [127]) as the kernel holds them."""
    xp = device.backend().xp
    lg2, dec = xp.empty(9, np.float32), xp.empty(127, np.float32)
    _run("apa_probe_tables", 1, 128, dict(lg2=lg2, dec=dec))
    return xp.asnumpy(lg2), xp.asnumpy(dec)


def run_probe_pscale(gm, cq, c, A, L, pow2: bool, fma: bool):
    """§7.4 of each (gm, c_q, c): (dec(kb), bias, a_g) as pass 1's p1_pscale computes them."""
    xp = device.backend().xp
    gd, qd, cd = (_f32(np.ravel(x)) for x in (gm, cq, c))
    n = gd.size
    scale, bias, mass = (xp.empty(n, np.float32) for _ in range(3))
    # two items a thread, as the lane's two rows
    _run("apa_probe_pscale", -(-n // 256), 128, dict(gm=gd, cq=qd, c=cd, scale=scale, bias=bias, mass=mass, count=n,
                                                     A=A, L=L, pow2=pow2, fma=fma))
    return tuple(xp.asnumpy(x) for x in (scale, bias, mass))


def run_probe_merge(m1, l1, part, m2, l2, o2, fma: bool):
    """§9.1–9.4 of rows m1, l1, m2, l2 [R] with part, o2 [R, 2]: the FP16 output [R, 2]."""
    xp = device.backend().xp
    rows = [_f32(x) for x in (m1, l1, part, m2, l2, o2)]
    n = rows[0].size
    out = xp.empty(n, np.uint32)
    _run("apa_probe_merge", -(-n // 128), 128, dict(zip(("m1", "l1", "part", "m2", "l2", "o2"), rows), out=out,
                                                    count=n, fma=fma))
    return xp.asnumpy(out).view(np.float16).reshape(n, 2)


def run_probe_budget_vote(m, la, ws, c, tl, t2, beta):
    """§7.7's budget vote of each row alone (state m, la, ws; visit c, tl, t2; βr): bool [R], hot."""
    xp = device.backend().xp
    cols = [_f32(np.ravel(x)) for x in (m, la, ws, c, tl, t2, beta)]
    n = cols[0].size
    hot = xp.zeros(n, np.uint8)
    _run("apa_probe_budget_vote", -(-n // 4), 128, dict(zip(("m", "la", "ws", "c", "tl", "t2", "beta"), cols),
                                                         hot=hot, count=n))
    return xp.asnumpy(hot).astype(bool)


def run_probe_budget_beta(eps, cq, qstat, kvstat, rho):
    """§7.7's βr of rows c_q [R], qstat [R, 3] against one head's kvstat [9] (binary32): float32 [R]."""
    xp = device.backend().xp
    n = np.size(cq)
    beta = xp.empty(n, np.float32)
    kv = xp.asarray(np.ascontiguousarray(kvstat, dtype=F32).view(np.uint32))
    _run("apa_probe_budget_beta", -(-n // 256), 128, dict(cq=_f32(np.ravel(cq)), qstat=_f32(qstat), kvstat=kv,
                                                         beta=beta, count=n, eps=eps, rho=rho))
    return xp.asnumpy(beta)
