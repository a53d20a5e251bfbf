"""Stand-ins for a peer kernel's engine (apa_emu.peers), CPU only: ``Faithful`` returns the SageAttention
recipe's own output, ``OneBitOff`` the same with one bit of one element flipped, ``EditsK`` changes its k
in place, as SageAttention's wrapper does to the k it is given. ``FLIP`` is the element flipped:
(row, query head, channel) of the problem as the engine sees it, each clipped to the output's shape."""

import numpy as np

from apa_emu.engines import Engine
from apa_emu.peers import PeerRun
from apa_emu.peers import sageattn as sa

FLIP = (130, 1, 5)


class Faithful(Engine):
    name = "faithful-sage"
    recipe = "sageattention"
    head_dims = (64, 128)

    def run_peer(self, q, k, v):
        km = sa.k_mean(k)
        return PeerRun(sa.run(q, k, v, km=km).out, {"km": km})


class OneBitOff(Faithful):
    name = "one-bit-off"

    def run_peer(self, q, k, v):
        res = Faithful.run_peer(self, q, k, v)
        out = res.out.copy()
        out.view(np.uint16)[tuple(min(i, size - 1) for i, size in zip(FLIP, out.shape))] ^= 1
        return PeerRun(out, res.inputs)


class EditsK(Faithful):
    name = "edits-k"

    def run_peer(self, q, k, v):
        res = Faithful.run_peer(self, q, k, v)
        k -= res.inputs["km"]  # the wrapper's k -= km on the k it was handed
        return res
