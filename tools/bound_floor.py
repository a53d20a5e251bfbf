"""The floor of a per-key error bound (issue 32 item 2): how tight a guaranteed ``err_bound`` that bounds
each key's weight error and adds them up could be, and how far §9.7's is from it.

With aⱼ APA's normalised weight of key j (what its value is multiplied by in the output), pⱼ the exact
softmax weight and O the exact output, out − O = Σⱼ (aⱼ − pⱼ)(vⱼ − O) + Σⱼ aⱼ(uⱼ − vⱼ) + roundings. A bound
that holds for every sign of the keys' errors, bounding each key's weight error by some bⱼ ≥ |aⱼ − pⱼ| and
adding them (the triangle inequality over keys, as §9.7 does), is at least

    F = Σⱼ |aⱼ − pⱼ| · ‖vⱼ − O‖,

whatever it knows about the keys: F is what it would give knowing every weight error exactly. The tool
measures aⱼ by probing: it runs the call again with V replaced by one-hot columns (key c·d + i carries
1.0 in channel i, exact in FP16 and NVFP4), so that channel i of the output is a of that key, rounded to
FP16. The mass hot test does not read V, so the probes' hot tiles are the real call's (checked: their
hot masks are compared). The probe's rounding, at most 2⁻¹¹·aⱼ + 2⁻²⁵ per key, is taken off each key's
term, so F stays a floor. Float64 throughout (the softmax, O, F): a measurement, not a bit-exact path.
The ratios are over the pairs whose F, error and ‖O‖ are all positive (``pairs`` counts them).

    python tools/bound_floor.py                                       # the built-in dump, on the emulator
    python tools/bound_floor.py DUMP... --backend gpu --json          # on the kernel
    python tools/bound_floor.py DUMP --rows 1792:2048 --backend gpu   # the last 256 query rows
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from apa_emu import Config  # noqa: E402
from apa_emu import attention as emulate  # noqa: E402
from apa_emu.geometry import ROWS, TILE, warp_of  # noqa: E402
from apa_emu.study.dump import DumpError, builtin_dump_path, read_dump  # noqa: E402

ELEMENTS = 1 << 26  # (rows x heads x keys) per block of the float64 work
QUANTILES = (0.5, 0.99, 1.0)


class _Backend:
    """The call and its one-hot probes on the emulator (NumPy) or the kernel (CuPy: K and the probes'
    V stay on the device)."""

    def __init__(self, name: str, q, k, off: int, cfg: Config, workers: int = 1):
        self.off, self.cfg = off, cfg
        if name == "cpu":
            self.xp, self.q, self.k = np, q, k
            self.run = lambda q, k, v, off, cfg: emulate(q, k, v, off, cfg, workers=workers)
        else:
            import cupy
            from apa_gpu import attention

            self.xp, self.q, self.k, self.run = cupy, cupy.asarray(q), cupy.asarray(k), attention

    def __call__(self, v):
        return self.run(self.q, self.k, v, self.off, self.cfg)

    def one_hot(self, c: int, S: int, Hkv: int, d: int):
        """V of probe c: key c·d + i carries 1.0 in channel i."""
        v = self.xp.zeros((S, Hkv, d), np.float16)
        keys = self.xp.arange(c * d, min(S, (c + 1) * d))
        v[keys, :, keys - c * d] = 1
        return v


def probe_weights(backend: _Backend, v, progress=None):
    """The call's Result and a [n, H, S] float16: each pair's normalised weight of each key, as the call
    weighs it, rounded to FP16."""
    S, Hkv, d = v.shape
    res = backend(v)
    n, H, _ = res.out.shape
    weights = np.zeros((n, H, S), np.float16)
    probes = -(-S // d)
    for c in range(probes):
        probe = backend(backend.one_hot(c, S, Hkv, d))
        if not np.array_equal(np.asarray(probe.hot), np.asarray(res.hot)):
            raise SystemExit(f"bound_floor: probe {c} has other hot tiles than the call: its hot test reads V")
        weights[:, :, c * d:(c + 1) * d] = np.asarray(probe.out)[:, :, :min(d, S - c * d)]
        if progress:
            progress(c + 1, probes)
    return res, weights


def _hot_keys(res, rows: np.ndarray, H: int, G: int, S: int) -> np.ndarray:
    """bool [rows, H, S]: the key's tile is hot for the pair's warp."""
    hk, warp = warp_of(rows[:, None], np.arange(H)[None, :], G)
    words = np.asarray(res.hot)[0, hk, warp]  # [rows, H, words]
    t = np.arange(S) // TILE
    return ((words[..., t // 32] >> (t % 32).astype(np.uint32)) & 1).astype(bool)


def floor_terms(q, k, v, off: int, res, weights, cfg: Config) -> dict[str, np.ndarray]:
    """Per pair [n, H], float64: the floor F, its cold keys' part, the error ‖out − O‖, ‖O‖, err_bound."""
    n, H, d = q.shape
    S, Hkv, _ = k.shape
    G = H // Hkv
    scale = float(cfg.softmax_scale(d))
    k64 = np.repeat(k.astype(np.float64), G, axis=1).transpose(1, 0, 2)  # [H, S, d]
    v64 = np.repeat(v.astype(np.float64), G, axis=1).transpose(1, 0, 2)
    v2 = np.einsum("hsd,hsd->hs", v64, v64)
    out = np.asarray(res.out, np.float64)
    terms = {name: np.zeros((n, H)) for name in ("floor", "floor_cold", "err", "ref")}
    block = max(1, ELEMENTS // (H * S))
    for r0 in range(0, n, block):
        rows = np.arange(r0, min(n, r0 + block))
        masked = np.arange(S)[None, None, :] > (off + rows)[:, None, None]
        s = np.matmul(q[rows].astype(np.float64).transpose(1, 0, 2), k64.transpose(0, 2, 1)).transpose(1, 0, 2)
        s = np.where(masked, -np.inf, s * scale)
        p = np.exp(s - s.max(axis=2, keepdims=True))
        p /= p.sum(axis=2, keepdims=True)
        O = np.matmul(p.transpose(1, 0, 2), v64).transpose(1, 0, 2)  # [rows, H, d]
        vo = np.matmul(O.transpose(1, 0, 2), v64.transpose(0, 2, 1)).transpose(1, 0, 2)  # [rows, H, S]
        dist = np.sqrt(np.maximum(v2[None] - 2 * vo + np.einsum("nhd,nhd->nh", O, O)[..., None], 0))
        a = weights[rows].astype(np.float64)
        term = np.where(masked, 0, np.maximum(np.abs(a - p) - (a * 2.0**-11 + 2.0**-25), 0) * dist)
        terms["floor"][rows] = term.sum(axis=2)
        terms["floor_cold"][rows] = np.where(_hot_keys(res, rows, H, G, S), 0, term).sum(axis=2)
        terms["err"][rows] = np.linalg.norm(out[rows] - O, axis=2)
        terms["ref"][rows] = np.linalg.norm(O, axis=2)
    terms["bound"] = np.asarray(res.err_bound, np.float64)
    return terms


def report(name: str, res, t: dict[str, np.ndarray]) -> dict:
    ok = (t["ref"] > 0) & (t["err"] > 0) & (t["floor"] > 0)

    def qs(x):
        return [float(y) for y in np.quantile(x[ok], QUANTILES)]

    return dict(dump=name, pairs=int(ok.sum()), hot_share=round(res.hot_share, 4),
                floor_over_ref=qs(t["floor"] / t["ref"]), floor_over_err=qs(t["floor"] / t["err"]),
                cold_part_of_floor=float(np.median((t["floor_cold"] / t["floor"])[ok])),
                bound_over_ref=qs(t["bound"] / t["ref"]), bound_over_floor=qs(t["bound"] / t["floor"]),
                floor_within_0_1_ref=float(np.mean((t["floor"] / t["ref"])[ok] <= 0.1)))


def _rows(text: str | None, n: int) -> slice:
    if text is None:
        return slice(0, n)
    a, _, b = text.partition(":")
    r0, r1 = int(a or 0), int(b or n)
    if not 0 <= r0 < r1 <= n or r0 % ROWS:
        raise SystemExit(f"bound_floor: --rows {text}: expected A:B within 0..{n}, A a multiple of {ROWS} "
                         "(whole warps: the rows' hot votes are then the whole call's)")
    return slice(r0, r1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dumps", nargs="*", default=[str(builtin_dump_path())])
    ap.add_argument("--backend", default="cpu", choices=["cpu", "gpu"])
    ap.add_argument("--eps", type=float, default=Config().eps)
    ap.add_argument("--rows", help="A:B, query rows of each dump (A a multiple of 16; default all)")
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                    help="the emulator's processes (--backend cpu; default: one per CPU)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.workers < 1:
        raise SystemExit(f"bound_floor: --workers {args.workers}: expected a positive integer")
    try:
        cfg = Config(eps=args.eps)
    except ValueError as e:
        raise SystemExit(f"bound_floor: {e}") from None
    reports = []
    for path in args.dumps:
        try:
            dump = read_dump(path)
        except DumpError as e:
            raise SystemExit(f"bound_floor: {e}") from None
        rows = _rows(args.rows, dump.q.shape[0])
        q, k, v = np.asarray(dump.q[rows]), np.asarray(dump.k), np.asarray(dump.v)
        off = dump.q_offset + rows.start
        t0 = time.perf_counter()

        def progress(done, total, name=Path(path).name):
            print(f"\r{name}: probe {done}/{total}, {time.perf_counter() - t0:.0f} s", end="", file=sys.stderr,
                  flush=True)

        res, weights = probe_weights(_Backend(args.backend, q, k, off, cfg, args.workers), v, progress)
        print(file=sys.stderr)
        reports.append(dict(report(Path(path).name, res, floor_terms(q, k, v, off, res, weights, cfg)),
                            rows=f"{rows.start}:{rows.stop}", seconds=round(time.perf_counter() - t0, 1)))
    if args.json:
        print(json.dumps(reports, indent=1))
        return
    print("| dump | rows | pairs | hot share | floor / ‖ref‖: median, p99, max | floor / err: median, p99, max "
          "| cold keys' part of the floor (median) | err_bound / ‖ref‖ (median) | err_bound / floor (median) |")
    print("|---|---|---:|---:|---|---|---:|---:|---:|")
    for r in reports:
        f = lambda xs: " / ".join(f"{x:.3g}" for x in xs)  # noqa: E731
        print(f"| {r['dump']} | {r['rows']} | {r['pairs']} | {r['hot_share']:.3f} | {f(r['floor_over_ref'])} "
              f"| {f(r['floor_over_err'])} | {r['cold_part_of_floor']:.3f} | {r['bound_over_ref'][0]:.3g} "
              f"| {r['bound_over_floor'][0]:.3g} |")


if __name__ == "__main__":
    main()
