"""Refit §9.8's constants of ``err_est`` on your dumps: which powers of two on its terms make the estimate
cover the error on 99.9 % of the pairs with a median estimate/error of at most 3? Per (row, head) pair, the
estimate's variance is a sum of terms, each a model of one error source (docs/numerics.md §9.8):

    (err_est / Z)² = Vc/Dn² + Vh/Dn² + F2,   Vc = w1²·ws1·((s1 + ρ)·X + evm²),
                                             Vh = w2²·(P2·(ls²·C_S + C_P)·X + nh·C_A·Q2).

The tool runs every pair of each dump traced, takes the terms from the pair's row record (§10) and its
prep (§5) in float64, checks that they give the engine's err_est back (to binary32 rounding), measures
each pair's error against float64 attention, and then searches powers of two that multiply the terms,
in four groups:

    score1  the cold keys' score error (s1: Q and K quantization)
    cold    the rest of the cold side: E2M1 rounding of P̂ (ρ) and V quantization (evm²)
    score2  the hot keys' FP16 score chain and P16 (C_S, C_P)
    acc2    pass 2's FP16 accumulation of O (C_A)

F2, the final rounding's actual error, is not scaled. A multiplier set is feasible when err_est covers
the error on at least ``--coverage`` of every dump's pairs; among those, the tool ranks by the largest
of the dumps' median estimate/error (the target: ≤ 3), and checks each dump held out: fitted on the
others, how does it fare? Float64 throughout: a measurement, not a bit-exact path.

    python tools/est_fit.py                                        # the built-in dump, on the emulator
    python tools/est_fit.py DUMP... --backend gpu --json fit.json  # on the kernel
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np

from apa_emu import Config
from apa_emu.geometry import ROWS
from apa_emu.merge import LN2, merge_weights, merge_y, ssq4
from apa_emu.prep import prepare
from apa_emu.study.dump import DumpError, builtin_dump_path, read_dump
from apa_emu.study.scan import Pairs, run_pairs

GROUPS = ("score1", "cold", "score2", "acc2")
EXPONENTS = tuple(range(-3, 4))  # multipliers 2^-3 .. 2^3 per group


def pair_terms(dump, scan, cfg: Config) -> dict:
    """Per pair of ``scan`` (every pair of the dump, traced): the variance terms of §9.8 divided by Dn²,
    as float64 arrays [pairs] keyed by group (and "f2"), the engine's err_est, and the error."""
    res, G, d = scan.result, dump.group, dump.hd
    prep = prepare(np.asarray(dump.q), np.asarray(dump.k), np.asarray(dump.v), dump.q_offset, cfg)
    k = cfg.est_consts(d)
    rec = res.rows
    hk, r = rec["hk"].astype(np.int64), rec["row"].astype(np.int64)
    hot_tiles = np.unpackbits(res.hot[0].view(np.uint8), axis=-1).sum(axis=-1)  # [Hkv, warps]: §9.8's nh
    nh = hot_tiles[hk, r // ROWS]
    f32 = {f: np.asarray(rec[f], np.float32) for f in ("m1", "l1", "ws1", "m2", "l2", "p2")}
    o2, part, out = (np.asarray(rec[f], np.float32) for f in ("o2", "part", "out"))
    cq, sh = prep.cq[hk, r], prep.sh[hk, r]
    qn, eq = prep.qstat[hk, r, 0], prep.qstat[hk, r, 1]
    km, ekm, vm, evm = (prep.kvstat[hk, i].astype(np.float64) for i in range(5, 9))
    soft = cfg.exp2 == "soft"
    _, w1, w2, dn = (np.asarray(x, np.float64) for x in merge_weights(f32["m1"], f32["l1"], f32["m2"], f32["l2"], soft))
    cl = cq.astype(np.float64) * float(LN2)
    s1 = ((eq * km) ** 2 + (qn * ekm) ** 2) * cl ** 2 * (2.0 / d)
    x = vm * vm
    sc = np.where(f32["l2"] > 0, np.abs(f32["m2"].astype(np.float64) + sh), 0.0)
    ls = float(LN2) * sc
    den = dn * dn
    c1 = w1 * w1 * f32["ws1"] / den
    h2 = w2 * w2 / den
    y = merge_y(f32["m1"], f32["l1"], part, f32["m2"], f32["l2"], o2, soft, cfg.fma)
    if cfg.pass2_flags().direct:  # §9.5: a warp with no hot tile stores f16(part)
        y = np.where((nh == 0)[:, None], part, y)
    terms = dict(
        score1=c1 * s1 * x,
        cold=c1 * (float(k.rho) * x + evm * evm),
        score2=h2 * f32["p2"] * (ls * ls * float(k.cs) + float(k.cp)) * x,
        acc2=h2 * nh * float(k.ca) * ssq4(o2).astype(np.float64),
        f2=ssq4(out.astype(np.float32) - y).astype(np.float64),
    )
    # the records' pairs in the scan's order: packed row r of KV head hk is query r // G, head hk·G + r % G
    index = {(int(i), int(h)): j for j, (i, h) in enumerate(zip(scan.pairs.rows, scan.pairs.heads))}
    order = np.array([index.get((int(ri) // G, int(h) * G + int(ri) % G), -1) for h, ri in zip(hk, r)])
    keep = (order >= 0) & scan.finite[np.maximum(order, 0)] & (den > 0)
    at = order[keep]
    return dict(terms={g: t[keep] for g, t in terms.items()}, z=float(k.z),
                est=np.asarray(rec["err_est"], np.float64)[keep], error=scan.error[at].astype(np.float64))


def estimate(terms: dict, z: float, mult: dict) -> np.ndarray:
    return z * np.sqrt(sum(mult.get(g, 1.0) * terms[g] for g in (*GROUPS, "f2")))


def judge(data: dict, z: float, mult: dict) -> dict:
    """Coverage and median estimate/error of one dump's pairs under the multipliers."""
    est, err = estimate(data["terms"], z, mult), data["error"]
    pos = err > 0
    return dict(coverage=float(np.mean(est >= err)), median=float(np.median(est[pos] / err[pos])),
                over30=int(np.sum(est[pos] / err[pos] > 30)))


def search(dumps: dict, coverage: float) -> list[dict]:
    """Every multiplier set of the grid, each with its per-dump judgement, the feasible ones first by
    their largest median, then the rest by their least coverage."""
    z = next(iter(dumps.values()))["z"]
    out = []
    for exps in itertools.product(EXPONENTS, repeat=len(GROUPS)):
        mult = {g: 2.0 ** e for g, e in zip(GROUPS, exps)}
        per = {name: judge(d, z, mult) for name, d in dumps.items()}
        out.append(dict(exponents=dict(zip(GROUPS, exps)), dumps=per,
                        feasible=all(p["coverage"] >= coverage for p in per.values()),
                        worst_median=max(p["median"] for p in per.values()),
                        least_coverage=min(p["coverage"] for p in per.values())))
    out.sort(key=lambda s: (not s["feasible"], s["worst_median"] if s["feasible"] else -s["least_coverage"]))
    return out


def held_out(dumps: dict, coverage: float) -> dict:
    """Each dump judged under the best multipliers fitted on the others (None with one dump)."""
    if len(dumps) < 2:
        return {}
    z = next(iter(dumps.values()))["z"]
    out = {}
    for name in dumps:
        best = search({n: d for n, d in dumps.items() if n != name}, coverage)[0]
        mult = {g: 2.0 ** e for g, e in best["exponents"].items()}
        out[name] = dict(exponents=best["exponents"], **judge(dumps[name], z, mult))
    return out


def iter_dumps(ap: argparse.ArgumentParser, paths, rows: str | None):
    """Each dump of ``paths`` (the built-in one when empty) with its query rows from ``--rows a:b``
    (None: all), as (path, dump, rows); a dump that cannot be read or a bad range ends in ``ap.error``."""
    for path in paths or [builtin_dump_path()]:
        try:
            dump = read_dump(path)
        except (DumpError, OSError) as e:
            ap.error(f"{path}: {e}")
        sel = None
        if rows:
            try:
                a, b = (int(x) for x in rows.split(":"))
            except ValueError:
                ap.error(f"--rows {rows}: give a:b, two integers")
            sel = np.arange(max(a, 0), min(b, dump.n))
        yield Path(path), dump, sel


def parse_args(argv) -> tuple[argparse.ArgumentParser, argparse.Namespace, list[tuple[int, ...]]]:
    """The parser, its arguments checked, and the ``--try`` multiplier sets as tuples of exponents."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dumps", nargs="*", type=Path, help="dump files (default: the built-in dump)")
    ap.add_argument("--backend", default="cpu", choices=("cpu", "gpu"))
    ap.add_argument("--eps", type=float, default=0.005)
    ap.add_argument("--coverage", type=float, default=0.999)
    ap.add_argument("--rows", help="query rows a:b of each dump (default: all)")
    ap.add_argument("--workers", type=int, default=1, help="emulator processes")
    ap.add_argument("--try", dest="tries", action="append", default=[], metavar="E,E,E,E",
                    help="also show this multiplier set (log2 per group, in the order above); repeatable")
    ap.add_argument("--json", type=Path, help="write the results here (a new file)")
    args = ap.parse_args(argv)
    if args.json is not None and args.json.exists():
        ap.error(f"--json {args.json}: exists; not overwritten")
    if not 0 < args.coverage <= 1:
        ap.error("--coverage must lie in (0, 1]")
    try:
        tries = [tuple(int(e) for e in t.split(",")) for t in args.tries]
    except ValueError:
        ap.error("--try takes integers separated by commas")
    if any(len(t) != len(GROUPS) for t in tries):
        ap.error(f"--try takes {len(GROUPS)} exponents: {', '.join(GROUPS)}")
    return ap, args, tries


def measure(ap: argparse.ArgumentParser, args, cfg: Config) -> dict:
    """Each dump's pair_terms by its file name, checked to give the engine's err_est back; the time
    each took on stderr."""
    dumps = {}
    for path, dump, rows in iter_dumps(ap, args.dumps, args.rows):
        t = time.time()
        scan = run_pairs(dump, cfg, Pairs.select(dump.n, dump.nh, rows), backend=args.backend,
                         workers=args.workers, trace=True)
        data = pair_terms(dump, scan, cfg)
        rel = np.abs(estimate(data["terms"], data["z"], {}) / data["est"] - 1)
        if not np.all(rel[np.isfinite(rel)] < 1e-5):
            raise SystemExit(f"est_fit: {path.name}: the terms do not give the engine's err_est back "
                             f"(largest relative difference {np.nanmax(rel):.2e})")
        dumps[path.name] = data
        print(f"{path.name}: {data['error'].size} pairs, {time.time() - t:.0f} s", file=sys.stderr)
    return dumps


def report(args, names, now: dict, asked: list[dict], best: list[dict], ho: dict) -> list[str]:
    """The markdown: the present constants, the asked and the best multiplier sets per dump, and each
    dump held out."""
    lines = [f"eps = {args.eps}; coverage asked: {args.coverage}; multipliers 2^{EXPONENTS[0]}..2^{EXPONENTS[-1]}"
             f" on {', '.join(GROUPS)}", "",
             "| multipliers (log2: " + ", ".join(GROUPS) + ") | " + " | ".join(names) + " |",
             "|---|" + "---|" * len(names)]
    rows = [("now", now)] + [("asked", s) for s in asked] + [(f"best {i + 1}", s) for i, s in enumerate(best)]
    for label, s in rows:
        exps = ", ".join(str(e) for e in s["exponents"].values())
        cells = " | ".join(f"{p['coverage']:.4f}, {p['median']:.2f}, {p['over30']}" for p in s["dumps"].values())
        lines.append(f"| {label}: {exps} | {cells} |")
    if not best:
        lines.append(f"| (no multiplier set covers {args.coverage} of every dump's pairs) | |")
    lines += ["", "(each cell: coverage, median estimate/error, pairs over 30x)"]
    if ho:
        lines += ["", "| held out | fitted multipliers (log2) | coverage | median | over 30x |", "|---|---|---:|---:|---:|"]
        lines += [f"| {n} | {', '.join(str(e) for e in h['exponents'].values())} | {h['coverage']:.4f} | "
                  f"{h['median']:.2f} | {h['over30']} |" for n, h in ho.items()]
    return lines


def main(argv=None) -> int:
    ap, args, tries = parse_args(argv)
    dumps = measure(ap, args, Config(eps=args.eps))
    ranked = search(dumps, args.coverage)
    now = next(s for s in ranked if all(e == 0 for e in s["exponents"].values()))
    asked = [next(s for s in ranked if tuple(s["exponents"].values()) == t) for t in tries]
    best = [s for s in ranked if s["feasible"]][:5]
    ho = held_out(dumps, args.coverage)
    print("\n".join(report(args, list(dumps), now, asked, best, ho)))
    if args.json is not None:
        args.json.write_text(json.dumps(dict(eps=args.eps, coverage=args.coverage, now=now, asked=asked, best=best,
                                             held_out=ho), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
