"""What an engine returns for a call (the ``Result``), and the diagnosis of an output that is not finite.

``run_checked`` is the last step of each engine's ``attention`` (``apa_emu.api``, ``apa_gpu.api``): it
runs the engine on the resolved call and, when a computed (row, head) pair's output is not finite, runs
it once more, traced, on the warps holding such pairs, to name the first stage of §10's row record that
went non-finite. So an engine runs twice on such a call; its ``run`` itself holds no such policy.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields, replace

import numpy as np

from . import arrays
from . import trace as tr
from .call import Call, owner
from .config import Config

__all__ = ["Result", "Overflow", "NonFiniteOutput", "run_checked", "like_input"]


@dataclass(frozen=True)
class Overflow:
    """A computed (row, head) pair whose output is not finite: its index into ``out`` without the last
    axis ((row, head), or (b, row, head) for a batched q) and the first stage of §10's row record that
    went non-finite (``trace.overflow_stage``)."""

    index: tuple[int, ...]
    stage: str


class NonFiniteOutput(RuntimeWarning):
    """``attention`` returned pairs whose output is not finite (``Result.overflow`` lists them)."""


@dataclass
class Result:
    """Output of one run. ``out`` has the shape of q; hot masks are per (b, hk, warp) (§10).
    ``err_bound`` (binary32, the shape of ``out`` without its last axis) bounds ‖out − exact‖₂ of
    each (row, head) (§9.7); ``err_est`` (the same shape) estimates it, about 2 standard deviations
    (§9.8; its coverage is measured, not guaranteed: at the default ε, ≥ 99.9 % of the pairs of the
    dumps its constants were fitted to and 99.67–100 % on held-out SmolLM2 dumps, with a median
    estimate/error of 4.7–6.9 and 4.4–7.8: docs/accuracy.md §3); rows not computed hold NaN in all
    three. ``overflow``: the computed pairs whose output is not finite, each with the stage that made it
    so (``attention`` fills it and warns). An engine's Result holds NumPy arrays; ``attention`` gives
    them back as q's kind of array (``like_input``: torch tensors for a torch q)."""

    out: np.ndarray
    err_bound: np.ndarray
    hot: np.ndarray
    active_tiles: int
    hot_tiles: int
    config: Config
    visits: np.ndarray | None = None
    rows: np.ndarray | None = None
    meta: dict = field(default_factory=dict)
    overflow: list[Overflow] = field(default_factory=list)
    err_est: np.ndarray | None = None

    @property
    def hot_share(self) -> float:
        return self.hot_tiles / self.active_tiles if self.active_tiles else 0.0


def _nonfinite_pairs(res: Result) -> np.ndarray:
    """Indices (into ``out`` without its last axis) of the computed pairs whose output is not finite:
    rows not computed hold NaN in ``err_bound`` too, a computed non-finite one +inf (§9.7 step 11)."""
    out = np.asarray(res.out)
    return np.argwhere(~np.isfinite(out).all(axis=-1) & ~np.isnan(np.asarray(res.err_bound)))


def run_checked(call: Call, run) -> Result:
    """``run(call)``, an engine's Result of the call, with ``overflow`` filled and a NonFiniteOutput
    warning when a computed pair's output is not finite. The stage comes from §10's row records, so
    the warps holding such pairs run once more, traced, from the KV state as it was before the call
    (its statistics and decision; the kernel's cached images are formed afresh, bitwise alike)."""
    before = None if call.kv_state is None else replace(call.kv_state, history=list(call.kv_state.history),
                                                        cache=None)
    res = run(call)
    bad = _nonfinite_pairs(res)
    if not len(bad):
        return res
    owners = [owner(call, index) for index in bad]
    triples = sorted({t for t, _ in owners})
    # only those warps run, except in a chunk: the state's update needs every KV head's statistics
    traced = run(replace(call, want=tr.TraceRequest(frozenset(triples)), kv_state=before,
                         warps=frozenset(triples) if before is None else None))
    records = {(int(r["b"]), int(r["hk"]), int(r["row"])): r for r in traced.rows}
    for index, ((b, hk, w), packed) in zip(bad, owners):
        stage = tr.overflow_stage(records[b, hk, packed]) or "no stage of the row record (a planted bug?)"
        res.overflow.append(Overflow(tuple(int(i) for i in index), stage))
    first = res.overflow[0]
    warnings.warn(f"{len(bad)} (row, head) pair(s) of the output are not finite; the first, {first.index}: "
                  f"{first.stage} (Result.overflow lists each)", NonFiniteOutput, stacklevel=3)
    return res


def like_input(res: Result, q) -> Result:
    """``res`` with its arrays as q's kind of array, on q's device (apa_emu/arrays.py ``like``): what
    ``attention`` returns to a caller of torch tensors; ``res`` itself for NumPy input."""
    back = arrays.like(q)
    if back is None:
        return res
    return replace(res, **{f.name: back(getattr(res, f.name)) for f in fields(Result)})
