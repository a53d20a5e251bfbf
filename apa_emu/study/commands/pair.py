"""``apa pair``: one (row, head) pair in full: its diagnosis, where its softmax mass and output sit
tile by tile, and the pass-1 trace of its warp."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ...config import Config
from ...geometry import ROWS
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
"""
EPILOG = common.study_epilog(_TRACE_COLUMNS)


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


def pair(dump, cfg: Config, row: int, head: int, *, backend="auto", workers=1) -> PairReport:
    pairs = Pairs.select(dump.n, dump.nh, [row], [head], names=("--row", "--head"))
    scan = run_pairs(dump, cfg, pairs, backend=backend, workers=workers, trace=True)
    traced = scan.result
    if traced.rows is None:  # an engine that returns no trace records: the emulator's describe the pair
        traced = run_pairs(dump, cfg, pairs, backend="cpu", workers=workers, trace=True).result
    diag = pair_diagnostics(dump, scan, 0, traced)
    p, mass, contrib = tile_breakdown(dump, row, head, cfg.softmax_scale(dump.hd))
    hot = pair_hot(dump, traced, row, head)
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
                for r in traced.visits],
    )


def plot_pair(report: PairReport, out, title) -> str:
    """Per-tile float64 mass and |Σ p·v| of one pair, hot tiles in red."""
    plt = pyplot()
    t = np.arange(report.mass.size)
    fig, (a, b) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    colors = np.where(report.hot, "tab:red", "tab:blue")
    a.bar(t, report.mass, color=colors)
    a.set_yscale("log")
    a.set_ylabel("tile mass (float64)")
    a.set_title(f"{title}: red = hot (pass 2), blue = cold (FP4)")
    b.bar(t, report.contrib_norm, color=colors)
    b.set_yscale("log")
    b.set_ylabel("|Σ p·v| of the tile")
    b.set_xlabel("tile")
    fig.tight_layout()
    return save(fig, out)


def add_arguments(p) -> None:
    common.study_options(p, many=False)
    p.add_argument("--row", type=int, required=True, help="query row (index into the dump's Q rows)")
    p.add_argument("--head", type=int, required=True, help="query head")
    common.eps(p)
    p.add_argument("--plot", metavar="PATH.png", help="write a PNG of per-tile mass and contribution there "
                   "(default: no plot)")


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
                              table("pass-1 trace of its warp (this row)", visit_cols,
                                    [[getattr(v, c) for c in visit_cols] for v in info.visits])])
    if png and not args.json:
        say(f"plot: {png}")


def _summary(info: PairReport) -> list[tuple]:
    d = info.diag
    return [
        ("cosine", d.cos), ("relative L2", d.rel_l2), ("overflow", d.overflow or "none"),
        ("top tile / its mass", f"{info.top_tile} / {info.top_tile_mass:.6f}"),
        ("hot tiles / tiles", f"{d.hot_tiles} / {d.tiles}"), ("hot mass (float64)", info.hot_mass),
        ("cold mass FP4 estimate / float64", f"{d.cold_mass_fp4:.6f} / {d.cold_mass_f64:.6f}"),
        ("|ref|", info.ref_norm), ("|hot part of ref|", info.hot_norm), ("|cold part of ref|", info.cold_norm),
        ("|out|", info.out_norm),
        ("max |q·k| partial sum, float64 estimate (FP16 max 65504)", d.max_qk),
        ("max |running O| of pass 2, float64 estimate", d.max_o16),
    ]
