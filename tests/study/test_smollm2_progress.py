"""The SmolLM2 dump maker reports its progress layer by layer and checks the text before it loads the
model; checked on a tiny random Llama, so no GGUF is needed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from apa_emu.study import smollm2
from apa_emu.study.dump import read_dump
from apa_emu.study.lm import HParams
from apa_emu.study.smollm2 import Llama, make_dumps


class TinyLlama(Llama):
    """Random weights in the layout ``Llama.forward`` reads; one token per character."""

    def __init__(self, n_layer=3, vocab=64):
        rng = np.random.default_rng(0)
        self.hp = HParams(n_layer=n_layer, n_embd=128, n_head=2, n_head_kv=1, head_dim=64, n_ff=32, n_ctx=256,
                          rope_base=10000.0, rms_eps=1e-5)
        w = lambda *shape: (0.1 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
        self.embd = w(vocab, 128)
        self.out_norm = np.ones(128, np.float32)
        self.layers = [dict(attn_norm=np.ones(128, np.float32), wqkv=w(128 + 64 + 64, 128), wo=w(128, 128),
                            ffn_norm=np.ones(128, np.float32), wgu=w(64, 128), wdown=w(128, 32))
                       for _ in range(n_layer)]

    def tokenize(self, text):
        return np.frombuffer(text.encode(), np.uint8).astype(np.int64) % self.embd.shape[0]


def test_progress_follows_the_layers(tmp_path):
    steps = []
    (path,) = make_dumps("a short text of some forty characters....", [1], 8, tmp_path, 40, model=TinyLlama(),
                         progress=lambda done, total: steps.append((done, total)))
    assert steps == [(1, 3), (2, 3), (3, 3)]
    assert read_dump(path).header() == dict(n=8, kv=40, nh=2, nkv=1, hd=64, off=32)


def test_bad_text_fails_before_the_model_loads(tmp_path, monkeypatch):
    def no_model():
        raise AssertionError("the model was loaded before the text was read")

    monkeypatch.setattr(smollm2, "load_smollm2", no_model)
    with pytest.raises(OSError, match="a directory, not a regular file"):
        make_dumps(Path(tmp_path), [1], 8, tmp_path / "out")
