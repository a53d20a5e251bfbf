"""apa_emu: the bit-exact reference emulator of APA attention for sm_90 (see docs/numerics.md)."""

from .api import Result, attention, validate
from .config import Config
from .metrics import pair_metrics, summarize
from .reference import reference, reference_rows

__all__ = ["Config", "Result", "attention", "validate", "reference", "reference_rows", "pair_metrics", "summarize"]
