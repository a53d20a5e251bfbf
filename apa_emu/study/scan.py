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
    def select(cls, n: int, H: int, rows=None, heads=None) -> "Pairs":
        rows = np.arange(n) if rows is None else np.asarray(rows)
        heads = np.arange(H) if heads is None else np.asarray(heads)
        if rows.size and (rows.min() < 0 or rows.max() >= n):
            raise ValueError(f"--rows: query rows must lie in 0..{n - 1}")
        if heads.size and (heads.min() < 0 or heads.max() >= H):
            raise ValueError(f"--heads: heads must lie in 0..{H - 1}")
        r, h = np.meshgrid(rows, heads, indexing="ij")
        return cls(r.ravel(), h.ravel())

    def warps(self, G: int) -> set[tuple[int, int, int]]:
        return {(0, *warp_of(int(r), int(h), G)) for r, h in zip(self.rows, self.heads)}

    def __len__(self) -> int:
        return self.rows.size


@dataclass
class Scan:
    config: Config
    pairs: Pairs
    out: np.ndarray  # [pairs, d] FP16
    ref: np.ndarray  # [pairs, d] float64
    cos: np.ndarray
    rel: np.ndarray
    summary: Summary
    result: Result
    histogram: list = field(default_factory=list)


def run_pairs(dump, cfg: Config, pairs: Pairs, *, ref=None, workers=1, progress=None, trace=None) -> Scan:
    """Emulate the warps holding ``pairs`` and compare those pairs with float64 attention."""
    G = dump.q.shape[1] // dump.k.shape[1]
    res = attention(dump.q, dump.k, dump.v, dump.q_offset, cfg, warps=pairs.warps(G), trace=trace,
                    workers=workers, progress=progress)
    out = res.out[pairs.rows, pairs.heads]
    if ref is None:
        ref = reference_rows(dump.q, dump.k, dump.v, dump.q_offset, pairs.rows, pairs.heads,
                             cfg.softmax_scale(dump.q.shape[2]))
    cos, rel = pair_metrics(out, ref)
    return Scan(cfg, pairs, out, ref, cos, rel, summarize(out, ref, res.hot_share), res, cosine_histogram(cos))


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


def hot_tiles(res: Result, hk: int, warp: int, ntiles: int) -> np.ndarray:
    words = res.hot[0, hk, warp]
    t = np.arange(ntiles)
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

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class VariantScore:
    """Cosines of the attributed pairs under one quantization variant."""

    mean_cos: float
    min_cos: float
    cos: list[float]


@dataclass(frozen=True)
class AttributeTable:
    pairs: Pairs
    variants: dict[str, VariantScore]

    def to_json(self) -> dict:
        return dict(pairs=list(zip(self.pairs.rows.tolist(), self.pairs.heads.tolist())),
                    variants={name: asdict(s) for name, s in self.variants.items()})


def pair_diagnostics(dump, scan: Scan, i: int, traced: Result) -> PairDiagnostics:
    row, head = int(scan.pairs.rows[i]), int(scan.pairs.heads[i])
    G = dump.q.shape[1] // dump.k.shape[1]
    hk, w = warp_of(row, head, G)
    p, mass, contrib = tile_breakdown(dump, row, head, scan.config.softmax_scale(dump.q.shape[2]))
    hot = hot_tiles(traced, hk, w, mass.size)
    packed = row * G + head % G
    rec = traced.rows[(traced.rows["hk"] == hk) & (traced.rows["row"] == packed)][0]
    m1, l1, m2, l2 = (float(rec[f]) for f in ("m1", "l1", "m2", "l2"))
    big = max(m1, m2)
    cold_fp4 = l1 * 2.0 ** (m1 - big) if l1 > 0 else 0.0
    hot_fp4 = l2 * 2.0 ** (m2 - big) if l2 > 0 else 0.0
    ref_norm = float(np.linalg.norm(scan.ref[i]))
    return PairDiagnostics(
        row=row, head=head, cos=float(scan.cos[i]), rel_l2=float(scan.rel[i]),
        hot_tiles=int(hot.sum()), tiles=int(mass.size),
        cold_mass_fp4=cold_fp4 / (cold_fp4 + hot_fp4) if cold_fp4 + hot_fp4 > 0 else 0.0,
        cold_mass_f64=float(mass[~hot].sum()),
        cold_out_rel=float(np.linalg.norm(contrib[~hot].sum(axis=0)) / ref_norm) if ref_norm > 0 else float("inf"),
    )


def worst(dump, cfg: Config, n: int, *, pairs: Pairs | None = None, workers=1,
          progress=None) -> tuple[Scan, list[PairDiagnostics]]:
    pairs = pairs or Pairs.select(dump.q.shape[0], dump.q.shape[1])
    scan = run_pairs(dump, cfg, pairs, workers=workers, progress=progress)
    order = np.argsort(scan.cos, kind="stable")[:n]
    G = dump.q.shape[1] // dump.k.shape[1]
    sub = Pairs(scan.pairs.rows[order], scan.pairs.heads[order])
    traced = attention(dump.q, dump.k, dump.v, dump.q_offset, cfg, warps=sub.warps(G), trace=sub.warps(G))
    return scan, [pair_diagnostics(dump, scan, int(i), traced) for i in order]


def pair(dump, cfg: Config, row: int, head: int) -> PairReport:
    pairs = Pairs.select(dump.q.shape[0], dump.q.shape[1], [row], [head])
    G = dump.q.shape[1] // dump.k.shape[1]
    scan = run_pairs(dump, cfg, pairs, trace=pairs.warps(G))
    diag = pair_diagnostics(dump, scan, 0, scan.result)
    p, mass, contrib = tile_breakdown(dump, row, head, cfg.softmax_scale(dump.q.shape[2]))
    hk, w = warp_of(row, head, G)
    hot = hot_tiles(scan.result, hk, w, mass.size)
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
    variants = variants or ATTRIBUTE_VARIANTS
    base = run_pairs(dump, cfg, Pairs.select(dump.q.shape[0], dump.q.shape[1]), workers=workers, progress=progress)
    order = np.argsort(base.cos, kind="stable")[:n]
    sub = Pairs(base.pairs.rows[order], base.pairs.heads[order])
    table = {}
    for name, change in variants.items():
        scan = run_pairs(dump, cfg.replace(**change), sub, ref=base.ref[order], workers=workers)
        table[name] = VariantScore(mean_cos=float(scan.cos.mean()), min_cos=float(scan.cos.min()),
                                   cos=scan.cos.tolist())
    return AttributeTable(sub, table)


def sweep(dump, cfg: Config, eps_list, *, pairs: Pairs | None = None, workers=1, progress=None) -> list[SweepRow]:
    pairs = pairs or Pairs.select(dump.q.shape[0], dump.q.shape[1])
    ref = None
    rows = []
    for eps in eps_list:
        scan = run_pairs(dump, cfg.replace(eps=float(eps)), pairs, ref=ref, workers=workers, progress=progress)
        ref = scan.ref
        s = scan.summary
        rows.append(SweepRow(eps=float(eps), hot_share=s.hot_share, pooled_cos=s.pooled_cos, mean_cos=s.mean_cos,
                             min_cos=s.min_cos, below_0_9=s.below_0_9))
    return rows
