"""The one frozen configuration that carries every numerics toggle (numerics.md §2–§9)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from . import constants

CHOICES = {
    "q_format": ("nvfp4", "fp8"),
    "p_scale": ("ue4m3", "pow2"),
    "block_scale": ("lsq", "nearest"),
    "tile_order": ("diagonal", "ascending"),
    "p2_accum": ("f16", "f32"),
    "p2_scores": ("f16", "f32"),
    "mma": ("sm90", "sm120", "exact"),
    "p_groups": ("consecutive", "interleaved"),
    "exp2": ("soft", "fast"),
    "hot_test": ("mass", "output", "budget"),
    "k_stats": ("exact", "sampled"),
    "p2_shift": ("sequential", "lanes"),
}


F32_MAX = float(np.finfo(np.float32).max)
# What Config.seed() sets: the seed's (APA 0.6.1) arithmetic where it differs from ours (numerics.md §12).
SEED_TOGGLES = dict(mma="sm120", fma=True, p_groups="interleaved", v_f16=True, k_stats="sampled", pad_vote=True,
                    p2_shift="lanes", direct_store=True, exp2="fast")


def _in_binary32(x) -> bool:
    return math.isfinite(x) and abs(x) <= F32_MAX and (x == 0 or np.float32(x) != 0)


def _finite_qmul(scale) -> bool:
    """Whether §5.3's multiplier f32(scale ⊗ log2 e) is finite: else every score is NaN."""
    with np.errstate(over="ignore"):
        return bool(np.isfinite(np.float32(scale) * np.float32(np.log2(np.e))))


def _is_real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


@dataclass(frozen=True)
class Config:
    """Every toggle of the APA numerics. The defaults are what the sm_90 kernel does.

    quant_q/k/p/v: quantize that pass-1 operand (False: it enters at FP16, or binary32 under
    ``mma="exact"``). ``q_terms`` 1 or 2 NVFP4 terms; ``q_format`` "fp8" quantizes Q as E4M3.
    ``eps`` < 0 makes every tile exact; a very large ``eps`` gives pure FP4. ``delta`` = 0
    reproduces APA 0.2.0's coupled cold frame; ``tau`` = 0 is the exact running maximum.
    ``scale`` is the softmax scale (None: 1/sqrt(d) rounded as binary32). ``hot_test`` "mass"
    compares a tile's share of the softmax sum with ``eps``, "output" its share of the value-norm
    weighted sum, "budget" spends a per-row error budget of relative error ``eps`` on cold tiles (§7.7).
    ``v_f16`` rounds V ⊗ (1/vg) to FP16 before it is quantized, as the seed does (§5.5, §12 #6).
    ``fma`` rounds each of the seed's FMA contraction sites once, as its compiler fuses them (§1.8, §12 #3). ``k_stats`` "sampled" takes the K mean and the head scales from sampled
    chunks summed in the seed's binary32 order, with its overflow redo (§5.10, §12 #5); ``pad_vote`` lets
    padding rows vote with the Q of the last row (§6.2, §12 #7); ``p2_shift`` "lanes" forms the pass-2
    row shift per lane as the seed does (§5.3, §12 #9); ``direct_store`` stores a warp with no hot tile
    straight from pass 1 (§9.5, §12 #11). ``p2_scores`` and ``p2_accum`` "f32" accumulate pass 2's scores
    (§8.1) and output (§8.5) in binary32 instead of FP16.
    """

    eps: float = 0.005
    quant_q: bool = True
    quant_k: bool = True
    quant_p: bool = True
    quant_v: bool = True
    q_format: str = "nvfp4"
    q_terms: int = 2
    p_scale: str = "ue4m3"
    block_scale: str = "lsq"
    tile_order: str = "diagonal"
    delta: float = 32.0
    tau: int = 4
    p2_accum: str = "f16"
    p2_scores: str = "f16"
    mma: str = "sm90"
    p_groups: str = "consecutive"
    exp2: str = "soft"
    scale: float | None = None
    hot_test: str = "mass"
    v_f16: bool = False
    fma: bool = False
    k_stats: str = "exact"
    pad_vote: bool = False
    p2_shift: str = "sequential"
    direct_store: bool = False

    def __post_init__(self):
        for name, allowed in CHOICES.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"config.{name}={value!r}: expected one of {', '.join(allowed)}")
        for name in (f.name for f in dataclasses.fields(self) if f.type == "bool"):  # every on/off toggle
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"config.{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.q_terms, (int, np.integer)) or isinstance(self.q_terms, bool) or self.q_terms not in (1, 2):
            raise ValueError(f"config.q_terms={self.q_terms!r}: expected 1 or 2")
        if not isinstance(self.tau, (int, np.integer)) or isinstance(self.tau, bool) or not 0 <= self.tau <= 8:
            raise ValueError(f"config.tau={self.tau!r}: expected an integer in 0..8")
        for name in ("eps", "delta"):
            value = getattr(self, name)
            if not _is_real(value) or not _in_binary32(value):
                raise ValueError(f"config.{name}={value!r}: expected a finite number within binary32 range "
                                 f"(the kernel holds it in binary32, where it must neither overflow nor vanish)")
        if self.delta < 0:
            raise ValueError(f"config.delta={self.delta!r}: must be >= 0")
        if self.scale is not None and (not _is_real(self.scale) or not _in_binary32(self.scale) or self.scale <= 0
                                       or not _finite_qmul(self.scale)):
            raise ValueError(f"config.scale={self.scale!r}: expected a positive binary32 number whose product with "
                             f"log2 e stays finite (below about 2.36e38), or None")
        if self.mma == "sm120":
            off = [n for n in ("quant_q", "quant_k", "quant_p", "quant_v") if not getattr(self, n)]
            if off or self.q_format != "nvfp4":
                raise ValueError(
                    "config.mma='sm120' models the FP4 block-scaled MMA, which needs every pass-1 operand "
                    f"quantized and Q in NVFP4 (got {', '.join(off) or 'q_format=' + self.q_format} off)"
                )

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)

    def softmax_scale(self, d: int) -> np.float32:
        """The binary32 softmax scale: 1 / f32(sqrt(d)) rounded once, as the seed's bench does."""
        if self.scale is not None:
            return np.float32(self.scale)
        return np.float32(np.float32(1.0) / np.float32(math.sqrt(d)))

    def qmul(self, d: int) -> np.float32:
        """§5.3: f32(scale ⊗ LOG2E)."""
        return constants.qmul(self.softmax_scale(d))

    def pass1_consts(self) -> constants.Pass1Consts:
        """§7.4–7.10 constants (binary32), shared by the emulator and the kernel's parameters."""
        return constants.pass1_consts(self.eps, self.delta, self.tau)

    def cert_consts(self, d: int) -> constants.CertConsts:
        """§9.7 constants (binary32), shared by the emulator and the kernel's parameters."""
        p2_out = "exact" if self.mma == "exact" else self.p2_accum
        return constants.cert_consts(d, p2_out, self._f16_scores(), self.exp2 == "fast", self.delta)

    def est_consts(self, d: int) -> constants.EstConsts:
        """§9.8 constants (binary32), shared by the emulator and the kernel's parameters."""
        p2_out = "exact" if self.mma == "exact" else self.p2_accum
        return constants.est_consts(d, p2_out, self._f16_scores(), self.quant_p)

    def _f16_scores(self) -> bool:
        """§8.1: pass 2's scores in FP16 accumulation (binary32 under ``p2_scores="f32"`` or ``exact``)."""
        return self.mma != "exact" and self.p2_scores == "f16"

    # Each toggle a pass reads, lowered here once: the emulator (its prep, P1Mode, P2Mode) and the
    # kernel's parameter structs (apa_gpu/plan.py) take the same values by the same names.
    def flags(self) -> constants.Flags:
        """Every toggle, lowered by the methods below: what the emulator's prep and passes read."""
        return constants.Flags(self.prep_flags(), self.pass1_flags(), self.pass2_flags(), self.model_flags())

    def prep_flags(self) -> constants.PrepFlags:
        """§5's toggles, as cuda/apa.cu PrepParams carries them."""
        q_mode = (constants.Q_OFF if not self.quant_q
                  else constants.Q_FP8 if self.q_format == "fp8" else constants.Q_NVFP4)
        return constants.PrepFlags(
            q_mode=q_mode, q_terms=self.q_terms, quant_k=self.quant_k, quant_v=self.quant_v,
            lsq=self.block_scale == "lsq", interleaved=self.p_groups == "interleaved", v_f16=self.v_f16,
            p2_lanes=self.p2_shift == "lanes", pad_vote=self.pad_vote, fma=self.fma)

    def pass1_flags(self) -> constants.Pass1Flags:
        """§7's toggles, as cuda/pass1.cuh Pass1Args carries them."""
        return constants.Pass1Flags(
            ascending=self.tile_order == "ascending", pow2=self.p_scale == "pow2",
            interleaved=self.p_groups == "interleaved", quant_p=self.quant_p, output=self.hot_test == "output",
            budget=self.hot_test == "budget",
            fma=self.fma, pad_vote=self.pad_vote,
            direct=self.direct_store and self.eps >= 0)  # §9.5: with ε < 0 every active tile is hot

    def pass2_flags(self) -> constants.Pass2Flags:
        """§8–9's toggles, as cuda/pass2.cuh Pass2Args carries them."""
        return constants.Pass2Flags(all_hot=self.eps < 0, fma=self.fma, direct=self.pass1_flags().direct)

    def model_flags(self) -> constants.ModelFlags:
        """The MMA (§3), exp2 (§2) and pass-2 accumulator (§8.1, §8.5) models, which no kernel struct carries."""
        return constants.ModelFlags(model=constants.MODELS[self.mma], soft=self.exp2 == "soft",
                                    f32_out=self.p2_accum == "f32", f32_scores=self.p2_scores == "f32")

    @classmethod
    def seed(cls, **changes) -> "Config":
        """The seed's (APA 0.6.1) arithmetic as far as the spec models it (numerics.md §12): its FP4 MMA
        (``mma="sm120"``, two chained Q MMAs), its FMA sites, interleaved P groups, f16(v/vg), sampled K
        statistics, voting padding rows, the per-lane pass-2 shift, the direct-store epilogue and the
        GPU's ex2.approx (``exp2="fast"``, §13's models). What it cannot reproduce is listed in §12 ("seed preset")."""
        return dataclasses.replace(cls(**SEED_TOGGLES), **changes)

    @classmethod
    def from_overrides(cls, items: list[str], base: "Config | None" = None) -> "Config":
        """Build a config from ``key=value`` strings (the CLI's ``--config`` toggles); ``preset=seed``
        starts from Config.seed() and must come first."""
        base = base or cls()
        if items and items[0].replace(" ", "").lower().startswith("preset="):
            name = items[0].partition("=")[2].strip()
            if name != "seed":
                raise ValueError(f"--config {items[0]!r}: the one preset is 'seed' (numerics.md §12)")
            base, items = cls.seed(), items[1:]
        fields = {f.name: f for f in dataclasses.fields(cls)}
        changes = {}
        for item in items:
            key, sep, raw = item.partition("=")
            key = key.strip().replace("-", "_")
            if key == "preset":
                raise ValueError(f"--config {item!r}: a preset must come first, before the toggles it starts from")
            if not sep or key not in fields:
                raise ValueError(f"--config {item!r}: expected key=value with key one of {', '.join(fields)}")
            current = getattr(base, key)
            raw = raw.strip()
            if isinstance(current, bool):
                if raw.lower() not in ("1", "0", "true", "false", "on", "off", "yes", "no"):
                    raise ValueError(f"--config {item!r}: {key} expects on/off")
                changes[key] = raw.lower() in ("1", "true", "on", "yes")
            elif key in CHOICES:
                changes[key] = raw
            else:
                kind = int if isinstance(current, int) else float
                if key == "scale" and raw.lower() == "none":
                    changes[key] = None
                    continue
                try:
                    changes[key] = kind(raw)
                except ValueError:
                    raise ValueError(f"--config {item!r}: {key} expects {'an integer' if kind is int else 'a number'}"
                                     ) from None
        return dataclasses.replace(base, **changes)
