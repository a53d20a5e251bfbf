"""The scan of the seed's paper on real dumps, and what every study builds on: pairs selected from
dumps, run on an engine and compared with float64 attention, and the per-pair diagnosis. Computation
only, in typed results; each study's own computation and presentation sit in its command
(``commands``), which imports this and is never imported by it."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cached_property

import numpy as np

from ..result import Result
from ..config import Config
from ..geometry import ROWS, TILE, Shape, warp_of
from ..metrics import Summary, cosine_histogram
from ..trace import overflow_stage
from .dump import Dump
from .engine import Engine, Unit, run_units, select_engine
from .fp64 import PairSums, cos_rel

NONFINITE_SHOWN = 5  # non-finite pairs, and pairs whose certificate fails, named in a scan's report
GOOD_COS = 0.999  # the tables count the pairs below this cosine
WORST = 20  # how many of the worst pairs a ranking without the reference should find (a target of docs/accuracy.md)
OVER = 30  # an estimate this many times the error is too loose to rank by

@dataclass
class Pairs:
    """A set of (query row, head) pairs of one unbatched dump."""

    rows: np.ndarray
    heads: np.ndarray

    @classmethod
    def select(cls, n: int, H: int, rows=None, heads=None, names=("--rows", "--heads")) -> "Pairs":
        """Every (row, head) of the given query rows and heads (all when None); ``names`` are the
        options named in errors."""
        rows = np.arange(n) if rows is None else np.asarray(rows)
        heads = np.arange(H) if heads is None else np.asarray(heads)
        for name, what, index, size in ((names[0], "query rows", rows, n), (names[1], "heads", heads, H)):
            if not index.size:
                raise ValueError(f"{name} selects no {what}")
            if index.min() < 0 or index.max() >= size:
                raise ValueError(f"{name}: {what} must lie in 0..{size - 1}")
        r, h = np.meshgrid(rows, heads, indexing="ij")
        return cls(r.ravel(), h.ravel())

    def take(self, index) -> "Pairs":
        return Pairs(self.rows[index], self.heads[index])

    def __len__(self) -> int:
        return self.rows.size


@dataclass
class Job:
    """A study's pairs of one dump; ``name`` labels its table rows."""

    dump: Dump
    pairs: Pairs
    name: str = "dump"

    @classmethod
    def of(cls, dump: Dump, pairs: Pairs | None = None, name: str | None = None) -> "Job":
        pairs = pairs if pairs is not None else Pairs.select(dump.n, dump.nh)
        return cls(dump, pairs, name or (dump.path.name if dump.path else "dump"))

    def units(self, index: int) -> list[Unit]:
        """The job's pairs by KV head, with the warps holding them (numerics.md §6.1–6.2)."""
        G = self.dump.group
        hk_of = self.pairs.heads // G
        units = []
        for hk in np.unique(hk_of).tolist():
            idx = np.flatnonzero(hk_of == hk)
            rows, heads = self.pairs.rows[idx], self.pairs.heads[idx] - hk * G
            units.append(Unit(index, hk, idx, rows, heads, np.unique((rows * G + heads) // ROWS)))
        return units


@dataclass
class Scan:
    """The selected pairs of one run against float64 attention. A pair whose output holds NaN or Inf
    (an FP16 stage overflowed, numerics.md §8) has NaN cosine and relative L2; ``summary`` and the
    histogram's cosine bins cover the finite pairs only (``summary`` is None when there is none).
    The hot share counts the warps that hold the selected pairs. ``bound`` is the engine's
    certificate of each pair (numerics.md §9.7), ``certificate`` how it fares against ``error``;
    ``est`` its estimate (§9.8), ``estimate`` the same for it."""

    config: Config
    pairs: Pairs
    out: np.ndarray  # [pairs, d] FP16
    bound: np.ndarray  # [pairs] binary32 err_bound, an upper bound of ‖out − exact‖₂
    est: np.ndarray  # [pairs] binary32 err_est, an estimate of it (NaN: the engine gives none)
    sums: PairSums
    finite: np.ndarray  # [pairs] bool: the output is finite
    hot_tiles: int
    active_tiles: int
    engine: str
    result: Result | None = None  # the dump's whole output (NaN outside the pairs), hot masks, traces
    split: tuple | None = None  # per pair: |hot part| and |cold part| of the float64 output, cold mass

    def __post_init__(self):
        self.cos, self.rel = cos_rel(self.sums)
        # A non-finite output has no cosine (the formula would call a NaN output's cosine 0): NaN marks it.
        self.cos[~self.finite] = np.nan
        self.rel[~self.finite] = np.nan

    @property
    def hot_share(self) -> float:
        return self.hot_tiles / self.active_tiles if self.active_tiles else 0.0

    @property
    def ref_norm(self) -> np.ndarray:
        return np.sqrt(self.sums.ref_sq)

    @property
    def error(self) -> np.ndarray:
        """‖out − ref‖₂ of each pair against the float64 reference: what ``bound`` bounds."""
        return np.sqrt(self.sums.diff_sq)

    @cached_property
    def certificate(self) -> dict:
        """The certificate over the finite pairs: ``coverage``, the share whose bound is at least the
        measured error, must be 1 (a violation is a bug of the bound or of the engine; ``violations``
        counts them and ``first_violations`` names some); ``infinite`` counts the pairs it gives up on
        (§9.7 step 11); tightness is bound/error (least and median, over pairs with an error) and
        bound/‖ref‖ (median). No slack for the float64 reference's own rounding: the bound's FP16
        rounding term alone is some 2⁻¹¹ of the output, far above it."""
        f = self.finite
        bound, err, ref = self.bound[f].astype(np.float64), self.error[f], self.ref_norm[f]
        held = bound >= err  # a NaN bound holds nothing
        missed = np.flatnonzero(f)[~held]
        over_err, over_ref = bound[err > 0] / err[err > 0], bound[ref > 0] / ref[ref > 0]
        return dict(coverage=_stat(np.mean, held), violations=int(missed.size),
                    first_violations=self._pair_list(missed[:NONFINITE_SHOWN]),
                    infinite=int(np.isinf(bound).sum()), bound_over_err_min=_stat(np.min, over_err),
                    bound_over_err_median=_stat(np.median, over_err), bound_over_ref_median=_stat(np.median, over_ref),
                    worst20_found=self.found("bound"))

    @cached_property
    def estimate(self) -> dict:
        """The estimate over the finite pairs: ``coverage``, the share whose estimate is at least the
        measured error (§9.8 claims about 0.999, not 1: ``under`` counts the rest), how tight it is
        (est/error median and largest, pairs over 30×, est/‖ref‖ median), and how many of the true worst
        pairs its ranking finds (``worst20_found``). None when the engine gives no estimate."""
        f = self.finite & ~np.isnan(self.est)
        if not f.any():
            return None
        est, err, ref = self.est[f].astype(np.float64), self.error[f], self.ref_norm[f]
        over_err, over_ref = est[err > 0] / err[err > 0], est[ref > 0] / ref[ref > 0]
        return dict(coverage=_stat(np.mean, est >= err), under=int((est < err).sum()),
                    est_over_err_median=_stat(np.median, over_err), est_over_err_max=_stat(np.max, over_err),
                    over_30=int((over_err > OVER).sum()), est_over_ref_median=_stat(np.median, over_ref),
                    worst20_found=self.found("est"))

    def rank_key(self, by: str) -> np.ndarray:
        """A key per pair, lowest for the worst. ``cos``: the cosine against the float64 reference;
        ``est`` or ``bound``: without it, minus err_est or err_bound over ‖out‖, the relative error they
        predict. Non-finite outputs come first, pairs with no estimate last."""
        if by == "cos":
            return np.where(self.finite, self.cos, -np.inf)
        rel = self.predicted(by)
        return np.where(self.finite, np.where(np.isnan(rel), np.inf, -rel), -np.inf)

    def predicted(self, by: str) -> np.ndarray:
        """err_est (``est``) or err_bound (``bound``) over ‖out‖ per pair: the relative error it predicts."""
        score = {"est": self.est, "bound": self.bound}[by].astype(np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            return score / np.sqrt(self.sums.out_sq)

    def rank(self, by: str) -> np.ndarray:
        """Pair indices, worst first by ``rank_key``."""
        return np.argsort(self.rank_key(by), kind="stable")

    def found(self, by: str, n: int = WORST) -> int:
        """How many of the n worst pairs by cosine are among the n worst by ``by`` ("est" or "bound")."""
        return len(set(self.order()[:n].tolist()) & set(self.rank(by)[:n].tolist()))

    @cached_property
    def summary(self) -> Summary | None:
        f = self.finite
        if not f.any():
            return None
        s, cos, rel = self.sums.take(f), self.cos[f], self.rel[f]
        with np.errstate(invalid="ignore", divide="ignore"):  # all-zero outputs: a NaN cosine, as per pair
            pooled = float(s.dot.sum() / np.sqrt(s.out_sq.sum() * s.ref_sq.sum()))
        return Summary(pairs=int(f.sum()), pooled_cos=pooled,
                       mean_cos=float(cos.mean()), min_cos=float(cos.min()), below_0_9=int((cos < 0.9).sum()),
                       below_0_99=int((cos < 0.99).sum()), below_0=int((cos < 0).sum()),
                       rel_l2_mean=float(rel.mean()), rel_l2_p99=float(np.quantile(rel, 0.99)),
                       rel_l2_max=float(rel.max()), hot_share=self.hot_share)

    @cached_property
    def histogram(self) -> list:
        return cosine_histogram(self.cos[self.finite]) + [("non-finite", int((~self.finite).sum()))]

    def errors(self) -> dict:
        """The largest absolute error and, when split, where the float64 output's mass and norm sit."""
        f = self.finite
        out = dict(max_abs_err=float(self.sums.max_abs[f].max()) if f.any() else np.nan)
        if self.split is not None:
            _, cold, mass = self.split
            with np.errstate(invalid="ignore", divide="ignore"):
                cold_rel = cold / self.ref_norm
            out.update(cold_mass_f64_mean=float(mass.mean()), cold_mass_f64_max=float(mass.max()),
                       cold_out_rel_max=float(np.nanmax(cold_rel)) if np.isfinite(cold_rel).any() else np.nan)
        return out

    def order(self) -> np.ndarray:
        """Pair indices, worst first: non-finite pairs, then by cosine."""
        return self.rank("cos")

    def _pair_list(self, index) -> list[tuple[int, int]]:
        return list(zip(self.pairs.rows[index].tolist(), self.pairs.heads[index].tolist()))

    def nonfinite_pairs(self) -> list[tuple[int, int]]:
        return self._pair_list(~self.finite)

    def to_json(self) -> dict:
        bad = self.nonfinite_pairs()
        return dict(pairs=len(self.pairs), summary=None if self.summary is None else self.summary.as_dict(),
                    errors=self.errors(), certificate=self.certificate, estimate=self.estimate,
                    nonfinite=dict(count=len(bad), first=bad[:NONFINITE_SHOWN]), histogram=self.histogram)

    @classmethod
    def pooled(cls, scans: list["Scan"]) -> "Scan":
        """The pairs of several scans (of one config) as one: the pooled row of a multi-dump table."""
        cat = lambda xs: np.concatenate(list(xs))  # noqa: E731
        split = None if any(s.split is None for s in scans) else tuple(cat(p) for p in zip(*(s.split for s in scans)))
        return cls(scans[0].config, Pairs(cat(s.pairs.rows for s in scans), cat(s.pairs.heads for s in scans)),
                   cat(s.out for s in scans), cat(s.bound for s in scans), cat(s.est for s in scans),
                   PairSums.concat([s.sums for s in scans]),
                   cat(s.finite for s in scans), sum(s.hot_tiles for s in scans), sum(s.active_tiles for s in scans),
                   scans[0].engine, split=split)


def _stat(fn, x) -> float:
    return float(fn(x)) if x.size else np.nan


def evaluate(jobs: list[Job], configs, engine: Engine, *, split=False, trace=False, progress=None,
             where=None) -> list[list[Scan]]:
    """Each job's pairs under each config ([job][config]), one unit (dump, KV head) at a time, in this
    process or ``where`` (a cluster's Runner: engine.run_units). The pairs of a unit that failed twice
    on a cluster are left out of its job's scans."""
    units = [u for j, job in enumerate(jobs) for u in job.units(j)]
    runs = run_units(engine, {j: job.dump for j, job in enumerate(jobs)}, units, configs, split=split, trace=trace,
                     progress=progress, where=where)
    scans = []
    for j, job in enumerate(jobs):
        job, parts = _ran(job, [(u, r) for u, r in zip(units, runs) if u.dump == j])
        scans.append([_assemble(job, cfg, [(u, r[c]) for u, r in parts], engine.name) for c, cfg in enumerate(configs)])
    return scans


def _ran(job: Job, parts) -> tuple[Job, list]:
    """The job and its units' runs without the units that have none, their pairs taken out."""
    lost = [u.index for u, r in parts if r is None]
    if not lost:
        return job, parts
    keep = np.setdiff1d(np.arange(len(job.pairs)), np.concatenate(lost))
    return (Job(job.dump, job.pairs.take(keep), job.name),
            [(u._replace(index=np.searchsorted(keep, u.index)), r) for u, r in parts if r is not None])


def _assemble(job: Job, cfg: Config, parts, engine: str) -> Scan:
    """One job's Scan from its units' runs, and the Result of the whole dump they make."""
    dump, P = job.dump, len(job.pairs)
    shape = Shape(B=1, n=dump.n, H=dump.nh, Hkv=dump.nkv, S=dump.kv, d=dump.hd, q_offset=dump.q_offset)
    out = np.empty((P, dump.hd), np.float16)
    bound, est = np.empty(P, np.float32), np.empty(P, np.float32)
    sums = PairSums(*(np.empty(P) for _ in PairSums._fields))
    split = (np.empty(P), np.empty(P), np.empty(P)) if parts and parts[0][1].split is not None else None
    hot = np.zeros((1, shape.Hkv, shape.nw, shape.W), np.uint32)
    hot_tiles = active = 0
    for unit, run in parts:
        out[unit.index] = run.out
        bound[unit.index] = run.bound
        est[unit.index] = run.est
        for dst, src in zip(sums + (split or ()), run.sums + (run.split or ())):
            dst[unit.index] = src
        hot[0, unit.hk] = run.hot
        hot_tiles += int(np.unpackbits(run.hot.view(np.uint8)).sum())
        active += int((shape.last_tiles(unit.warps) + 1).sum())
    full = np.full((dump.n, dump.nh, dump.hd), np.nan, np.float16)
    full[job.pairs.rows, job.pairs.heads] = out
    full_bound, full_est = np.full((2, dump.n, dump.nh), np.nan, np.float32)
    full_bound[job.pairs.rows, job.pairs.heads] = bound
    full_est[job.pairs.rows, job.pairs.heads] = est
    traces = [np.concatenate(x) if x else None for x in ([r.visits for _, r in parts if r.visits is not None],
                                                        [r.rows for _, r in parts if r.rows is not None])]
    result = Result(out=full, err_bound=full_bound, err_est=full_est, hot=hot, active_tiles=active, hot_tiles=hot_tiles, config=cfg,
                    visits=traces[0], rows=traces[1],
                    meta=dict(G=shape.G, R=shape.R, nw=shape.nw, ntiles=shape.ntiles, engine=engine))
    return Scan(cfg, job.pairs, out, bound, est, sums, np.isfinite(out).all(axis=1), hot_tiles, active, engine, result,
                split)


def run_pairs(dump, cfg: Config, pairs: Pairs, *, backend="auto", workers=1, progress=None, trace=False) -> Scan:
    """Run the warps holding ``pairs`` on the chosen engine ("auto", "cpu", "gpu" or an Engine) and
    compare those pairs with float64 attention, split into the parts of their hot and cold tiles."""
    engine = select_engine(backend, [cfg], [dump.hd], workers=workers)
    return evaluate([Job.of(dump, pairs)], [cfg], engine, split=True, trace=trace, progress=progress)[0][0]


def tile_breakdown(dump, row: int, head: int, scale: float):
    """Float64 probabilities of one pair and their per-tile mass and P·V contribution."""
    G = dump.q.shape[1] // dump.k.shape[1]
    hk = head // G
    lim = min(dump.q_offset + row, dump.k.shape[0] - 1)
    q = dump.q[row, head].astype(np.float64)
    k = dump.k[: lim + 1, hk].astype(np.float64)
    v = dump.v[: lim + 1, hk].astype(np.float64)
    s = (k @ q) * float(scale)  # ok: float64 oracle
    p = np.exp(s - s.max())
    p /= p.sum()
    ntiles = lim // TILE + 1
    idx = np.arange(lim + 1) // TILE
    mass = np.bincount(idx, weights=p, minlength=ntiles)
    contrib = np.zeros((ntiles, v.shape[1]))
    np.add.at(contrib, idx, p[:, None] * v)
    return p, mass, contrib


def pair_hot(dump, res: Result, row: int, head: int) -> np.ndarray:
    """The hot vote of the pair's warp on each tile the pair sees (bool [tiles])."""
    G = dump.q.shape[1] // dump.k.shape[1]
    hk, warp = warp_of(row, head, G)
    words = res.hot[0, hk, warp]
    t = np.arange(min(dump.q_offset + row, dump.k.shape[0] - 1) // TILE + 1)
    return ((words[t // 32] >> (t % 32).astype(np.uint32)) & 1).astype(bool)


@dataclass(frozen=True)
class PairDiagnostics:
    """The seed's per-pair diagnosis: hot tiles, cold mass (FP4 estimate and float64), the cold part
    of the reference output relative to its norm."""

    row: int
    head: int
    cos: float
    rel_l2: float
    hot_tiles: int
    tiles: int
    cold_mass_fp4: float
    cold_mass_f64: float
    cold_out_rel: float
    overflow: str | None  # the first stage whose trace fields are not finite (None: none overflowed)
    max_qk: float  # FP16 headroom estimates, see fp16_headroom
    max_o16: float

    def to_json(self) -> dict:
        return asdict(self)


def cos_stats(cos: np.ndarray) -> dict:
    """Pairs, mean and min cosine and pairs below 0.999 over the finite pairs (NaN cosine: the output
    is not finite, counted apart)."""
    f = ~np.isnan(cos)
    c = cos[f]
    return dict(pairs=int(cos.size), mean_cos=float(c.mean()) if c.size else np.nan,
                min_cos=float(c.min()) if c.size else np.nan, below_0_999=int((c < GOOD_COS).sum()),
                nonfinite=int((~f).sum()))


F16_MAX = 65504.0


def fp16_headroom(dump, row: int, head: int, hot: np.ndarray, scale: float) -> tuple[float, float]:
    """Float64 estimates of the largest magnitudes that pass 2's FP16 accumulators reach for one pair,
    to set against the FP16 maximum 65504:

    * max |q·k|: the partial sums of the score chain after each 16-channel step (§8.1);
    * max |O|: the running output after each 16-key step of the hot tiles, ascending, in the running
      max frame of §8.2 (exact arithmetic, before the FP16 rounding of §8.5).
    """
    G = dump.q.shape[1] // dump.k.shape[1]
    lim = min(dump.q_offset + row, dump.k.shape[0] - 1)
    q = dump.q[row, head].astype(np.float64)
    k = dump.k[: lim + 1, head // G].astype(np.float64)
    v = dump.v[: lim + 1, head // G].astype(np.float64)
    steps = np.cumsum((k * q).reshape(lim + 1, -1, 16).sum(axis=2), axis=1)
    s = steps[:, -1] * float(scale)
    m, o, max_o = -np.inf, np.zeros(q.size), 0.0
    for t in np.nonzero(hot)[0]:
        keys = slice(t * TILE, min((t + 1) * TILE, lim + 1))
        mx = max(m, s[keys].max())
        o *= np.exp(m - mx)
        pv = np.exp(s[keys] - mx)[:, None] * v[keys]
        running = o + np.cumsum(np.add.reduceat(pv, np.arange(0, pv.shape[0], 16)), axis=0)
        max_o = max(max_o, float(np.abs(running).max()))
        o, m = running[-1], mx
    return float(np.abs(steps).max()), max_o


def pair_diagnostics(dump, scan: Scan, i: int, traced: Result) -> PairDiagnostics:
    row, head = int(scan.pairs.rows[i]), int(scan.pairs.heads[i])
    G = dump.group
    hk = head // G
    p, mass, contrib = tile_breakdown(dump, row, head, scan.config.softmax_scale(dump.hd))
    hot = pair_hot(dump, traced, row, head)
    packed = row * G + head % G
    rec = traced.rows[(traced.rows["hk"] == hk) & (traced.rows["row"] == packed)][0]
    m1, l1, m2, l2 = (float(rec[f]) for f in ("m1", "l1", "m2", "l2"))
    big = max(m1, m2)
    cold_fp4 = l1 * 2.0 ** (m1 - big) if l1 > 0 else 0.0
    hot_fp4 = l2 * 2.0 ** (m2 - big) if l2 > 0 else 0.0
    ref_norm = float(scan.ref_norm[i])
    max_qk, max_o16 = fp16_headroom(dump, row, head, hot, scan.config.softmax_scale(dump.hd))
    return PairDiagnostics(
        row=row, head=head, cos=float(scan.cos[i]), rel_l2=float(scan.rel[i]),
        hot_tiles=int(hot.sum()), tiles=int(mass.size),
        cold_mass_fp4=cold_fp4 / (cold_fp4 + hot_fp4) if cold_fp4 + hot_fp4 > 0 else 0.0,
        cold_mass_f64=float(mass[~hot].sum()),
        cold_out_rel=float(np.linalg.norm(contrib[~hot].sum(axis=0)) / ref_norm) if ref_norm > 0 else float("inf"),
        overflow=overflow_stage(rec), max_qk=max_qk, max_o16=max_o16,
    )


def engine_for(jobs: list[Job], configs, backend, workers) -> Engine:
    """The engine ``backend`` names, for the jobs' head dims: the one-dump functions of the studies
    (``worst``, ``sweep``, ...) choose theirs with it."""
    return select_engine(backend, configs, [job.dump.hd for job in jobs], workers=workers)


def scan_jobs(jobs: list[Job], cfg: Config, engine: Engine, *, progress=None, where=None) -> list[Scan]:
    """Every job's pairs under ``cfg``, split into hot and cold parts (pool them with Scan.pooled); the
    units run ``where`` (evaluate)."""
    return [s for (s,) in evaluate(jobs, [cfg], engine, split=True, progress=progress, where=where)]


def check_count(n: int) -> None:
    if n < 1:
        raise ValueError(f"n = {n}: the number of worst pairs must be at least 1")
