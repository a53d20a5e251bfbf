"""A deliberately wrong APA: the emulator with one rounding changed, as a compiler's contraction of a
multiply and an add into an FMA changes it. It claims bit-exactness, so
``apa check --engine user_engines.wrong_rounding:attention`` compares it bitwise and must catch it.

The change: numerics.md rounds the product and the sum apart at the seed's FMA sites (the P-scale
exponent of pass 1, §7.4, and the merge numerator, §9); this engine rounds once there, as
``Config(fma=True)`` models, where the config says it does not (and twice where it says once). The
first value it changes is a pass-1 visit record of the warp, tile and row where a product's rounding
decides the result.
"""

import apa_emu
from apa_emu import Config
from apa_emu.engines import engine


@engine(name="wrong-rounding", features={"window", "paging", "varlen", "trace"}, bitexact=True)
def attention(q, k, v, q_offset=0, config=None, **kwargs):
    config = config or Config()
    return apa_emu.attention(q, k, v, q_offset, config.replace(fma=not config.fma), **kwargs)
