"""An independent approximation of APA: PyTorch fake-quant attention in the style of NVIDIA
Model-Optimizer's NVFP4 attention quantization. Q, K and V are quantized to NVFP4 (E2M1 values in
blocks of 16 channels, an E4M3 scale per block under a per-tensor scale), the softmax probabilities P
likewise in blocks of 16 keys, then attention runs in float32. No tile is ever recomputed exactly:
where APA keeps a tile hot (FP16, numerics.md §8) this engine stays FP4, so it departs from APA most
where APA is exact.

It returns the output array alone and claims no bit-exactness: ``apa check`` compares it in tolerance.
"""

import numpy as np
import torch

from apa_emu import Config

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
BLOCK = 16


def nvfp4(x: torch.Tensor) -> torch.Tensor:
    """x fake-quantized to NVFP4 along its last axis (padded to a multiple of 16 with zeros)."""
    pad = -x.shape[-1] % BLOCK
    blocks = torch.nn.functional.pad(x, (0, pad)).reshape(*x.shape[:-1], -1, BLOCK)
    global_scale = blocks.abs().amax().clamp(min=1e-30) / (6.0 * 448.0)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    scale = (amax / 6.0 / global_scale).to(torch.float8_e4m3fn).to(torch.float32) * global_scale
    scaled = torch.where(scale > 0, blocks / scale, torch.zeros_like(blocks))
    nearest = (scaled.abs().unsqueeze(-1) - E2M1).abs().argmin(dim=-1)
    q = torch.sign(scaled) * E2M1[nearest] * scale
    return q.reshape(*x.shape[:-1], -1)[..., :x.shape[-1]]


def attention(q, k, v, q_offset=0, config=None):
    config = config or Config()
    squeeze = q.ndim == 3
    q, k, v = (torch.from_numpy(np.asarray(x, np.float32)) for x in (q, k, v))
    if squeeze:
        q, k, v = q[None], k[None], v[None]
    G = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(G, dim=2) for x in (k, v))
    qh, kh, vh = (nvfp4(x).transpose(1, 2) for x in (q, k, v))  # [B, H, rows, d]
    scores = qh @ kh.transpose(-1, -2) * float(config.softmax_scale(q.shape[-1]))
    n, S = q.shape[1], k.shape[1]
    visible = torch.arange(S)[None, :] <= q_offset + torch.arange(n)[:, None]
    p = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    out = (nvfp4(p) @ vh).transpose(1, 2)
    out = out[0] if squeeze else out
    return out.to(torch.float16).numpy()
