"""The studies of the seed's paper on real dumps: scan, worst pairs, one pair, error attribution and
ε sweeps. Computation only, in typed results; ``report`` and ``plots`` present them."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cached_property

import numpy as np

from ..api import Result
from ..config import SEED_TOGGLES, Config
from ..geometry import ROWS, TILE, Shape, warp_of
from ..metrics import Summary, cosine_histogram
from .dump import Dump
from .engine import CpuEngine, Engine, Unit, run_units, select_engine
from .fp64 import PairSums, cos_rel

NONFINITE_SHOWN = 5  # non-finite pairs, and pairs whose certificate fails, named in a scan's report
GOOD_COS = 0.999  # the tables count the pairs below this cosine

_ALL_OFF = dict(quant_q=False, quant_k=False, quant_p=False, quant_v=False)

# apa attribute: the seed's error-source table. Each variant changes the config of the command
# (--config) as given: which pass-1 operands are quantized, or one numerics toggle with all quantized.
ATTRIBUTE_VARIANTS: dict[str, dict] = {
    "all (default)": {},
    "Q only (2 terms)": dict(_ALL_OFF, quant_q=True, q_terms=2),
    "K only": dict(_ALL_OFF, quant_k=True),
    "P only": dict(_ALL_OFF, quant_p=True),
    "V only": dict(_ALL_OFF, quant_v=True),
    "Q only (1 term)": dict(_ALL_OFF, quant_q=True, q_terms=1),
    "Q only (FP8 E4M3)": dict(_ALL_OFF, quant_q=True, q_format="fp8"),
    "none": _ALL_OFF,
    "all, δ = 0": dict(delta=0.0),
    "all, pow2 P scales": dict(p_scale="pow2"),
    "all, nearest block scale": dict(block_scale="nearest"),
    "all, ascending order": dict(tile_order="ascending"),
    "all, τ = 0": dict(tau=0),
    "all, interleaved P groups": dict(p_groups="interleaved"),
    "all, exact MMA": dict(mma="exact"),
    "all, sm120 MMA": dict(mma="sm120"),
}
CPU_WORST = 20  # pairs the variants the engine lacks rerun on the CPU emulator, lowest cosine first


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
    certificate of each pair (numerics.md §9.7), ``certificate`` how it fares against ``error``."""

    config: Config
    pairs: Pairs
    out: np.ndarray  # [pairs, d] FP16
    bound: np.ndarray  # [pairs] binary32 err_bound, an upper bound of ‖out − exact‖₂
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
        stat = lambda fn, x: float(fn(x)) if x.size else np.nan  # noqa: E731
        return dict(coverage=stat(np.mean, held), violations=int(missed.size),
                    first_violations=self._pair_list(missed[:NONFINITE_SHOWN]),
                    infinite=int(np.isinf(bound).sum()), bound_over_err_min=stat(np.min, over_err),
                    bound_over_err_median=stat(np.median, over_err), bound_over_ref_median=stat(np.median, over_ref))

    @cached_property
    def summary(self) -> Summary | None:
        f = self.finite
        if not f.any():
            return None
        s, cos, rel = self.sums.take(f), self.cos[f], self.rel[f]
        return Summary(pairs=int(f.sum()), pooled_cos=float(s.dot.sum() / np.sqrt(s.out_sq.sum() * s.ref_sq.sum())),
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
        return np.argsort(np.where(self.finite, self.cos, -np.inf), kind="stable")

    def _pair_list(self, index) -> list[tuple[int, int]]:
        return list(zip(self.pairs.rows[index].tolist(), self.pairs.heads[index].tolist()))

    def nonfinite_pairs(self) -> list[tuple[int, int]]:
        return self._pair_list(~self.finite)

    def to_json(self) -> dict:
        bad = self.nonfinite_pairs()
        return dict(pairs=len(self.pairs), summary=None if self.summary is None else self.summary.as_dict(),
                    errors=self.errors(), certificate=self.certificate,
                    nonfinite=dict(count=len(bad), first=bad[:NONFINITE_SHOWN]), histogram=self.histogram)

    @classmethod
    def pooled(cls, scans: list["Scan"]) -> "Scan":
        """The pairs of several scans (of one config) as one: the pooled row of a multi-dump table."""
        cat = lambda xs: np.concatenate(list(xs))  # noqa: E731
        split = None if any(s.split is None for s in scans) else tuple(cat(p) for p in zip(*(s.split for s in scans)))
        return cls(scans[0].config, Pairs(cat(s.pairs.rows for s in scans), cat(s.pairs.heads for s in scans)),
                   cat(s.out for s in scans), cat(s.bound for s in scans), PairSums.concat([s.sums for s in scans]),
                   cat(s.finite for s in scans), sum(s.hot_tiles for s in scans), sum(s.active_tiles for s in scans),
                   scans[0].engine, split=split)


def evaluate(jobs: list[Job], configs, engine: Engine, *, split=False, trace=False, progress=None) -> list[list[Scan]]:
    """Each job's pairs under each config ([job][config]), one unit (dump, KV head) at a time."""
    units = [u for j, job in enumerate(jobs) for u in job.units(j)]
    runs = run_units(engine, {j: job.dump for j, job in enumerate(jobs)}, units, configs, split=split, trace=trace,
                     progress=progress)
    return [[_assemble(job, cfg, [(u, r[c]) for u, r in zip(units, runs) if u.dump == j], engine.name)
             for c, cfg in enumerate(configs)] for j, job in enumerate(jobs)]


def _assemble(job: Job, cfg: Config, parts, engine: str) -> Scan:
    """One job's Scan from its units' runs, and the Result of the whole dump they make."""
    dump, P = job.dump, len(job.pairs)
    shape = Shape(B=1, n=dump.n, H=dump.nh, Hkv=dump.nkv, S=dump.kv, d=dump.hd, q_offset=dump.q_offset)
    out = np.empty((P, dump.hd), np.float16)
    bound = np.empty(P, np.float32)
    sums = PairSums(*(np.empty(P) for _ in PairSums._fields))
    split = (np.empty(P), np.empty(P), np.empty(P)) if parts and parts[0][1].split is not None else None
    hot = np.zeros((1, shape.Hkv, shape.nw, shape.W), np.uint32)
    hot_tiles = active = 0
    for unit, run in parts:
        out[unit.index] = run.out
        bound[unit.index] = run.bound
        for dst, src in zip(sums + (split or ()), run.sums + (run.split or ())):
            dst[unit.index] = src
        hot[0, unit.hk] = run.hot
        hot_tiles += int(np.unpackbits(run.hot.view(np.uint8)).sum())
        active += int((shape.last_tiles(unit.warps) + 1).sum())
    full = np.full((dump.n, dump.nh, dump.hd), np.nan, np.float16)
    full[job.pairs.rows, job.pairs.heads] = out
    full_bound = np.full((dump.n, dump.nh), np.nan, np.float32)
    full_bound[job.pairs.rows, job.pairs.heads] = bound
    traces = [np.concatenate(x) if x else None for x in ([r.visits for _, r in parts if r.visits is not None],
                                                        [r.rows for _, r in parts if r.rows is not None])]
    result = Result(out=full, err_bound=full_bound, hot=hot, active_tiles=active, hot_tiles=hot_tiles, config=cfg,
                    visits=traces[0], rows=traces[1],
                    meta=dict(G=shape.G, R=shape.R, nw=shape.nw, ntiles=shape.ntiles, engine=engine))
    return Scan(cfg, job.pairs, out, bound, sums, np.isfinite(out).all(axis=1), hot_tiles, active, engine, result,
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


@dataclass(frozen=True)
class Visit:
    """One pass-1 visit of the pair's warp, the pair's own lane of the trace record (§10)."""

    visit: int
    tile: int
    hot: bool
    c: float
    m: float
    tl: float
    la: float
    lc: float
    tv: float
    lv: float


@dataclass(frozen=True)
class PairReport:
    """Everything about one pair: diagnostics, per-tile mass and contribution, its warp's trace."""

    diag: PairDiagnostics
    top_tile: int
    top_tile_mass: float
    hot_mass: float
    hot_list: list[int]
    ref_norm: float
    hot_norm: float
    cold_norm: float
    out_norm: float
    mass: np.ndarray  # [tiles] float64 softmax mass per tile
    contrib_norm: np.ndarray  # [tiles] |Σ p·v| of each tile
    hot: np.ndarray  # [tiles] bool, the warp's hot vote
    visits: list[Visit]

    def to_json(self) -> dict:
        return dict(diag=self.diag.to_json(), hot_tiles=self.hot_list, top_tile=self.top_tile,
                    hot_mass=self.hot_mass, ref_norm=self.ref_norm, hot_norm=self.hot_norm,
                    cold_norm=self.cold_norm, out_norm=self.out_norm, tile_mass=self.mass.tolist(),
                    visits=[asdict(v) for v in self.visits])


def cos_stats(cos: np.ndarray) -> dict:
    """Pairs, mean and min cosine and pairs below 0.999 over the finite pairs (NaN cosine: the output
    is not finite, counted apart)."""
    f = ~np.isnan(cos)
    c = cos[f]
    return dict(pairs=int(cos.size), mean_cos=float(c.mean()) if c.size else np.nan,
                min_cos=float(c.min()) if c.size else np.nan, below_0_999=int((c < GOOD_COS).sum()),
                nonfinite=int((~f).sum()))


@dataclass(frozen=True)
class SweepRow:
    """One ε: its cost (hot share, pass-2 tiles: the tiles pass 2 recomputes) beside the accuracy."""

    eps: float
    hot_share: float
    pass2_tiles: int
    pairs: int
    pooled_cos: float
    mean_cos: float
    min_cos: float
    below_0_999: int
    below_0_9: int
    nonfinite: int  # pairs left out of the cosines: their output is not finite

    @classmethod
    def of(cls, scan: Scan) -> "SweepRow":
        s = scan.summary
        return cls(eps=scan.config.eps, hot_share=scan.hot_share, pass2_tiles=scan.hot_tiles,
                   pooled_cos=s.pooled_cos if s else np.nan, below_0_9=s.below_0_9 if s else 0, **cos_stats(scan.cos))

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class VariantScore:
    """Cosines of the attributed pairs under one variant (mean and min over the finite ones), and the
    engine that ran it; ``cos`` follows the table's pair order (worst first)."""

    engine: str
    pairs: int
    mean_cos: float
    min_cos: float
    below_0_999: int
    nonfinite: int
    cos: list[float]

    @classmethod
    def of(cls, engine: str, cos: np.ndarray) -> "VariantScore":
        return cls(engine=engine, cos=cos.tolist(), **cos_stats(cos))


@dataclass(frozen=True)
class Breakdown:
    """Where the error sits in one dump: cosine statistics by query head and by query-position bucket,
    and the min cosine of each (head, bucket) cell (NaN: no finite pair there)."""

    heads: list[tuple[int, dict]]
    buckets: list[tuple[str, dict]]
    min_cos: np.ndarray  # [heads, buckets]

    def to_json(self) -> dict:
        return dict(heads=[dict(head=h, **st) for h, st in self.heads],
                    buckets=[dict(positions=b, **st) for b, st in self.buckets], min_cos=self.min_cos.tolist())


def breakdown(scan: Scan, dump, buckets: int) -> Breakdown:
    """``scan``'s cosines by head and by ``buckets`` equal ranges of query rows (positions)."""
    edges = np.unique(np.linspace(0, dump.n, min(buckets, dump.n) + 1).round().astype(int))
    bucket = np.searchsorted(edges, scan.pairs.rows, side="right") - 1
    heads = np.unique(scan.pairs.heads).tolist()
    labels = [f"{dump.q_offset + a}-{dump.q_offset + b - 1}" for a, b in zip(edges[:-1], edges[1:])]
    grid = np.full((len(heads), len(labels)), np.nan)
    for i, h in enumerate(heads):
        for j in range(len(labels)):
            cos = scan.cos[(scan.pairs.heads == h) & (bucket == j)]
            if (~np.isnan(cos)).any():
                grid[i, j] = np.nanmin(cos)
    return Breakdown([(h, cos_stats(scan.cos[scan.pairs.heads == h])) for h in heads],
                     [(lab, cos_stats(scan.cos[bucket == j])) for j, lab in enumerate(labels)], grid)


@dataclass(frozen=True)
class AttributeTable:
    """One dump's attribution: the pairs, worst first under the command's config, each variant's
    cosines on them (the variants the engine lacks on the first ``cpu_worst`` only), the same variants
    applied to the seed's arithmetic (``seed``; empty when not asked) and the breakdown of the command's
    config over every selected pair."""

    pairs: Pairs
    variants: dict[str, VariantScore]
    breakdown: Breakdown
    seed: dict[str, VariantScore]

    def to_json(self) -> dict:
        return dict(pairs=list(zip(self.pairs.rows.tolist(), self.pairs.heads.tolist())),
                    variants={name: asdict(s) for name, s in self.variants.items()},
                    seed={name: asdict(s) for name, s in self.seed.items()},
                    breakdown=self.breakdown.to_json())


# The stages of a row in data-flow order with the trace fields each one writes (§7.10, §8.6, §9). A
# frame m = −inf is no overflow: it means the stage saw no tile.
_STAGES = (
    ("pass 1 (FP4 estimate of the cold tiles)", ("m1", "l1", "part")),
    ("pass 2 (FP16 scores q·k, row max and sum)", ("m2", "l2")),
    ("pass 2 (FP16 output accumulation P·V)", ("o2",)),
    ("the merge (FP16 output)", ("out",)),
)


def overflow_stage(rec) -> str | None:
    """Which stage of a traced row (a ``trace.row_dtype`` record) first went non-finite, and how."""
    for stage, fields in _STAGES:
        for name in fields:
            x = np.asarray(rec[name], dtype=np.float64)
            bad = np.isnan(x) | (x == np.inf) if name.startswith("m") else ~np.isfinite(x)
            if bad.any():
                return f"{stage} overflowed: {name} holds {'NaN' if np.isnan(x[bad]).any() else 'Inf'}"
    return None


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


def _engine(jobs: list[Job], configs, backend, workers) -> Engine:
    return select_engine(backend, configs, [job.dump.hd for job in jobs], workers=workers)


def scan_jobs(jobs: list[Job], cfg: Config, engine: Engine, *, progress=None) -> list[Scan]:
    """Every job's pairs under ``cfg``, split into hot and cold parts (pool them with Scan.pooled)."""
    return [s for (s,) in evaluate(jobs, [cfg], engine, split=True, progress=progress)]


def worst_jobs(jobs: list[Job], cfg: Config, n: int, engine: Engine, *,
               progress=None) -> tuple[list[Scan], list[tuple[int, PairDiagnostics]]]:
    """The ``n`` lowest-cosine pairs over all jobs (non-finite first), each with its job's index."""
    _check_count(n)
    scans = [s for (s,) in evaluate(jobs, [cfg], engine, progress=progress)]
    keys = np.concatenate([np.where(s.finite, s.cos, -np.inf) for s in scans])
    owner = np.concatenate([np.full(len(s.pairs), j) for j, s in enumerate(scans)])
    local = np.concatenate([np.arange(len(s.pairs)) for s in scans])
    chosen = np.argsort(keys, kind="stable")[:n]
    picked = {j: local[chosen[owner[chosen] == j]] for j in np.unique(owner[chosen]).tolist()}
    sub = [Job(jobs[j].dump, scans[j].pairs.take(idx), jobs[j].name) for j, idx in picked.items()]
    traced = dict(zip(picked, (s for (s,) in evaluate(sub, [cfg], engine, trace=True))))
    return scans, [(int(owner[c]), pair_diagnostics(jobs[owner[c]].dump, scans[owner[c]], int(local[c]),
                                                    traced[owner[c]].result)) for c in chosen]


def worst(dump, cfg: Config, n: int, *, pairs: Pairs | None = None, backend="auto", workers=1,
          progress=None) -> tuple[Scan, list[PairDiagnostics]]:
    jobs = [Job.of(dump, pairs)]
    scans, diags = worst_jobs(jobs, cfg, n, _engine(jobs, [cfg], backend, workers), progress=progress)
    return scans[0], [d for _, d in diags]


def pair(dump, cfg: Config, row: int, head: int, *, backend="auto", workers=1) -> PairReport:
    pairs = Pairs.select(dump.n, dump.nh, [row], [head], names=("--row", "--head"))
    scan = run_pairs(dump, cfg, pairs, backend=backend, workers=workers, trace=True)
    diag = pair_diagnostics(dump, scan, 0, scan.result)
    p, mass, contrib = tile_breakdown(dump, row, head, cfg.softmax_scale(dump.hd))
    hot = pair_hot(dump, scan.result, row, head)
    lane = (row * dump.group + head % dump.group) % ROWS
    hot_norm, cold_norm, _ = (float(x[0]) for x in scan.split)
    return PairReport(
        diag=diag,
        top_tile=int(np.argmax(mass)), top_tile_mass=float(mass.max()),
        hot_mass=float(mass[hot].sum()), hot_list=np.nonzero(hot)[0].tolist(),
        ref_norm=float(scan.ref_norm[0]), hot_norm=hot_norm, cold_norm=cold_norm,
        out_norm=float(np.linalg.norm(scan.out[0].astype(np.float64))),
        mass=mass, contrib_norm=np.linalg.norm(contrib, axis=1), hot=hot,
        visits=[Visit(visit=int(r["visit"]), tile=int(r["tile"]), hot=bool(r["hot"]),
                      **{f: float(r[f][lane]) for f in ("c", "m", "tl", "la", "lc", "tv", "lv")})
                for r in scan.result.visits],
    )


@dataclass(frozen=True)
class Attribution:
    """Attribution tables of several dumps and the variants' scores over all their pairs."""

    tables: list[AttributeTable]
    pooled: dict[str, VariantScore]
    pooled_seed: dict[str, VariantScore]
    seed_on_sm90: list[str]  # the variants whose seed column runs on the `sm90` model (see attribute_jobs)


def _variant_configs(cfg: Config, changes: dict, seed: bool) -> tuple[dict, list[str]]:
    """The config of each variant, keyed by its name, and under ``seed`` by ("seed", name) the variant on
    the seed's arithmetic (cfg with SEED_TOGGLES). The seed's FP4 MMA needs every operand quantized, so a
    variant that turns one off runs its seed twin on the `sm90` model: those names come second."""
    configs, on_sm90 = {}, []
    for name, change in changes.items():
        try:
            configs[name] = cfg.replace(**change)
        except ValueError:  # no such config: mma=sm120 under --config quant_p=off, say
            continue
        if seed:
            try:
                configs["seed", name] = cfg.replace(**{**SEED_TOGGLES, **change})
            except ValueError:
                configs["seed", name] = cfg.replace(**{**SEED_TOGGLES, **change, "mma": "sm90"})
                on_sm90.append(name)
    return configs, on_sm90


def _pooled(tables: list[AttributeTable], column: str) -> dict[str, VariantScore]:
    scores = [getattr(t, column) for t in tables]
    return {name: VariantScore.of(s.engine, np.concatenate([np.asarray(sc[name].cos) for sc in scores]))
            for name, s in scores[0].items()}


def attribute_jobs(jobs: list[Job], cfg: Config, engine: Engine, *, worst: int | None = None,
                   cpu_worst: int = CPU_WORST, variants=None, buckets: int = 8, workers: int = 1,
                   progress=None, seed: bool = True) -> Attribution:
    """Each variant of ``variants`` (default ATTRIBUTE_VARIANTS, applied to ``cfg``) on every selected
    pair of each job, or on its ``worst`` lowest-cosine pairs under ``cfg``; under ``seed`` each variant
    also on the seed's arithmetic (numerics.md §12). The variants ``engine`` lacks (the emulator's MMA
    models and the seed's toggles, for the kernel) run on the CPU over the first ``cpu_worst`` of those
    pairs (0: not at all). Equal configs run once."""
    for count in (worst, cpu_worst or None):
        if count is not None:
            _check_count(count)
    changes = variants or ATTRIBUTE_VARIANTS
    configs, on_sm90 = _variant_configs(cfg, changes, seed)
    own = {key: c for key, c in configs.items() if not any(engine.lacks(c, j.dump.hd) for j in jobs)}
    emulated = {key: c for key, c in configs.items() if key not in own and cpu_worst}
    own_cfgs = list(dict.fromkeys(own.values()))
    if worst is None and cfg in own_cfgs:  # every pair: the command's own config is one of the variants
        runs = evaluate(jobs, own_cfgs, engine, progress=progress)
        bases = [r[own_cfgs.index(cfg)] for r in runs]
        orders = [b.order() for b in bases]
        cos = [[s.cos[o] for s in r] for r, o in zip(runs, orders)]
    else:
        bases = [s for (s,) in evaluate(jobs, [cfg], engine, progress=progress)]
        orders = [b.order()[:worst] for b in bases]
        sub = [Job(j.dump, b.pairs.take(o), j.name) for j, b, o in zip(jobs, bases, orders)]
        cos = [[s.cos for s in r] for r in evaluate(sub, own_cfgs, engine, progress=progress)]
    chosen = [b.pairs.take(o) for b, o in zip(bases, orders)]
    scores = [{key: VariantScore.of(engine.name, per_job[own_cfgs.index(c)]) for key, c in own.items()}
              for per_job in cos]
    if emulated:
        cpu = CpuEngine(workers)
        few = [Job(j.dump, p.take(slice(0, cpu_worst)), j.name) for j, p in zip(jobs, chosen)]
        cpu_cfgs = list(dict.fromkeys(emulated.values()))
        for table, runs in zip(scores, evaluate(few, cpu_cfgs, cpu, progress=progress)):
            table.update({key: VariantScore.of(cpu.name, runs[cpu_cfgs.index(c)].cos) for key, c in emulated.items()})
    order = [name for name in changes if name in own or name in emulated]
    seeded = [name for name in changes if ("seed", name) in own or ("seed", name) in emulated]
    tables = [AttributeTable(p, {name: sc[name] for name in order}, breakdown(b, j.dump, buckets),
                             {name: sc["seed", name] for name in seeded})
              for j, p, b, sc in zip(jobs, chosen, bases, scores)]
    return Attribution(tables, _pooled(tables, "variants"), _pooled(tables, "seed"),
                       [name for name in on_sm90 if name in seeded])


def attribute(dump, cfg: Config, n: int | None = None, *, backend="auto", workers=1, progress=None,
              variants=None, cpu_worst: int = CPU_WORST, buckets: int = 8, seed: bool = True) -> AttributeTable:
    """Cosines of every pair (or the ``n`` worst under ``cfg``) when only the named operands are
    quantized or one toggle changes, on our arithmetic and (``seed``) on the seed's."""
    jobs = [Job.of(dump)]
    return attribute_jobs(jobs, cfg, _engine(jobs, [cfg], backend, workers), worst=n, cpu_worst=cpu_worst,
                          variants=variants, buckets=buckets, workers=workers, progress=progress,
                          seed=seed).tables[0]


def sweep_jobs(jobs: list[Job], cfg: Config, eps_list, engine: Engine, *,
               progress=None) -> tuple[list[list[SweepRow]], list[SweepRow]]:
    """One row per ε for each job, and the rows of all jobs' pairs pooled."""
    runs = evaluate(jobs, [cfg.replace(eps=float(e)) for e in eps_list], engine, progress=progress)
    return ([[SweepRow.of(s) for s in r] for r in runs],
            [SweepRow.of(Scan.pooled(list(per_eps))) for per_eps in zip(*runs)])


def sweep(dump, cfg: Config, eps_list, *, pairs: Pairs | None = None, backend="auto", workers=1,
          progress=None) -> list[SweepRow]:
    jobs = [Job.of(dump, pairs)]
    return sweep_jobs(jobs, cfg, eps_list, _engine(jobs, [cfg], backend, workers), progress=progress)[0][0]


F16_MAX = 65504.0


@dataclass(frozen=True)
class Headroom:
    """FP16 headroom of pass 2 over a set of pairs: the largest ``fp16_headroom`` estimates, the pairs
    that reach them, and how many pairs pass the FP16 maximum."""

    pairs: int
    max_qk: float
    max_qk_pair: tuple[int, int]
    qk_over: int
    max_o16: float
    max_o16_pair: tuple[int, int]
    o16_over: int
    nonfinite: int  # pairs whose emulated output is not finite

    def to_json(self) -> dict:
        return asdict(self)


def headroom_jobs(jobs: list[Job], cfg: Config, engine: Engine, *, progress=None) -> list[Headroom]:
    """How close each job's pairs bring pass 2's FP16 scores and output to overflow (numerics.md §8)."""
    out = []
    for job, (scan,) in zip(jobs, evaluate(jobs, [cfg], engine, progress=progress)):
        pairs, dump = job.pairs, job.dump
        est = np.array([fp16_headroom(dump, r, h, pair_hot(dump, scan.result, r, h), cfg.softmax_scale(dump.hd))
                        for r, h in zip(pairs.rows.tolist(), pairs.heads.tolist())])
        qk, o16 = int(np.argmax(est[:, 0])), int(np.argmax(est[:, 1]))
        at = lambda i: (int(pairs.rows[i]), int(pairs.heads[i]))  # noqa: E731
        out.append(Headroom(pairs=len(pairs), max_qk=float(est[qk, 0]), max_qk_pair=at(qk),
                            qk_over=int((est[:, 0] > F16_MAX).sum()), max_o16=float(est[o16, 1]),
                            max_o16_pair=at(o16), o16_over=int((est[:, 1] > F16_MAX).sum()),
                            nonfinite=int((~scan.finite).sum())))
    return out


def headroom(dump, cfg: Config, pairs: Pairs | None = None, *, backend="auto", workers=1, progress=None) -> Headroom:
    jobs = [Job.of(dump, pairs)]
    return headroom_jobs(jobs, cfg, _engine(jobs, [cfg], backend, workers), progress=progress)[0]


def _check_count(n: int) -> None:
    if n < 1:
        raise ValueError(f"n = {n}: the number of worst pairs must be at least 1")
