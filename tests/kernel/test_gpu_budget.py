"""§7.7's budget hot test in the kernel on chosen operands, against the emulator: the row vote
((ws ⊗ a) ⊗ a) ⊕ t2 > βr ⊗ (L ⊗ L), L = (la ⊗ a) ⊕ tl (pass1.cuh p1_budget_vote), and βr = (ε ⊗ ε) ⊗ (X ⊘ κ)
(p1_budget_beta), through cuda/probe.cu.

Neither L nor βr is traced (§10), so on whole problems a last-bit change of either side shows only where a
row's two sides lie within an ulp, which the simulator cases never reach: an L fused into one rounding, a
≥ for the >, or βr as (ε² ⊗ X) ⊘ κ passed them (mutants K34, K35, K36 of tools/mutants.py). Here the
operands put the two sides at equality and one ulp apart. Marked ``gpu``: it runs on the device and, in
CI, on the CPU simulator (tests/kernel/test_gpu_sim.py runs this file there).
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers import budget_edge_rows, emulated_budget_vote

from apa_emu.merge import budget_beta

from apa_gpu.probes import run_probe_budget_beta, run_probe_budget_vote

pytestmark = pytest.mark.gpu
F32 = np.float32
D = 64  # cuda/probe.cu's head dim


def test_budget_vote_at_the_edge_matches_the_emulator():
    """Rows at equality must vote cold (the rule is a strict >), rows one ulp above hot, one ulp below
    cold, by hand from float32 NumPy; kernel and emulator agree on every row. Among them rows where
    a fused L would flip the verdict, and a row with no mass and no visible key (la = ws = tl = t2 = +0,
    c = m = −inf), whose 0 > βr ⊗ 0 is false: it never makes a tile hot."""
    ops, right, fused = budget_edge_rows(3000, 11)
    m, la, ws, c, tl, t2, beta = ops
    empty = (F32([-np.inf]), F32([0]), F32([0]), F32([-np.inf]), F32([0]), F32([0]), F32([0.25]))
    ops = tuple(np.concatenate([x, e]) for x, e in zip(ops, empty))
    want = np.concatenate([t2 > right, [False]])
    got = run_probe_budget_vote(*ops)
    assert np.array_equal(got, emulated_budget_vote(*ops))
    assert np.array_equal(got, want), np.flatnonzero(got != want)
    assert want[:-1].sum() == len(t2) // 3 and not want[-1]
    # the interesting case happened: rows whose verdict a fused L changes
    assert ((t2 > beta * (fused * fused)) != (t2 > right)).sum() > 10


def _spec_beta(eps, cq, qn, eq, kvstat, rho):
    """§9.8 steps 1–2 and §7.7's βr written out in float32 NumPy (one rounding an operation), with the
    association §7.7 names and the one that divides last."""
    km, ekm, vm, evm = kvstat[5:9]
    a1, b1, cl = eq * km, qn * ekm, cq * np.uint32(0x3F317218).view(F32)
    s1 = ((a1 * a1 + b1 * b1) * (cl * cl)) * F32(2.0 / D)
    x = vm * vm
    kappa = (s1 + rho) * x + evm * evm
    with np.errstate(divide="ignore", invalid="ignore"):
        ours, other = (eps * eps) * (x / kappa), ((eps * eps) * x) / kappa
    return np.where(kappa > 0, ours, F32(np.inf)), np.where(kappa > 0, other, F32(np.inf))


def test_budget_beta_matches_the_emulator():
    """βr of random rows (c_q, qn, eq) and head means at two ε and both ρ of §9.8, bitwise against
    apa_emu.merge.budget_beta and against the rule written out, with κ = +0 rows (βr = +inf); among them
    rows where (ε ⊗ ε) ⊗ (X ⊘ κ) and ((ε ⊗ ε) ⊗ X) ⊘ κ round apart, so the order of §7.7 decides bits."""
    rng = np.random.default_rng(3)
    n = 2000
    cq = rng.uniform(0.05, 3, n).astype(F32)
    qstat = np.stack([rng.uniform(0, 40, n), rng.uniform(0, 5, n), np.zeros(n)], axis=1).astype(F32)
    qstat[:8] = 0  # padding rows read +0
    kv = np.zeros(9, F32)
    kv[5:9] = (3.5, 0.6, 1.7, 0.2)
    split = 0
    with np.errstate(over="ignore"):
        for kvstat in (kv, np.zeros(9, F32)):
            for eps in (F32(0.005), F32(0.3)):
                for rho in (F32(2.0**-7), F32(2.0**-25)):
                    ours, other = _spec_beta(eps, cq, qstat[:, 0], qstat[:, 1], kvstat, rho)
                    want = budget_beta(eps, cq, qstat[:, 0], qstat[:, 1], kvstat, rho, D)
                    got = run_probe_budget_beta(eps, cq, qstat, kvstat, rho)
                    for x in (got, want):
                        assert np.array_equal(x.view(np.uint32), ours.astype(F32).view(np.uint32)), (eps, rho)
                    split += int((other != ours).sum())
    assert np.isinf(_spec_beta(F32(0.3), cq, qstat[:, 0], qstat[:, 1], np.zeros(9, F32), rho)[0]).all()
    assert split > 0, "no row where the association of βr decides a bit"
