"""SageAttention 1.0.6's real kernels as an apa_emu engine whose reference is the SageAttention recipe
(apa_emu.peers.sageattn, numerics.md §14), not APA: ``apa check --engine sageattention`` compares the
two bitwise. Registered as "sageattention" in the entry point group ``apa_emu.engines``; a checkout run
with PYTHONPATH names it in ``APA_ENGINES=sageattention=apa_gpu.sageattention:SageEngine``. It needs
``pip install -e ".[sage]"`` (sageattention==1.0.6) with the machine's torch and Triton, and a CUDA
device.

The engine calls ``sageattention.sageattn(q, k, v, tensor_layout="NHD", is_causal=True)`` on CUDA torch
tensors of one batch element. The wrapper subtracts the K mean from its k in place (``k -= km``,
§14.2), so it gets a clone of k. The recipe takes that mean from outside the Triton kernels: the engine
computes it with the wrapper's own torch call, ``k.mean(dim=1, keepdim=True)`` on a tensor of the same
shape, strides and device, just before the call, and after it confirms that the wrapper's clone holds
exactly ``k - km``, so that the km it returns is the one the kernel saw.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import numpy as np

from apa_emu.engines import Engine, EngineError
from apa_emu.peers import PeerRun

VERSION = "1.0.6"  # the release whose Triton kernels numerics.md §14 reads
HEAD_DIMS = (64, 128)  # its kernels the recipe emulates (hd96 has kernels of its own, not emulated)


def sage_missing() -> str | None:
    """What running SageAttention lacks here, in one line (None: nothing)."""
    for module in ("torch", "triton", "sageattention"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install -e '.[sage]': sageattention=={VERSION}, torch and Triton)"
    version = importlib.metadata.version("sageattention")
    if version != VERSION:
        return f"sageattention {version} is installed; the recipe is {VERSION}'s (pip install sageattention=={VERSION})"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch"
    return None


class SageEngine(Engine):
    """``sageattn`` causal on FP16 inputs of head dim 64 or 128, one batch element, on the current CUDA
    device; its reference is the recipe ``sageattention`` (apa_emu.peers)."""

    name = "sageattention"
    recipe = "sageattention"
    head_dims = HEAD_DIMS
    wait = "the first run compiles SageAttention's Triton kernels"

    @classmethod
    def missing(cls):
        return sage_missing()

    @classmethod
    def lacks(cls, config, d):
        if d not in HEAD_DIMS:
            return (f"engine sageattention does not run head dim {d} (SageAttention {VERSION}'s emulated kernels: "
                    f"{', '.join(map(str, HEAD_DIMS))})")
        return None

    def run(self, call, config, *, progress=None):
        raise EngineError("engine sageattention implements SageAttention's recipe, not numerics.md: "
                          "apa check --engine sageattention runs it against that recipe")

    def run_peer(self, q, k, v) -> PeerRun:
        """The output [n, h_q, d] and the K mean [h_k, d] of ``sageattn`` on q [n, h_q, d], k, v
        [n, h_k, d] (NumPy or CUDA torch tensors, FP16), which it leaves unchanged."""
        import torch
        from sageattention import sageattn

        qt, kt, vt = (_device(x)[None] for x in (q, k, v))  # NHD with a batch of one
        smoothed = kt.clone()  # the wrapper's k -= km lands here
        km = kt.mean(dim=1, keepdim=True)  # the wrapper's own call (core.py, seq_dim 1 for NHD)
        out = sageattn(qt, smoothed, vt, tensor_layout="NHD", is_causal=True)
        torch.cuda.synchronize()
        if not torch.equal(smoothed, kt - km):
            raise EngineError("engine sageattention: the wrapper's k -= km is not k - k.mean(dim=1) as computed "
                              "here, so its K mean cannot be handed to the recipe")
        return PeerRun(out[0], {"km": km[0, 0]})


def _device(x):
    """x as a contiguous CUDA torch tensor (a NumPy array copied there, a tensor as it is)."""
    import torch

    if isinstance(x, torch.Tensor):
        return x.contiguous()
    return torch.from_numpy(np.ascontiguousarray(x)).to("cuda")
