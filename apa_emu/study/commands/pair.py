"""``apa pair``: one (row, head) pair in full: its diagnosis, where its softmax mass and output sit
tile by tile, where its estimated error err_est comes from (§9.8), and the pass-1 trace of its warp."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ...config import Config
from ...geometry import ROWS
from ...merge import estimate_variances
from ...prep import prepare
from ...trace import VISIT_FIELDS
from ..plots import pyplot, save
from ..report import emit, say, table
from ..scan import Job, PairDiagnostics, Pairs, pair_diagnostics, pair_hot, run_pairs, tile_breakdown
from . import common

HELP = "the diagnostic table and per-tile trace of one (row, head) pair"
_TRACE_COLUMNS = """pass-1 trace columns (docs/numerics.md §7 and §10), this row's lane of its warp:
  visit   visit order: tile 0 first, then from the diagonal tile down
  tile    key tile (64 keys)
  hot     the warp voted the tile hot: pass 2 recomputes it in FP16
  c       candidate frame (log2 units) from this tile's scores
  m       frame after the visit
  tl      the tile's FP4 row sum P̂·1, in units of 2^m
  la      λ after the visit: running row sum of every tile so far
  lc      running row sum of the cold tiles so far
  tv      hot_test=output: the tile's row sum weighted by ‖v‖/vg (P̂·ν); 0 under the other hot tests
  lv      hot_test=output: running sum of tv, the output test's λ; 0 under the other hot tests
  t2      the cold tile's Σ P̂² (§7.6), in units of 2^(2m); 0 on a hot tile
  ws      running Σ P̂² of the cold tiles so far, what err_est weighs the cold keys by (§9.8)
"""
_BUDGET_COLUMNS = """
error-budget columns (docs/numerics.md §9.8), one row per visit in visit order:
  mass        the tile's share of the row's float64 softmax mass
  cold_share  the tile's share of the row's cold Σ P̂² ws1: its t2 rescaled to the final frame m1, over ws1
              (0 on a hot tile); err_est's cold variance Vc is ws1 times a per-row factor, so this is
              also the tile's share of Vc
  cumulative  cold_share summed over the visits so far (1 at the end, to float32 rounding)
the summary's err_est rows split err_est² / Z² into Vc/Dn² (cold keys), Vh/Dn² (hot keys) and the rest,
the output's FP16 rounding F2, as §9.8 step 6 adds them
"""
EPILOG = common.study_epilog(_TRACE_COLUMNS + _BUDGET_COLUMNS)


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
    t2: float
    ws: float


@dataclass(frozen=True)
class TileBudget:
    """One visit's part in the row's cold Σ P̂² ws1 (§7.8–7.10), the sum err_est's Vc weighs (§9.8)."""

    visit: int
    tile: int
    hot: bool
    mass: float  # the tile's float64 softmax mass share
    cold: float  # t2 ⊗ 4^(m − m1) ⊗ Kf², in float64: the tile's term of ws1
    cold_share: float  # cold / ws1
    cumulative: float


@dataclass(frozen=True)
class EstimateSplit:
    """§9.8 step 6's terms of the row: err_est² / Z² = Vc/Dn² + Vh/Dn² + F2 (F2 here as the rest)."""

    err_est: float
    z: float
    cold: float  # Vc / Dn²
    hot: float  # Vh / Dn²

    @property
    def rounding(self) -> float:
        return max((self.err_est / self.z) ** 2 - self.cold - self.hot, 0.0)

    def to_json(self) -> dict:
        return dict(err_est=self.err_est, z=self.z, cold_var=self.cold, hot_var=self.hot, rounding_var=self.rounding)


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
    ws1: float
    budget: list[TileBudget]
    estimate: EstimateSplit

    def to_json(self) -> dict:
        return dict(diag=self.diag.to_json(), hot_tiles=self.hot_list, top_tile=self.top_tile,
                    hot_mass=self.hot_mass, ref_norm=self.ref_norm, hot_norm=self.hot_norm,
                    cold_norm=self.cold_norm, out_norm=self.out_norm, tile_mass=self.mass.tolist(),
                    visits=[asdict(v) for v in self.visits], ws1=self.ws1,
                    budget=[asdict(b) for b in self.budget], estimate=self.estimate.to_json())


def cold_budget(visits: list[Visit], mass: np.ndarray, ws1: float, Kf: float) -> list[TileBudget]:
    """Each visit's term of ws1 = (ws ⊗ Kf) ⊗ Kf (§7.10): its t2, formed in the frame m after the
    step, rescaled by α² at each later frame move (§7.9), i.e. by 4^(m − m1) overall, in float64."""
    m1 = visits[-1].m if visits else 0.0
    out, total = [], 0.0
    for v in visits:
        cold = v.t2 * 4.0 ** (v.m - m1) * Kf * Kf if v.t2 > 0 else 0.0  # t2 = 0: no frame to rescale from
        total += cold
        share = cold / ws1 if ws1 > 0 else 0.0
        # a warp visits the tiles of its longest row: past this row's last tile it holds no mass
        share_of_mass = float(mass[v.tile]) if v.tile < mass.size else 0.0
        out.append(TileBudget(visit=v.visit, tile=v.tile, hot=v.hot, mass=share_of_mass, cold=cold,
                              cold_share=share, cumulative=total / ws1 if ws1 > 0 else 0.0))
    return out


def estimate_split(dump, cfg: Config, row: int, head: int, rec, nh: int) -> EstimateSplit:
    """The pair's err_est (``rec``, its trace row record) and its cold and hot variances, from
    ``merge.estimate_variances`` on the pair's prep (§5) and pass states; nh is its warp's hot tiles."""
    G = dump.group
    hk, r = head // G, row * G + head % G
    prep = prepare(dump.q[:, hk * G:(hk + 1) * G], dump.k[:, hk:hk + 1], dump.v[:, hk:hk + 1], dump.q_offset, cfg)
    k = cfg.est_consts(dump.hd)
    state = (np.asarray(rec[f], np.float32)[None] for f in ("m1", "l1", "ws1", "m2", "l2", "p2", "o2"))
    vc, vh, dn = estimate_variances(*state, nh, prep.cq[0, r:r + 1], prep.qstat[0, r:r + 1], prep.kvstat[0],
                                    prep.sh[0, r:r + 1], k, cfg.exp2 == "soft")
    den = float(dn[0]) ** 2  # 0 only for a row that holds no mass (§9.1), whose err_est says nothing
    return EstimateSplit(err_est=float(rec["err_est"]), z=float(k.z), cold=float(vc[0]) / den if den else np.nan,
                         hot=float(vh[0]) / den if den else np.nan)


def pair(dump, cfg: Config, row: int, head: int, *, backend="auto", workers=1) -> PairReport:
    pairs = Pairs.select(dump.n, dump.nh, [row], [head], names=("--row", "--head"))
    scan = run_pairs(dump, cfg, pairs, backend=backend, workers=workers, trace=True)
    traced = scan.result
    if traced.rows is None:  # an engine that returns no trace records: the emulator's describe the pair
        traced = run_pairs(dump, cfg, pairs, backend="cpu", workers=workers, trace=True).result
    diag = pair_diagnostics(dump, scan, 0, traced)
    p, mass, contrib = tile_breakdown(dump, row, head, cfg.softmax_scale(dump.hd))
    hot = pair_hot(dump, traced, row, head)
    hot_norm, cold_norm, _ = (float(x[0]) for x in scan.split)
    hk, packed = head // dump.group, row * dump.group + head % dump.group
    warp, lane = divmod(packed, ROWS)
    rec = traced.rows[(traced.rows["hk"] == hk) & (traced.rows["row"] == packed)][0]
    nh = int(np.unpackbits(traced.hot[0, hk, warp].view(np.uint8)).sum())  # §9.8's nh: the warp's hot tiles
    visits = [Visit(visit=int(r["visit"]), tile=int(r["tile"]), hot=bool(r["hot"]),
                    **{f: float(r[f][lane]) for f in VISIT_FIELDS[2:]})
              for r in traced.visits if r["hk"] == hk and r["warp"] == warp]
    return PairReport(
        diag=diag,
        top_tile=int(np.argmax(mass)), top_tile_mass=float(mass.max()),
        hot_mass=float(mass[hot].sum()), hot_list=np.nonzero(hot)[0].tolist(),
        ref_norm=float(scan.ref_norm[0]), hot_norm=hot_norm, cold_norm=cold_norm,
        out_norm=float(np.linalg.norm(scan.out[0].astype(np.float64))),
        mass=mass, contrib_norm=np.linalg.norm(contrib, axis=1), hot=hot, visits=visits,
        ws1=float(rec["ws1"]), budget=cold_budget(visits, mass, float(rec["ws1"]), float(cfg.pass1_consts().Kf)),
        estimate=estimate_split(dump, cfg, row, head, rec, nh),
    )


def plot_pair(report: PairReport, out, title) -> str:
    """Per-tile float64 mass and |Σ p·v| of one pair, hot tiles in red, and below, over the visit
    order, the cumulative share of the cold Σ P̂² ws1 that err_est's cold variance weighs (§9.8)."""
    plt = pyplot()
    t = np.arange(report.mass.size)
    fig = plt.figure(figsize=(10, 8.5))
    a = fig.add_subplot(3, 1, 1)
    b = fig.add_subplot(3, 1, 2, sharex=a)
    colors = np.where(report.hot, "tab:red", "tab:blue")
    a.bar(t, report.mass, color=colors)
    a.set_yscale("log")
    a.set_ylabel("tile mass (float64)")
    a.set_title(f"{title}: red = hot (pass 2), blue = cold (FP4)")
    b.bar(t, report.contrib_norm, color=colors)
    b.set_yscale("log")
    b.set_ylabel("|Σ p·v| of the tile")
    b.set_xlabel("tile")
    c = fig.add_subplot(3, 1, 3)
    visit = [x.visit for x in report.budget]
    c.step(visit, [x.cumulative for x in report.budget], where="post", color="tab:blue")
    hot = [x.visit for x in report.budget if x.hot]
    c.plot(hot, [x.cumulative for x in report.budget if x.hot], "|", color="tab:red", markersize=10, label="hot tile")
    c.set_ylim(0, 1.05)
    c.set_xlabel("visit (pass-1 order)")
    c.set_ylabel("cumulative share of ws1")
    c.set_title(f"cold variance Vc/Dn² = {report.estimate.cold:.3g}, hot Vh/Dn² = {report.estimate.hot:.3g}",
                fontsize=9)
    if hot:
        c.legend(fontsize=8)
    fig.tight_layout()
    return save(fig, out)


def add_arguments(p) -> None:
    common.study_options(p, many=False)
    p.add_argument("--row", type=int, required=True, help="query row (index into the dump's Q rows)")
    p.add_argument("--head", type=int, required=True, help="query head")
    common.eps(p)
    p.add_argument("--plot", metavar="PATH.png", help="write a PNG of per-tile mass and contribution and of "
                   "the cumulative cold variance over the visits there (default: no plot)")


def run(args) -> None:
    dump, path = common.load(args)
    cfg = common.config(args)
    jobs = [Job(dump, Pairs.select(dump.n, dump.nh, [args.row], [args.head], names=("--row", "--head")), path.name)]
    engine = common.engine(args, cfg, [dump.hd])  # after the checks: a wrong --row is the one line
    info = pair(dump, cfg, args.row, args.head, backend=engine)
    png = None
    if args.plot:
        png = plot_pair(info, args.plot, f"{path.name} row {args.row} head {args.head}")
    payload = common.payload(args, jobs, cfg, engine, row=args.row, head=args.head, **info.to_json(), plot=png)
    visit_cols = ["visit", *VISIT_FIELDS]
    emit(args.json, payload, [table(f"apa pair {path.name} row {args.row} head {args.head}", ["metric", "value"],
                                    _summary(info)),
                              table("where err_est's cold variance comes from (§9.8), by visit", _BUDGET_COLS,
                                    [[getattr(b, c) for c in _BUDGET_COLS] for b in info.budget]),
                              table("pass-1 trace of its warp (this row)", visit_cols,
                                    [[getattr(v, c) for c in visit_cols] for v in info.visits])])
    if png and not args.json:
        say(f"plot: {png}")


_BUDGET_COLS = ["visit", "tile", "hot", "mass", "cold_share", "cumulative"]


def _summary(info: PairReport) -> list[tuple]:
    d, e = info.diag, info.estimate
    var = (e.err_est / e.z) ** 2
    part = lambda x: f"{x:.4g} ({x / var:.1%})" if var > 0 else f"{x:.4g}"
    return [
        ("cosine", d.cos), ("relative L2", d.rel_l2), ("overflow", d.overflow or "none"),
        ("top tile / its mass", f"{info.top_tile} / {info.top_tile_mass:.6f}"),
        ("hot tiles / tiles", f"{d.hot_tiles} / {d.tiles}"), ("hot mass (float64)", info.hot_mass),
        ("cold mass FP4 estimate / float64", f"{d.cold_mass_fp4:.6f} / {d.cold_mass_f64:.6f}"),
        ("|ref|", info.ref_norm), ("|hot part of ref|", info.hot_norm), ("|cold part of ref|", info.cold_norm),
        ("|out|", info.out_norm),
        ("max |q·k| partial sum, float64 estimate (FP16 max 65504)", d.max_qk),
        ("max |running O| of pass 2, float64 estimate", d.max_o16),
        ("err_est (§9.8) / its Z", f"{e.err_est:.6g} / {e.z:g}"),
        ("err_est²/Z²: cold keys Vc/Dn² (share)", part(e.cold)),
        ("err_est²/Z²: hot keys Vh/Dn² (share)", part(e.hot)),
        ("err_est²/Z²: output rounding F2, the rest (share)", part(e.rounding)),
        ("cold Σ P̂² ws1 / its tiles", f"{info.ws1:.6g} / {sum(b.cold > 0 for b in info.budget)}"),
    ]
