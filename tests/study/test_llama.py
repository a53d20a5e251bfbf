"""The NumPy SmolLM2 forward pass: attention against torch SDPA, RoPE layout against llama.cpp's
convention, perplexity and a greedy answer on the real model, and (slow) logits and post-RoPE Q/K
against Hugging Face transformers' own GGUF loader."""

import numpy as np
import pytest
from helpers import perplexity

from apa_emu.study.dump import read_dump
from apa_emu.study.lm import rope_tables
from apa_emu.study.smollm2 import _rope, _unpermute_rope_rows, causal_attention


TEXT = (
    "The river rose through the night, and by morning the lower fields were under water. "
    "The farmers moved their animals to the hill behind the church, where the ground stayed dry."
)


@pytest.fixture(scope="module")
def model():
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    from apa_emu.study.smollm2 import load_smollm2, smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return load_smollm2()


@pytest.mark.parametrize(
    "n, kv, nh, nkv, q_offset", [(37, 37, 9, 3, 0), (300, 700, 4, 1, 400), (5, 9, 2, 2, 4)]
)
def test_attention_matches_torch_sdpa(n, kv, nh, nkv, q_offset):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(n)
    q = rng.standard_normal((n, nh, 64), dtype=np.float32) * 2
    k = rng.standard_normal((kv, nkv, 64), dtype=np.float32) * 2
    v = rng.standard_normal((kv, nkv, 64), dtype=np.float32)
    mask = torch.arange(kv)[None, :] <= (q_offset + torch.arange(n))[:, None]
    g = nh // nkv
    ref = torch.nn.functional.scaled_dot_product_attention(
        torch.from_numpy(q).double().transpose(0, 1),
        torch.from_numpy(k).double().repeat_interleave(g, dim=1).transpose(0, 1),
        torch.from_numpy(v).double().repeat_interleave(g, dim=1).transpose(0, 1),
        attn_mask=mask,
    ).transpose(0, 1)
    np.testing.assert_allclose(causal_attention(q, k, v, q_offset), ref.numpy(), atol=2e-5)


def test_unpermuted_rotate_half_rope_equals_llama_cpp_interleaved_rope():
    # llama.cpp applies RoPE to adjacent channel pairs (2i, 2i+1) of the GGUF's permuted rows; the
    # module applies rotate-half RoPE to unpermuted rows. Both must give the same vectors up to the
    # channel order, and therefore the same scores.
    rng = np.random.default_rng(0)
    n_head, hd, T = 3, 64, 50
    w_gguf = rng.standard_normal((n_head * hd, 16))
    x = rng.standard_normal((T, 16))
    base = 100000.0
    theta = base ** (-np.arange(0, hd, 2) / hd)
    angle = np.arange(T)[:, None, None] * theta[None, None, :]
    y = (x @ w_gguf.T).reshape(T, n_head, hd)
    even, odd = y[..., 0::2], y[..., 1::2]
    interleaved = np.empty_like(y)
    interleaved[..., 0::2] = even * np.cos(angle) - odd * np.sin(angle)
    interleaved[..., 1::2] = even * np.sin(angle) + odd * np.cos(angle)
    cos, sin = rope_tables(T, hd, base)
    ours = _rope((x @ _unpermute_rope_rows(w_gguf, n_head).T).reshape(T, n_head, hd), cos, sin)
    order = np.concatenate([np.arange(0, hd, 2), np.arange(1, hd, 2)])
    np.testing.assert_allclose(ours, interleaved[..., order], atol=1e-5)


def test_tokenizer(model):
    ids = model.tokenize("<|im_start|>user 2024 was fine")
    assert ids[0] == 1  # the control token, not its characters
    assert [model.detokenize([i]) for i in ids[3:7]] == ["2", "0", "2", "4"]  # digits split one by one
    assert model.detokenize(model.tokenize(TEXT)) == TEXT


def test_perplexity_and_greedy_answer(model):
    from apa_emu.study.smollm2 import sample_text_path

    tokens = model.tokenize(sample_text_path().read_text(encoding="utf-8"))[:512]
    assert 10 < model.perplexity(tokens) < 40
    answer = model.detokenize(model.generate(model.tokenize("The capital of France is"), 2))
    assert "Paris" in answer


def test_make_dumps(model, tmp_path):
    from apa_emu.study.smollm2 import make_dumps

    tokens = model.tokenize(TEXT)
    paths = make_dumps(
        TEXT, layers=[20, 2], n_query=8, out_dir=tmp_path / "out", max_tokens=1000, model=model
    )
    T = tokens.size
    assert [p.name for p in paths] == [f"smollm2_L2_kv{T}_n8.apadump", f"smollm2_L20_kv{T}_n8.apadump"]
    _, captured = model.forward(tokens, capture=[2])
    d = read_dump(paths[0])
    assert d.header() == dict(n=8, kv=T, nh=9, nkv=3, hd=64, off=T - 8)
    q, k, v = captured[2]
    for ours, ref in ((d.q, q[T - 8 :]), (d.k, k), (d.v, v)):
        np.testing.assert_array_equal(ours, ref.astype(np.float16))
    # The dump's own rows through float32 attention give back the captured layer's attention.
    att = causal_attention(d.q.astype(np.float32), d.k.astype(np.float32), d.v.astype(np.float32), d.q_offset)
    np.testing.assert_allclose(att, causal_attention(q, k, v)[T - 8 :], atol=2e-2)
    short = make_dumps(TEXT, layers=[0], n_query=4, out_dir=tmp_path, max_tokens=10, model=model)
    assert read_dump(short[0]).kv == 10


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(layers=[30]), r"layers \[30\] out of range: the model has layers 0..29"),
        (dict(layers=[]), "layers is empty"),
        (dict(n_query=10_000), "n_query = 10000: must be in 1.."),
        (dict(max_tokens=8193), "max_tokens = 8193: must be in 1..8192"),
    ],
)
def test_make_dumps_rejects(model, tmp_path, kwargs, message):
    from apa_emu.study.smollm2 import make_dumps

    args = dict(layers=[1], n_query=4, out_dir=tmp_path, max_tokens=64, model=model)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        make_dumps(TEXT, **args)


@pytest.mark.slow
def test_matches_transformers_gguf_loader(model):
    """transformers dequantizes the same GGUF, reverses the Q/K permutation itself, builds its own
    tokenizer from the GGUF vocabulary and runs its own PyTorch Llama: an independent path."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from apa_emu.study.smollm2 import sample_text_path, smollm2_gguf_path

    path = smollm2_gguf_path()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    text = sample_text_path().read_text(encoding="utf-8")
    ids = model.tokenize(text)
    assert list(ids) == tok(text, add_special_tokens=False)["input_ids"]
    ids = ids[:512]
    layer = 14
    seen = {}
    attn = hf.model.layers[layer].self_attn
    hooks = [
        attn.q_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("q", o)),
        attn.k_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("k", o)),
    ]
    with torch.no_grad():
        ref = hf(torch.from_numpy(ids)[None]).logits[0].double().numpy()
        cos, sin = hf.model.rotary_emb(seen["q"], torch.arange(ids.size)[None])
        hf_q, hf_k = apply_rotary_pos_emb(
            seen["q"].view(1, -1, 9, 64).transpose(1, 2),
            seen["k"].view(1, -1, 3, 64).transpose(1, 2),
            cos,
            sin,
        )
    for h in hooks:
        h.remove()
    hidden, captured = model.forward(ids, capture=[layer])
    ours = model.logits(hidden).astype(np.float64)
    assert np.abs(ours - ref).max() < 2e-3
    assert (ours.argmax(axis=1) == ref.argmax(axis=1)).all()

    assert perplexity(ours, ids) == pytest.approx(perplexity(ref, ids), rel=1e-4)
    q, k, _ = captured[layer]
    np.testing.assert_allclose(q, hf_q[0].transpose(0, 1).numpy(), atol=2e-3)
    np.testing.assert_allclose(k, hf_k[0].transpose(0, 1).numpy(), atol=2e-3)


@pytest.mark.slow
def test_builtin_dump_reproduces(model, tmp_path):
    """The shipped dump is what the documented command writes (up to BLAS rounding, then FP16)."""
    from apa_emu.study.dump import builtin_dump_path
    from apa_emu.study.smollm2 import make_dumps

    (path,) = make_dumps(None, layers=[14], n_query=512, out_dir=tmp_path, max_tokens=2048, model=model)
    fresh, shipped = read_dump(path), read_dump(builtin_dump_path())
    assert fresh.header() == shipped.header()
    for a, b in ((fresh.q, shipped.q), (fresh.k, shipped.k), (fresh.v, shipped.v)):
        np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=2e-3, atol=2e-3)
