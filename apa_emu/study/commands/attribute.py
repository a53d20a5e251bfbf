"""``apa attribute``: the seed's error-source table. Every pair (or the worst) rerun under each
quantization variant and numerics toggle, on our arithmetic and on the seed's, and where the error
of the command's config sits by head and query position. With ``--peer``, the same for a peer recipe's
toggles (apa_emu.peers), on the dump padded in front."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import asdict, dataclass

import numpy as np

from ... import peers
from ...config import SEED_TOGGLES, Config
from .. import fp64, versus
from ..engine import CpuEngine, Engine
from ..plots import pyplot, save
from ..report import cfg_name, emit, say, table
from ..scan import Job, Pairs, check_count, cos_stats, engine_for, evaluate
from . import common

_ALL_OFF = dict(quant_q=False, quant_k=False, quant_p=False, quant_v=False)

# Each variant changes the config of the command (--config) as given: which pass-1 operands are
# quantized, or one numerics toggle with all quantized.
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
    "all, binary32 pass-2 scores": dict(p2_scores="f32"),
    "all, exact MMA": dict(mma="exact"),
    "all, sm120 MMA": dict(mma="sm120"),
}
CPU_WORST = 20  # pairs the variants the engine lacks rerun on the CPU emulator, lowest cosine first


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


def breakdown(pairs: Pairs, cos: np.ndarray, dump, buckets: int) -> Breakdown:
    """The cosines ``cos`` of ``pairs`` by head and by ``buckets`` equal ranges of query rows (positions)."""
    edges = np.unique(np.linspace(0, dump.n, min(buckets, dump.n) + 1).round().astype(int))
    bucket = np.searchsorted(edges, pairs.rows, side="right") - 1
    heads = np.unique(pairs.heads).tolist()
    labels = [f"{dump.q_offset + a}-{dump.q_offset + b - 1}" for a, b in zip(edges[:-1], edges[1:])]
    grid = np.full((len(heads), len(labels)), np.nan)
    for i, h in enumerate(heads):
        for j in range(len(labels)):
            cell = cos[(pairs.heads == h) & (bucket == j)]
            if (~np.isnan(cell)).any():
                grid[i, j] = np.nanmin(cell)
    return Breakdown([(h, cos_stats(cos[pairs.heads == h])) for h in heads],
                     [(lab, cos_stats(cos[bucket == j])) for j, lab in enumerate(labels)], grid)


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


def _own_cosines(jobs: list[Job], cfg: Config, own_cfgs: list[Config], engine: Engine, worst, progress, where):
    """The command's config on every pair of each job (its scans, the order of their pairs worst first,
    cut to ``worst``) and the cosines of the configs ``engine`` runs, in that order, per job."""
    if worst is None and cfg in own_cfgs:  # every pair: the command's own config is one of the variants
        runs = evaluate(jobs, own_cfgs, engine, progress=progress, where=where)
        bases = [r[own_cfgs.index(cfg)] for r in runs]
        orders = [b.order() for b in bases]
        return bases, orders, [[s.cos[o] for s in r] for r, o in zip(runs, orders)]
    bases = [s for (s,) in evaluate(jobs, [cfg], engine, progress=progress, where=where)]
    orders = [b.order()[:worst] for b in bases]
    sub = [Job(j.dump, b.pairs.take(o), j.name) for j, b, o in zip(jobs, bases, orders)]
    return bases, orders, [[s.cos for s in r] for r in evaluate(sub, own_cfgs, engine, progress=progress,
                                                                   where=where)]


def _emulate(scores: list[dict], jobs: list[Job], chosen: list[Pairs], emulated: dict, cpu_worst: int, workers: int,
             progress, where) -> None:
    """Add to each job's ``scores`` the variants run on the CPU emulator, over its first ``cpu_worst``
    chosen pairs."""
    cpu = CpuEngine(workers)
    few = [Job(j.dump, p.take(slice(0, cpu_worst)), j.name) for j, p in zip(jobs, chosen)]
    cpu_cfgs = list(dict.fromkeys(emulated.values()))
    for job_scores, runs in zip(scores, evaluate(few, cpu_cfgs, cpu, progress=progress, where=where)):
        job_scores.update({key: VariantScore.of(cpu.name, runs[cpu_cfgs.index(c)].cos) for key, c in emulated.items()})


def attribute_jobs(jobs: list[Job], cfg: Config, engine: Engine, *, worst: int | None = None,
                   cpu_worst: int = CPU_WORST, variants=None, buckets: int = 8, workers: int = 1,
                   progress=None, seed: bool = True, where=None) -> Attribution:
    """Each variant of ``variants`` (default ATTRIBUTE_VARIANTS, applied to ``cfg``) on every selected
    pair of each job, or on its ``worst`` lowest-cosine pairs under ``cfg``; under ``seed`` each variant
    also on the seed's arithmetic (numerics.md §12). The variants ``engine`` lacks (the emulator's MMA
    models and the seed's toggles, for the kernel) run on the CPU over the first ``cpu_worst`` of those
    pairs (0: not at all). Equal configs run once. Every unit runs ``where`` (scan.evaluate)."""
    for n in (worst, cpu_worst or None):
        if n is not None:
            check_count(n)
    changes = variants or ATTRIBUTE_VARIANTS
    configs, on_sm90 = _variant_configs(cfg, changes, seed)
    own = {key: c for key, c in configs.items() if not any(engine.lacks(c, j.dump.hd) for j in jobs)}
    emulated = {key: c for key, c in configs.items() if key not in own and cpu_worst}
    own_cfgs = list(dict.fromkeys(own.values()))
    bases, orders, cos = _own_cosines(jobs, cfg, own_cfgs, engine, worst, progress, where)
    chosen = [b.pairs.take(o) for b, o in zip(bases, orders)]
    scores = [{key: VariantScore.of(engine.name, per_job[own_cfgs.index(c)]) for key, c in own.items()}
              for per_job in cos]
    if emulated:
        _emulate(scores, jobs, chosen, emulated, cpu_worst, workers, progress, where)
    order = [name for name in changes if name in own or name in emulated]
    seeded = [name for name in changes if ("seed", name) in own or ("seed", name) in emulated]
    tables = [AttributeTable(p, {name: sc[name] for name in order}, breakdown(b.pairs, b.cos, j.dump, buckets),
                             {name: sc["seed", name] for name in seeded})
              for j, p, b, sc in zip(jobs, chosen, bases, scores)]
    return Attribution(tables, _pooled(tables, "variants"), _pooled(tables, "seed"),
                       [name for name in on_sm90 if name in seeded])


def attribute(dump, cfg: Config, n: int | None = None, *, backend="auto", workers=1, progress=None,
              variants=None, cpu_worst: int = CPU_WORST, buckets: int = 8, seed: bool = True) -> AttributeTable:
    """Cosines of every pair (or the ``n`` worst under ``cfg``) when only the named operands are
    quantized or one toggle changes, on our arithmetic and (``seed``) on the seed's."""
    jobs = [Job.of(dump)]
    return attribute_jobs(jobs, cfg, engine_for(jobs, [cfg], backend, workers), worst=n, cpu_worst=cpu_worst,
                          variants=variants, buckets=buckets, workers=workers, progress=progress,
                          seed=seed).tables[0]


@dataclass(frozen=True)
class PeerVariants:
    """A peer recipe's variants for ``--peer NAME[:KEY=VAL,...]``: the toggles each one runs with (the
    spec's on top of the recipe's defaults, then the variant's change), keyed by variant name."""

    spec: str
    recipe: str
    variants: dict[str, dict]


def peer_variants(spec: str) -> PeerVariants:
    """The variants of a recipe of ``peers.RECIPES`` that has ``Toggles``, mirroring ATTRIBUTE_VARIANTS:
    the recipe as the spec gives it, each quantized operand alone ("Q only": every other ``quant_*``
    toggle off), none quantized, and each on/off toggle flipped alone ("all, quant_q=0"). The spec's
    ``KEY=VAL`` are parsed by the recipe, as ``apa compare``'s ``sageattention3-emu:KEY=VAL`` are. A
    bad name, a bad toggle or a recipe without toggles is a ValueError of one line."""
    name, _, rest = spec.partition(":")
    module = peers.recipe(name).load()
    if not hasattr(module, "Toggles"):
        raise ValueError(f"--peer {spec}: {name} has no toggles (recipes with toggles: "
                         f"{', '.join(n for n, r in peers.RECIPES.items() if hasattr(r.load(), 'Toggles'))})")
    try:
        base = {**dataclasses.asdict(module.Toggles()), **module.parse_toggles(rest)}
    except ValueError as e:
        raise ValueError(f"--peer {spec}: {e}") from None
    flags = [k for k, v in base.items() if isinstance(v, bool)]
    quant = [k for k in flags if k.startswith("quant_")]
    none = {k: False for k in quant}
    variants = {"all (default)": {}, **{f"{k[len('quant_'):].upper()} only": {**none, k: True} for k in quant},
                "none": none, **{f"all, {k}={int(not base[k])}": {k: not base[k]} for k in flags}}
    return PeerVariants(spec, name, {label: {**base, **change} for label, change in variants.items()})


def _peer_cosines(job: Job, emu, ref: np.ndarray) -> np.ndarray:
    """The cosine of each of the job's pairs under one peer variant (NaN: a non-finite output)."""
    out = emu.call(emu.prepare(job.dump, ref))[job.pairs.rows, job.pairs.heads]
    cos, _ = fp64.cos_rel(fp64.pair_sums(np, out, ref[job.pairs.rows, job.pairs.heads]))
    return np.where(np.isfinite(out).all(axis=1), cos, np.nan)


def peer_attribute_jobs(jobs: list[Job], peer: PeerVariants, engine: Engine, *, worst: int | None = None,
                        buckets: int = 8, progress=None) -> Attribution:
    """Each variant of ``peer`` on every selected pair of each job, or on its ``worst`` lowest-cosine
    pairs under the spec's toggles, the recipe run on the CPU (apa_emu.peers) on the dump padded in front
    (peer_check.padded) and measured against float64 attention computed by ``engine``."""
    if worst is not None:
        check_count(worst)
    emus = {label: versus.SageEmu(f"{peer.recipe}:{label}", peer.recipe, toggles)
            for label, toggles in peer.variants.items()}
    first = next(iter(emus.values()))
    tables, done = [], 0
    with engine.context():
        for job in jobs:
            why = first.lacks(job.dump)
            if why:
                raise ValueError(f"{job.name}: --peer {peer.spec} does not run {why}")
            ref = versus.float64_reference(engine, job.dump, first.scale(job.dump.hd))
            cos = {}
            for label, emu in emus.items():
                cos[label] = _peer_cosines(job, emu, ref)
                done += 1
                if progress:
                    progress(done, len(jobs) * len(emus))
            base = cos[next(iter(cos))]
            order = np.argsort(np.where(np.isnan(base), -np.inf, base), kind="stable")[:worst]
            tables.append(AttributeTable(job.pairs.take(order), {k: VariantScore.of(first.device, c[order])
                                                                  for k, c in cos.items()},
                                         breakdown(job.pairs, base, job.dump, buckets), {}))
            engine.release()
    return Attribution(tables, _pooled(tables, "variants"), {}, [])


def plot_heatmap(panels: dict[str, Breakdown], out, title) -> str:
    """Min cosine of each (head, query-position bucket), one panel per dump, as 1 − cos on a log scale
    (cosines near 1 differ in their sixth digit), each cell labelled."""
    from matplotlib.colors import LogNorm

    plt = pyplot()
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 1.2 + 0.28 * sum(len(b.heads) for b in panels.values())
                                                       + 1.2 * len(panels)), squeeze=False)
    for a, (name, b) in zip(axes[:, 0], panels.items()):
        gap = np.clip(1.0 - b.min_cos, 1e-16, None)
        im = a.imshow(gap, aspect="auto", cmap="magma", norm=LogNorm(), interpolation="nearest")
        for (i, j), g in np.ndenumerate(gap):
            if np.isfinite(g):
                a.text(j, i, f"{g:.1e}", ha="center", va="center", fontsize=6,
                       color="black" if im.norm(g) > 0.6 else "white")
        a.set_yticks(range(len(b.heads)), [str(h) for h, _ in b.heads], fontsize=7)
        a.set_xticks(range(len(b.buckets)), [lab for lab, _ in b.buckets], fontsize=7, rotation=30)
        a.set_ylabel("query head")
        a.set_title(f"{name}: 1 − min cosine by head and query position", fontsize=9)
        fig.colorbar(im, ax=a, label="1 − min cosine")
    axes[-1, 0].set_xlabel("query positions")
    fig.suptitle(f"apa attribute {title}", fontsize=10)
    fig.tight_layout()
    return save(fig, out)


def _epilog() -> str:
    ops = ("quant_q", "quant_k", "quant_p", "quant_v")
    lines = []
    for name, change in ATTRIBUTE_VARIANTS.items():
        quantized = [op[-1].upper() for op in ops if change.get(op, True)]
        other = ", ".join(f"{k}={v}" for k, v in change.items() if k not in ops)
        what = f"quantized in pass 1: {' '.join(quantized) or 'nothing (FP16 operands)'}" + (f"; {other}" if other else "")
        lines.append(f"  {name:<18} {what}")
    return "variants (every other toggle as --config sets it):\n" + "\n".join(lines)


HELP = ("cosines of every pair under each quantization variant and numerics toggle, and where the error sits "
        "(by head and query position)")
EPILOG = common.study_epilog(_epilog())


PEER_HELP = ("a recipe of apa_emu.peers with toggles, sageattention3 (numerics.md §15), run on the CPU on the dump "
             "padded in front, its spec's KEY=VAL on top of the published toggles, e.g. sageattention3:"
             "causal_dropped_tile=0; variants: the recipe as given, each quantized operand alone (Q only, ...), none "
             "quantized, each on/off toggle flipped alone (all, KEY=0|1); no seed column; --config, --eps and "
             "--cluster do not apply. sageattention has no toggles")


def add_arguments(p) -> None:
    common.study_options(p)
    p.add_argument("--worst", type=common.count, metavar="N",
                   help="rerun only the N lowest-cosine pairs of each dump (under --config) per variant "
                        "(default: every pair)")
    p.add_argument("--cpu-worst", type=common.at_least(0), default=CPU_WORST, metavar="N",
                   help="how many of those pairs, lowest cosine first, the variants the GPU kernel lacks "
                        "(mma=exact, mma=sm120, the seed column) rerun on the CPU emulator; 0 leaves them out")
    p.add_argument("--buckets", type=common.count, default=8, metavar="N",
                   help="query-position buckets of the breakdown and the heatmap")
    p.add_argument("--plot", metavar="PATH.png", help="write a PNG heatmap of min cosine by (head, position "
                   "bucket) there (default: no plot)")
    p.add_argument("--seed", action=argparse.BooleanOptionalAction, default=True,
                   help="also run each variant on the seed's arithmetic (Config.seed(), docs/numerics.md §12), "
                        "a column beside ours; the kernel lacks it, so with the GPU it runs on the CPU emulator "
                        "over --cpu-worst pairs")
    p.add_argument("--peer", metavar="RECIPE[:KEY=VAL,...]",
                   help="attribute a peer recipe's error instead of APA's (" + PEER_HELP + ")")
    common.eps(p)


_STATS = ["pairs", "mean_cos", "min_cos", "below_0_999", "nonfinite"]
_SEED_STATS = ["engine", "mean_cos", "min_cos"]  # the seed column of apa attribute (its JSON has them all)


def _peer(args) -> PeerVariants | None:
    """--peer's variants, refused in one line before any dump is read, with the options that run APA."""
    if not args.peer:
        return None
    apa_only = [flag for flag, given in (("--config", args.config), ("--eps", args.eps is not None),
                                          ("--cluster", args.cluster), ("--devices", args.devices)) if given]
    if apa_only:
        raise ValueError(f"--peer runs the recipe in this process under its own toggles: leave {', '.join(apa_only)} out")
    args.seed = False
    return peer_variants(args.peer)


def _compute(args, peer: PeerVariants | None):
    def compute(jobs, cfg, engine, progress, where):
        if peer:
            return peer_attribute_jobs(jobs, peer, engine, worst=args.worst, buckets=args.buckets, progress=progress)
        return attribute_jobs(jobs, cfg, engine, worst=args.worst, cpu_worst=args.cpu_worst, buckets=args.buckets,
                              workers=args.workers, progress=progress, seed=args.seed, where=where)

    return compute


def run(args) -> None:
    peer = _peer(args)
    jobs, cfg, engine, att = common.run_study(args, _compute(args, peer))
    many = len(jobs) > 1
    scope = "every pair" if args.worst is None else f"the {args.worst} lowest-cosine pairs{' of each dump' * many}"
    slow = not peer and any(s.engine != engine.name for s in att.pooled.values())
    note = "; the variants the kernel lacks on the CPU emulator, over the lowest-cosine pairs" if slow else ""
    seed_note = ("; seed: the variant on the seed's arithmetic (--config preset=seed; (sm90): on the sm90 MMA model, "
                 "the seed's FP4 MMA needs every operand quantized)") if args.seed else ""
    what = f"the {peer.recipe} recipe" if peer else engine.name
    setting = peer.spec if peer else cfg_name(cfg)
    tables = [table(f"{common.named(jobs, 'apa attribute')} ({what}): cosines of {scope} under each variant"
                    f"{note}{seed_note}", ["variant", *["dump"] * many, "engine", *_STATS,
                                           *([f"seed {c}" for c in _SEED_STATS] if args.seed else [])],
                    _variant_rows(args, jobs, att))]
    for job, t in zip(jobs, att.tables):
        b = t.breakdown
        tables += [table(f"{job.name}, {setting}: by query head", ["head", *_STATS],
                         [[h, *(st[c] for c in _STATS)] for h, st in b.heads]),
                   table(f"{job.name}, {setting}: by query position", ["positions", *_STATS],
                         [[lab, *(st[c] for c in _STATS)] for lab, st in b.buckets])]
    png = plot_heatmap({j.name: t.breakdown for j, t in zip(jobs, att.tables)}, args.plot,
                       common.what(jobs)) if args.plot else None
    emit(args.json, _payload(args, jobs, cfg, engine, att, png), tables)
    if png and not args.json:
        say(f"plot: {png}")


def _variant_rows(args, jobs, att: Attribution) -> list[list]:
    """A row per variant and dump, and with several dumps a pooled row per variant."""
    many = len(jobs) > 1

    def seed_cells(name, s):
        if not args.seed:
            return []
        if s is None:
            return ["-"] * len(_SEED_STATS)
        return [s.engine + " (sm90)" * (name in att.seed_on_sm90), *(getattr(s, c) for c in _SEED_STATS[1:])]

    rows = []
    for name, pooled in att.pooled.items():
        for job, t in zip(jobs, att.tables):
            s = t.variants[name]
            rows.append([name, *[job.name] * many, s.engine, *(getattr(s, c) for c in _STATS),
                         *seed_cells(name, t.seed.get(name))])
        if many:
            rows.append([name, "pooled", pooled.engine, *(getattr(pooled, c) for c in _STATS),
                         *seed_cells(name, att.pooled_seed.get(name))])
    return rows


def _payload(args, jobs, cfg, engine, att: Attribution, png) -> dict:
    fields = dict(worst=args.worst, cpu_worst=args.cpu_worst, plot=png, seed_on_sm90=att.seed_on_sm90, peer=args.peer,
                  peer_toggles=peer_variants(args.peer).variants if args.peer else None)
    if len(jobs) == 1:
        return common.payload(args, jobs, cfg, engine, **fields, **att.tables[0].to_json())
    return common.payload(args, jobs, cfg, engine, **fields,
                          per_dump=common.per_dump(jobs, (t.to_json() for t in att.tables)),
                          pooled={name: asdict(s) for name, s in att.pooled.items()},
                          pooled_seed={name: asdict(s) for name, s in att.pooled_seed.items()})
