"""apa model and its library (apa_emu.study.endtoend): a tiny random Llama run through the real forward
pass with its attention swapped; the base against itself gives KLD 0; an FP16 attention's measures
equal torch's float64 KL divergence, cross-entropy and softmax computed here from logits obtained
without the library; a planted bug in one layer's engine shows in that layer's row of the per-layer
swap; on the real SmolLM2 (when installed), the bad inputs are one line each and the JSON holds its
keys."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import one_error_line

from apa_emu.study import endtoend, versus
from apa_emu.study.cli import main
from apa_emu.study.lm import HParams
from apa_emu.study.smollm2 import Llama

torch = pytest.importorskip("torch")
VOCAB, T = 97, 96


def tiny_llama(n_layer: int = 3, seed: int = 0) -> Llama:
    """A Llama of random weights (head dim 64, 2 query heads on 1 KV head), built without a GGUF."""
    rng = np.random.default_rng(seed)
    m = Llama.__new__(Llama)
    m.hp = HParams(n_layer=n_layer, n_embd=128, n_head=2, n_head_kv=1, head_dim=64, n_ff=96, n_ctx=4096,
                   rope_base=10000.0, rms_eps=1e-5)

    def w(*shape, gain=1.0):
        return (rng.standard_normal(shape) * gain / np.sqrt(shape[-1])).astype(np.float32)

    ones = np.ones(128, np.float32)
    m.embd = w(VOCAB, 128, gain=8.0)
    m.out, m.out_norm = m.embd, ones
    m.layers = [dict(attn_norm=ones, wqkv=w(256, 128, gain=3.0), wo=w(128, 128), ffn_norm=ones, wgu=w(192, 128),
                     wdown=w(128, 96)) for _ in range(n_layer)]
    return m


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(1).integers(0, VOCAB, T)


def _f16_attention(q, k, v):
    """FP16 inputs, float64 causal attention, FP16 output: fp16-exact written here."""
    q, k, v = (x.astype(np.float16).astype(np.float64) for x in (q, k, v))
    n, nh, d = q.shape
    kk, vv = (np.repeat(x, nh // k.shape[1], axis=1) for x in (k, v))
    s = np.einsum("nhd,khd->hnk", q, kk) / np.sqrt(d)  # ok: test oracle
    s[:, np.arange(n)[None, :] > np.arange(n)[:, None]] = -np.inf
    p = np.exp(s - s.max(axis=2, keepdims=True))
    out = np.einsum("hnk,khd->nhd", p / p.sum(axis=2, keepdims=True), vv)  # ok: test oracle
    return out.astype(np.float16).astype(np.float32)


def test_the_base_against_itself_is_exactly_zero(model, tokens):
    passes = endtoend.Passes(model, tokens, 2)
    p = passes.measure(model.attend)  # the hook given the model's own attention
    assert np.all(p.kld == 0) and p.same_top.all() and np.all(p.dp == 0)
    (row,) = endtoend.buckets(p)
    assert row["bucket"] == "<= 2k" and row["positions"] == T - 1 and row["nonfinite"] == 0
    assert row["kld_mean"] == 0 and row["kld_p999"] == 0 and row["same_top"] == 100.0
    assert row["ppl_ratio"] == 1.0 and row["rms_dp"] == 0.0


def test_an_fp16_attention_matches_torch_from_independent_logits(model, tokens):
    passes = endtoend.Passes(model, tokens, 2)
    exact = versus.parse_spec("fp16-exact")()
    from apa_emu.engines import CpuEngine

    (run,) = endtoend.every_layer(passes, [exact], CpuEngine(1))
    p = run.positions
    z0, z1 = (torch.from_numpy(model.forward(tokens, attend=a)[0] @ model.out.T).double()[:-1]  # ok: test oracle
              for a in (None, lambda i, q, k, v: _f16_attention(q, k, v)))
    lp0, lp1 = torch.log_softmax(z0, 1), torch.log_softmax(z1, 1)
    kld = torch.nn.functional.kl_div(lp1, lp0, reduction="none", log_target=True).sum(1).numpy()
    np.testing.assert_allclose(p.kld, kld, rtol=1e-6, atol=1e-12)
    assert kld.mean() > 0
    ref = torch.from_numpy(tokens[1:])
    ce0, ce1 = (torch.nn.functional.cross_entropy(z, ref).item() for z in (z0, z1))
    row = endtoend.summary(p)
    np.testing.assert_allclose(row["ppl_ratio"], np.exp(ce1 - ce0), rtol=1e-9)
    assert row["same_top"] == 100.0 * (z0.argmax(1) == z1.argmax(1)).double().mean().item()
    dp = (lp1.exp() - lp0.exp())[torch.arange(T - 1), ref].numpy()
    np.testing.assert_allclose(row["rms_dp"], np.sqrt(np.mean(dp**2)), rtol=1e-6)
    np.testing.assert_allclose(row["kld_p99"], np.quantile(kld, 0.99), rtol=1e-6)


class _PlantedBug(versus.Exact):
    """fp16-exact, except that its ``bad``-th call returns the output with its heads swapped."""

    def __init__(self, bad: int):
        super().__init__()
        self.bad, self.calls = bad, 0

    def call(self, ref):
        out = super().call(ref)
        self.calls += 1
        return out[:, ::-1] if self.calls == self.bad + 1 else out


def test_a_planted_bug_in_one_layer_shows_in_its_row_of_the_per_layer_swap(model, tokens):
    from apa_emu.engines import CpuEngine

    passes = endtoend.Passes(model, tokens, 1 + model.hp.n_layer)
    (by_layer,) = endtoend.per_layer(passes, [_PlantedBug(bad=1)], CpuEngine(1)).values()
    kld = {layer: s["kld_mean"] for layer, s in by_layer.items()}
    assert list(kld) == [0, 1, 2]
    assert kld[1] > 100 * max(kld[0], kld[2]) and kld[0] > 0 and kld[2] > 0


def test_a_nonfinite_logit_is_counted_never_averaged():
    z0 = np.array([[0.0, 1.0, 2.0], [1.0, 0.0, 0.0]])
    z1 = np.array([[0.0, 1.0, np.inf], [1.0, 0.5, 0.0]])
    p = endtoend.Positions(*endtoend._block(z0, z1, np.array([2, 0])))
    row = endtoend.summary(p)
    assert row["nonfinite"] == 1 and row["positions"] == 2
    lp0, lp1 = (np.log(np.exp(z) / np.exp(z).sum()) for z in (z0[1], z1[1]))
    np.testing.assert_allclose(row["kld_mean"], np.sum(np.exp(lp0) * (lp0 - lp1)), rtol=1e-12)


def test_the_measures_of_torch_logits_are_numpys():
    """A torch model's logits are measured where they lie (torch.float64); the numbers are NumPy's."""
    rng = np.random.default_rng(5)
    z0, z1 = rng.normal(0, 4, (2, 6, 50))
    z1[3, 7] = np.nan
    ref = rng.integers(0, 50, 6)
    want = endtoend._block(z0, z1, ref)
    got = endtoend._block(torch.from_numpy(z0), torch.from_numpy(z1), ref)
    assert not want[-1][3] and want[-1].sum() == 5  # the non-finite row was met
    for w, g in zip(want, got):
        assert isinstance(g, np.ndarray) and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-15)


@pytest.fixture(scope="module")
def smollm2():
    for name in ("gguf", "tokenizers", "rich"):
        pytest.importorskip(name)
    from apa_emu.study.smollm2 import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_bad_inputs_are_one_line_each(smollm2, capsys, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Alice was beginning to get very tired.", encoding="utf-8")
    one_error_line(capsys, ["model", "--engines", "flash"], "engine 'flash': expected one of")
    one_error_line(capsys, ["model", "--engines", "fp16-exact", "--plot-dir", str(tmp_path / "no")],
                   "--plot-dir ")
    one_error_line(capsys, ["model", "--engines", "fp16-exact", "--text", str(tmp_path / "none.txt")], "")
    one_error_line(capsys, ["model", "--engines", "fp16-exact", "--text", str(short), "--tokens", "64"],
                   f"{short} has ")
    one_error_line(capsys, ["model", "--engines", "fp16-exact", "--tokens", "9000"], "--tokens 9000: past the")


def test_json_keys_and_plot_on_smollm2(smollm2, capsys, tmp_path):
    out = tmp_path / "m.json"
    argv = ["model", "--engines", "fp16-exact", "--tokens", "24", "--backend", "cpu", "--json", str(out),
            "--plot-dir", str(tmp_path), "--per-layer"]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert {"model", "text", "tokens", "backend", "config", "swapped_layers", "engines", "per_layer", "columns",
            "plots"} <= set(data)
    (eng,) = data["engines"]
    assert eng["engine"] == "fp16-exact" and len(eng["kld_by_position"]) == 23
    assert set(eng["buckets"][0]) == {"bucket", *list(data["columns"])[2:-2], "positions", "nonfinite"}
    assert [r["layer"] for r in data["per_layer"]["fp16-exact"]] == list(range(30))
    assert all((tmp_path / f"model_smollm2_24_{k}.png").is_file() for k in ("positions", "per_layer"))
    one_error_line(capsys, ["model", "--engines", "fp16-exact", "--tokens", "24", "--plot-dir", str(tmp_path)],
                   f"--plot-dir {tmp_path}: model_smollm2_24_positions.png exists already")


def test_eps_grid_runs_each_test_and_draws_the_frontier(smollm2, capsys, tmp_path):
    out = tmp_path / "g.json"
    argv = ["model", "--eps-grid", "1e9", "-1", "--hot-tests", "mass", "budget", "--engines", "fp16-exact",
            "--tokens", "24", "--backend", "cpu", "--json", str(out), "--plot-dir", str(tmp_path),
            "--record", str(tmp_path / "page.md")]
    assert main(argv) == 0
    runs = {e["engine"]: e for e in json.loads(out.read_text())["engines"]}
    page = (tmp_path / "page.md").read_text(encoding="utf-8")
    assert page.count("\n## ") == 1 and "- Commit: " in page and "| engine | bucket | positions | ppl_ratio" in page
    assert f"Plot: `{tmp_path / 'model_smollm2_24_frontier.png'}`" in page
    grid = [f"apa:hot_test={t},eps={e}" for t in ("mass", "budget") for e in ("1e+09", "-1")]
    assert list(runs) == ["fp16-exact", *grid]
    kld = {s: runs[s]["buckets"][-1]["kld_mean"] for s in grid}
    for test in ("mass", "budget"):  # pure FP4 recomputes nothing and is the worst; ε < 0 recomputes every tile
        assert runs[f"apa:hot_test={test},eps=1e+09"]["hot_share"] == 0
        assert runs[f"apa:hot_test={test},eps=-1"]["hot_share"] == 1
        assert kld[f"apa:hot_test={test},eps=1e+09"] > 10 * kld[f"apa:hot_test={test},eps=-1"]
    assert (tmp_path / "model_smollm2_24_frontier.png").is_file()
    one_error_line(capsys, ["model"], "no engine: give --engines, --eps-grid, or both")
