"""The studies of the seed's paper on real dumps: scan, worst pairs, one pair, error attribution and
ε sweeps. Computation only, in typed results; ``report`` and ``plots`` present them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from ..api import Result, attention
from ..config import Config
from ..geometry import ROWS, TILE, warp_of
from ..metrics import Summary, cosine_histogram, pair_metrics, summarize
from ..reference import reference_rows

NONFINITE_SHOWN = 5  # non-finite pairs named in a scan's report

# apa attribute: which operands are quantized in each row of the seed's error-source table
ATTRIBUTE_VARIANTS: dict[str, dict] = {
    "all (default)": {},
    "none": dict(quant_q=False, quant_k=False, quant_p=False, quant_v=False),
    "P only": dict(quant_q=False, quant_k=False, quant_v=False),
    "V only": dict(quant_q=False, quant_k=False, quant_p=False),
    "K only": dict(quant_q=False, quant_p=False, quant_v=False),
    "Q only (1 term)": dict(quant_k=False, quant_p=False, quant_v=False, q_terms=1),
    "Q only (2 terms)": dict(quant_k=False, quant_p=False, quant_v=False, q_terms=2),
    "Q only (FP8 E4M3)": dict(quant_k=False, quant_p=False, quant_v=False, q_format="fp8"),
    "all, exact MMA": dict(mma="exact"),
}


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

    def warps(self, G: int) -> set[tuple[int, int, int]]:
        return {(0, *warp_of(int(r), int(h), G)) for r, h in zip(self.rows, self.heads)}

    def __len__(self) -> int:
        return self.rows.size


@dataclass
class Scan:
    """The selected pairs of one run against float64 attention. A pair whose output holds NaN or Inf
    (an FP16 stage overflowed, numerics.md §8) has NaN cosine and relative L2; ``summary`` and the
    histogram's cosine bins cover the finite pairs only (``summary`` is None when there is none)."""

    config: Config
    pairs: Pairs
    out: np.ndarray  # [pairs, d] FP16
    ref: np.ndarray  # [pairs, d] float64
    cos: np.ndarray
    rel: np.ndarray
    finite: np.ndarray  # [pairs] bool: the output is finite
    summary: Summary | None
    result: Result
    histogram: list = field(default_factory=list)

    def order(self) -> np.ndarray:
        """Pair indices, worst first: non-finite pairs, then by cosine."""
        return np.argsort(np.where(self.finite, self.cos, -np.inf), kind="stable")

    def nonfinite_pairs(self) -> list[tuple[int, int]]:
        bad = ~self.finite
        return list(zip(self.pairs.rows[bad].tolist(), self.pairs.heads[bad].tolist()))

    def to_json(self) -> dict:
        bad = self.nonfinite_pairs()
        return dict(pairs=len(self.pairs), summary=None if self.summary is None else self.summary.as_dict(),
                    nonfinite=dict(count=len(bad), first=bad[:NONFINITE_SHOWN]), histogram=self.histogram)


def run_pairs(dump, cfg: Config, pairs: Pairs, *, ref=None, workers=1, progress=None, trace=None) -> Scan:
    """Emulate the warps holding ``pairs`` and compare those pairs with float64 attention."""
    G = dump.q.shape[1] // dump.k.shape[1]
    res = attention(dump.q, dump.k, dump.v, dump.q_offset, cfg, warps=pairs.warps(G), trace=trace,
                    workers=workers, progress=progress)
    out = res.out[pairs.rows, pairs.heads]
    if ref is None:
        ref = reference_rows(dump.q, dump.k, dump.v, dump.q_offset, pairs.rows, pairs.heads,
                             cfg.softmax_scale(dump.q.shape[2]))
    # A non-finite output has no cosine (pair_metrics would call a NaN output cosine 0): NaN marks it.
    finite = np.isfinite(out).all(axis=1)
    cos, rel = np.full(len(pairs), np.nan), np.full(len(pairs), np.nan)
    cos[finite], rel[finite] = pair_metrics(out[finite], ref[finite])
    summary = summarize(out[finite], ref[finite], res.hot_share) if finite.any() else None
    histogram = cosine_histogram(cos[finite]) + [("non-finite", int((~finite).sum()))]
    return Scan(cfg, pairs, out, ref, cos, rel, finite, summary, res, histogram)


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


@dataclass(frozen=True)
class SweepRow:
    eps: float
    hot_share: float
    pooled_cos: float
    mean_cos: float
    min_cos: float
    below_0_9: int
    nonfinite: int  # pairs left out of the cosines: their output is not finite

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class VariantScore:
    """Cosines of the attributed pairs under one quantization variant (mean and min over the finite ones)."""

    mean_cos: float
    min_cos: float
    nonfinite: int
    cos: list[float]


@dataclass(frozen=True)
class AttributeTable:
    pairs: Pairs
    variants: dict[str, VariantScore]

    def to_json(self) -> dict:
        return dict(pairs=list(zip(self.pairs.rows.tolist(), self.pairs.heads.tolist())),
                    variants={name: asdict(s) for name, s in self.variants.items()})


# The stages of a row in data-flow order with the trace fields each one writes (§7.10, §8.6, §9). A
# frame m = −inf is no overflow: it means the stage saw no tile.
_STAGES = (
    ("pass 1 (FP4 estimate of the cold tiles)", ("m1", "l1", "part")),
    ("pass 2 (FP16 scores q·k)", ("m2", "l2")),
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
    G = dump.q.shape[1] // dump.k.shape[1]
    hk = head // G
    p, mass, contrib = tile_breakdown(dump, row, head, scan.config.softmax_scale(dump.q.shape[2]))
    hot = pair_hot(dump, traced, row, head)
    packed = row * G + head % G
    rec = traced.rows[(traced.rows["hk"] == hk) & (traced.rows["row"] == packed)][0]
    m1, l1, m2, l2 = (float(rec[f]) for f in ("m1", "l1", "m2", "l2"))
    big = max(m1, m2)
    cold_fp4 = l1 * 2.0 ** (m1 - big) if l1 > 0 else 0.0
    hot_fp4 = l2 * 2.0 ** (m2 - big) if l2 > 0 else 0.0
    ref_norm = float(np.linalg.norm(scan.ref[i]))
    max_qk, max_o16 = fp16_headroom(dump, row, head, hot, scan.config.softmax_scale(dump.q.shape[2]))
    return PairDiagnostics(
        row=row, head=head, cos=float(scan.cos[i]), rel_l2=float(scan.rel[i]),
        hot_tiles=int(hot.sum()), tiles=int(mass.size),
        cold_mass_fp4=cold_fp4 / (cold_fp4 + hot_fp4) if cold_fp4 + hot_fp4 > 0 else 0.0,
        cold_mass_f64=float(mass[~hot].sum()),
        cold_out_rel=float(np.linalg.norm(contrib[~hot].sum(axis=0)) / ref_norm) if ref_norm > 0 else float("inf"),
        overflow=overflow_stage(rec), max_qk=max_qk, max_o16=max_o16,
    )


def worst(dump, cfg: Config, n: int, *, pairs: Pairs | None = None, workers=1,
          progress=None) -> tuple[Scan, list[PairDiagnostics]]:
    _check_count(n)
    pairs = pairs or Pairs.select(dump.q.shape[0], dump.q.shape[1])
    scan = run_pairs(dump, cfg, pairs, workers=workers, progress=progress)
    order = scan.order()[:n]
    G = dump.q.shape[1] // dump.k.shape[1]
    sub = Pairs(scan.pairs.rows[order], scan.pairs.heads[order])
    traced = attention(dump.q, dump.k, dump.v, dump.q_offset, cfg, warps=sub.warps(G), trace=sub.warps(G))
    return scan, [pair_diagnostics(dump, scan, int(i), traced) for i in order]


def pair(dump, cfg: Config, row: int, head: int) -> PairReport:
    pairs = Pairs.select(dump.q.shape[0], dump.q.shape[1], [row], [head], names=("--row", "--head"))
    G = dump.q.shape[1] // dump.k.shape[1]
    scan = run_pairs(dump, cfg, pairs, trace=pairs.warps(G))
    diag = pair_diagnostics(dump, scan, 0, scan.result)
    p, mass, contrib = tile_breakdown(dump, row, head, cfg.softmax_scale(dump.q.shape[2]))
    hot = pair_hot(dump, scan.result, row, head)
    ref = scan.ref[0]
    hot_part = contrib[hot].sum(axis=0)
    cold_part = contrib[~hot].sum(axis=0)
    lane = (row * G + head % G) % ROWS
    visits = scan.result.visits
    return PairReport(
        diag=diag,
        top_tile=int(np.argmax(mass)), top_tile_mass=float(mass.max()),
        hot_mass=float(mass[hot].sum()), hot_list=np.nonzero(hot)[0].tolist(),
        ref_norm=float(np.linalg.norm(ref)), hot_norm=float(np.linalg.norm(hot_part)),
        cold_norm=float(np.linalg.norm(cold_part)),
        out_norm=float(np.linalg.norm(scan.out[0].astype(np.float64))),
        mass=mass, contrib_norm=np.linalg.norm(contrib, axis=1), hot=hot,
        visits=[Visit(visit=int(r["visit"]), tile=int(r["tile"]), hot=bool(r["hot"]), c=float(r["c"][lane]),
                      m=float(r["m"][lane]), tl=float(r["tl"][lane]), la=float(r["la"][lane]),
                      lc=float(r["lc"][lane])) for r in visits],
    )


def attribute(dump, cfg: Config, n: int, *, workers=1, progress=None, variants=None) -> AttributeTable:
    """Mean cosine of the ``n`` worst pairs (under ``cfg``) when only the named operands are quantized."""
    _check_count(n)
    variants = variants or ATTRIBUTE_VARIANTS
    base = run_pairs(dump, cfg, Pairs.select(dump.q.shape[0], dump.q.shape[1]), workers=workers, progress=progress)
    order = base.order()[:n]
    sub = Pairs(base.pairs.rows[order], base.pairs.heads[order])
    table = {}
    for name, change in variants.items():
        scan = run_pairs(dump, cfg.replace(**change), sub, ref=base.ref[order], workers=workers)
        finite = scan.cos[scan.finite]
        table[name] = VariantScore(mean_cos=float(finite.mean()) if finite.size else np.nan,
                                   min_cos=float(finite.min()) if finite.size else np.nan,
                                   nonfinite=int((~scan.finite).sum()), cos=scan.cos.tolist())
    return AttributeTable(sub, table)


def sweep(dump, cfg: Config, eps_list, *, pairs: Pairs | None = None, workers=1, progress=None) -> list[SweepRow]:
    pairs = pairs or Pairs.select(dump.q.shape[0], dump.q.shape[1])
    ref = None
    rows = []
    for eps in eps_list:
        scan = run_pairs(dump, cfg.replace(eps=float(eps)), pairs, ref=ref, workers=workers, progress=progress)
        ref = scan.ref
        s = scan.summary
        rows.append(SweepRow(eps=float(eps), hot_share=scan.result.hot_share,
                             pooled_cos=s.pooled_cos if s else np.nan, mean_cos=s.mean_cos if s else np.nan,
                             min_cos=s.min_cos if s else np.nan, below_0_9=s.below_0_9 if s else 0,
                             nonfinite=int((~scan.finite).sum())))
    return rows


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


def headroom(dump, cfg: Config, pairs: Pairs | None = None, *, workers=1, progress=None) -> Headroom:
    """How close the selected pairs bring pass 2's FP16 scores and output to overflow (numerics.md §8)."""
    pairs = pairs or Pairs.select(dump.q.shape[0], dump.q.shape[1])
    scan = run_pairs(dump, cfg, pairs, workers=workers, progress=progress)
    scale = cfg.softmax_scale(dump.q.shape[2])
    est = np.array([fp16_headroom(dump, r, h, pair_hot(dump, scan.result, r, h), scale)
                    for r, h in zip(pairs.rows.tolist(), pairs.heads.tolist())])
    qk, o16 = int(np.argmax(est[:, 0])), int(np.argmax(est[:, 1]))
    at = lambda i: (int(pairs.rows[i]), int(pairs.heads[i]))  # noqa: E731
    return Headroom(pairs=len(pairs), max_qk=float(est[qk, 0]), max_qk_pair=at(qk),
                    qk_over=int((est[:, 0] > F16_MAX).sum()), max_o16=float(est[o16, 1]), max_o16_pair=at(o16),
                    o16_over=int((est[:, 1] > F16_MAX).sum()), nonfinite=int((~scan.finite).sum()))


def _check_count(n: int) -> None:
    if n < 1:
        raise ValueError(f"n = {n}: the number of worst pairs must be at least 1")
