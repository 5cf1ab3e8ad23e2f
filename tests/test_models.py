"""Model zoo: each FFN kind against its formula, every variant's forward/backward, placement, accounting."""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from stem import config as C
from stem.models.spec import ModelConfig, RopeScaling, model_config, resolve_placement
from stem.models.ffn import HashMoEFFN, balanced_expert_map, build_ffn
from stem.models.model import KVCache, build_model
from conftest import reshaped

TINY = dict(vocab_size=97, d_model=16, n_layers=6, n_heads=4, n_kv_heads=2, d_ff=24, max_seq_len=64)


def _cfg(**kw):
    return ModelConfig.from_dict({**TINY, **kw})


@pytest.fixture
def xs():
    torch.manual_seed(0)
    return torch.randn(2, 5, 16), torch.randint(0, 97, (2, 5))


def test_dense_swiglu_formula(xs):
    x, ids = xs
    f = build_ffn("dense", _cfg(), 0)
    expected = (F.silu(x @ f.w_gate.weight.T) * (x @ f.w_up.weight.T)) @ f.w_down.weight.T
    torch.testing.assert_close(f(x, ids), expected)


def test_stem_formula(xs):
    x, ids = xs
    f = build_ffn("stem", _cfg(), 0)
    u = f.table.weight[ids]
    torch.testing.assert_close(f(x, ids), (F.silu(x @ f.w_gate.weight.T) * u) @ f.w_down.weight.T)
    assert not hasattr(f, "w_up")


def test_stem_gate_formula(xs):
    x, ids = xs
    f = build_ffn("stem_gate", _cfg(), 0)
    u = f.table.weight[ids]
    torch.testing.assert_close(f(x, ids), (F.silu(u) * (x @ f.w_up.weight.T)) @ f.w_down.weight.T)


def test_stem_dagger_formula(xs):
    x, ids = xs
    f = build_ffn("stem_dagger", _cfg(), 0)
    u = f.table.weight[ids]
    expected = (F.silu(x @ f.w_gate.weight.T) * (x @ f.w_up.weight.T + u)) @ f.w_down.weight.T
    torch.testing.assert_close(f(x, ids), expected)


def test_hashmoe_routes_each_token_to_its_fixed_expert(xs):
    x, ids = xs
    f = build_ffn("hashmoe", _cfg(n_experts=4), 3)
    torch.nn.init.normal_(f.w_gate), torch.nn.init.normal_(f.w_up), torch.nn.init.normal_(f.w_down)
    out = f(x, ids)
    for b in range(2):
        for t in range(5):
            e = f.expert_of_token[ids[b, t]]
            h = x[b, t]
            y = (F.silu(f.w_gate[e] @ h) * (f.w_up[e] @ h)) @ f.w_down[e].T
            torch.testing.assert_close(out[b, t], y, rtol=1e-5, atol=1e-4)


def test_expert_map_is_balanced_seeded_and_per_layer():
    m = balanced_expert_map(1000, 16, seed=3)
    counts = torch.bincount(m, minlength=16)
    assert counts.max() - counts.min() <= 1
    assert torch.equal(m, balanced_expert_map(1000, 16, seed=3))
    a, b = HashMoEFFN(_cfg(n_experts=4), 2), HashMoEFFN(_cfg(n_experts=4), 5)
    assert not torch.equal(a.expert_of_token, b.expert_of_token)


def test_stem_table_init_is_xavier_normal_by_default():
    cfg = ModelConfig.from_dict({**TINY, "vocab_size": 4000, "d_ff": 256})
    std = build_ffn("stem", cfg, 0).table.weight.std().item()
    assert std == pytest.approx((2 / (4000 + 256)) ** 0.5, rel=0.05)
    cfg = dataclasses.replace(cfg, table_init="normal", table_init_std=0.5)
    assert build_ffn("stem", cfg, 0).table.weight.std().item() == pytest.approx(0.5, rel=0.05)


@pytest.mark.parametrize("variant", sorted(C.read_yaml(C.VARIANTS)))
def test_every_variant_forward_backward(variant):
    cfg = C.experiment.load(C.REPO / "config" / "tiny.yaml")
    mcfg = C.model_config_for(cfg, "350m", variant)
    torch.manual_seed(0)
    model = build_model(mcfg)
    ids = torch.randint(0, mcfg.vocab_size, (2, 33))
    loss = model(ids[:, :-1], ids[:, 1:])
    assert torch.isfinite(loss) and abs(loss.item() - torch.log(torch.tensor(mcfg.vocab_size)).item()) < 1.0
    loss.backward()
    for name, p in model.named_parameters():
        if isinstance(getattr(model.get_submodule(name.rsplit(".", 1)[0]), "w_up", None), torch.nn.Parameter):
            continue  # Hash-MoE experts that received no token in this batch have no gradient
        assert p.grad is not None, name
    groups = model.param_groups()
    assert sum(len(v) for v in groups.values()) == len(list(model.parameters()))
    assert ("table" in groups) == (mcfg.ffn.count("stem") + mcfg.ffn.count("stem_gate") + mcfg.ffn.count("stem_dagger") > 0)


def test_every_rmsnorm_gets_its_weights_dtype_under_bf16_autocast():
    """Under bf16 autocast (CUDA training's; the CPU's casts the same ops) every RMSNorm of every variant gets an
    input of its weight's dtype, so CUDA's fused rms_norm kernel dispatches (gpucheck item a warned "Mismatch dtype
    between input and weight": DSE's key norm was fed its bf16 projection)."""
    cfg = C.read_yaml(C.REPO / "config" / "tiny.yaml")
    cfg["archs"]["350m"].update(TINY)
    cfg = reshaped(cfg)
    seen = {}

    def record(name):
        def hook(module, args):
            seen[name] = (args[0].dtype, module.weight.dtype)
        return hook

    for variant in sorted(C.read_yaml(C.VARIANTS)):
        torch.manual_seed(0)
        model = build_model(C.model_config_for(cfg, "350m", variant))
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.RMSNorm):
                m.register_forward_pre_hook(record(f"{variant} {name}"))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(torch.randint(0, model.cfg.vocab_size, (2, 16)))
        assert logits.dtype == torch.bfloat16   # autocast is on
    assert "dse layers.1.dse.norm_k" in seen and "dense norm" in seen
    assert {k: v for k, v in seen.items() if v[0] != v[1]} == {}


def test_tied_model_stays_tied_through_to_empty():
    """A tied model (tie_embeddings: the real experiment's 350m and its STEM variants) built on the meta device and
    materialised with ``to_empty`` (load_offloaded, the insertion analysis) has one head-and-embedding tensor again
    (to_empty gives each name its own), and the eagerly built tied model's logits."""
    cfg = _cfg(tie_embeddings=True, ffn=("dense", "stem") * 3)
    torch.manual_seed(0)
    eager = build_model(cfg).eval()
    model = build_model(cfg, "meta").to_empty(device="cpu")
    assert model.lm_head.weight is model.tok_emb.weight and len(list(model.parameters())) == len(list(eager.parameters()))
    model.init_weights()
    model.load_state_dict(eager.state_dict())
    assert model.lm_head.weight.data_ptr() == model.tok_emb.weight.data_ptr()
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        assert torch.equal(model.eval()(ids), eager(ids))


def test_placement_indices():
    v = C.read_yaml(C.VARIANTS)
    assert resolve_placement(v["stem"]["placement"], 16) == [2, 5, 8, 11, 14]
    assert resolve_placement(v["stem"]["placement"], 32) == list(range(2, 32, 3))
    assert resolve_placement(v["stem_half"]["placement"], 32) == list(range(1, 32, 2))
    assert resolve_placement(v["stem_full"]["placement"], 32) == list(range(1, 32))
    assert resolve_placement([0, 3], 4) == [0, 3]
    with pytest.raises(ValueError, match="outside"):
        resolve_placement([7], 4)
    cfg = model_config(TINY, {"ffn": "stem", "placement": {"every": 3, "offset": 2}})
    assert cfg.ffn == ("dense", "dense", "stem", "dense", "dense", "stem")


def _paper():
    return C.experiment.load(C.REPO / "config" / "paper.yaml")


def _acc(scale, variant):
    from stem.report.params import accounting_for
    return accounting_for(_paper(), scale, variant)


def test_accounting_reproduces_table3_1b_rows():
    dense, stem = _acc("1b", "dense"), _acc("1b", "stem")
    assert round(dense["paper_total_params"] / 1e9, 2) == 1.50
    assert round(stem["paper_total_params"] / 1e9, 2) == 6.75
    assert round(stem["active_params"] / 1e9, 2) == 1.41
    assert round(dense["gflops_per_token"], 2) == 3.00
    assert round(stem["gflops_per_token"], 2) == 2.83
    assert stem["sparse_layers"] == [2, 5, 8, 11, 14]


def test_accounting_exact_counts_350m():
    d, V, f, n = 960, 32000, 2560, 10
    dense = 376_075_200
    assert _acc("350m", "dense")["total_params"] == dense
    stem = _acc("350m", "stem")
    assert stem["total_params"] == dense - n * d * f + n * V * f
    assert stem["paper_total_params"] == dense + n * V * f
    assert stem["active_params"] == dense - n * d * f
    moe = _acc("350m", "hashmoe")
    assert moe["total_params"] == dense + n * 11 * 3 * d * f  # 12 experts (config/variants.yaml)
    assert moe["active_params"] == dense
    assert _acc("350m", "stem_full")["active_params"] == dense - 31 * d * f


def test_document_mask_isolates_documents():
    torch.manual_seed(0)
    model = build_model(_cfg(ffn=("dense", "stem") * 3)).eval()
    ids = torch.randint(0, 97, (1, 20))
    positions = torch.cat([torch.arange(8), torch.arange(12)]).unsqueeze(0)
    other = ids.clone()
    other[0, :8] = torch.randint(0, 97, (8,))  # change the first document only
    a, b = model(ids, positions=positions), model(other, positions=positions)
    torch.testing.assert_close(a[0, 8:], b[0, 8:])  # the second document does not see the first
    assert not torch.allclose(a[0, :8], b[0, :8])
    # the second document alone, at positions 0.., gives the same outputs
    torch.testing.assert_close(a[0, 8:], model(ids[:, 8:])[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["hashmoe", "moe"])
def test_kv_cache_matches_full_forward(kind):
    torch.manual_seed(0)
    model = build_model(_cfg(ffn=("dense", kind) * 3, n_experts=4, moe_experts=4, moe_d_ff=8)).eval()
    ids = torch.randint(0, 97, (2, 12))
    full = model(ids)
    cache = KVCache()
    steps = [model(ids[:, :7], cache=cache)] + [model(ids[:, t:t + 1], cache=cache) for t in range(7, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_rope_scaling_variants():
    from stem.models.rope import inv_frequencies
    base, _ = inv_frequencies(64, 10000.0, RopeScaling())
    lin, _ = inv_frequencies(64, 10000.0, RopeScaling(kind="linear", factor=4))
    torch.testing.assert_close(lin, base / 4)
    theta, _ = inv_frequencies(64, 10000.0, RopeScaling(kind="theta", theta=1e6))
    assert theta[1] < base[1]
    yarn, mscale = inv_frequencies(64, 10000.0, RopeScaling(kind="yarn", factor=8, original_max_seq_len=2048))
    assert yarn[0] == base[0] and yarn[-1] == pytest.approx(base[-1] / 8) and mscale > 1
    with pytest.raises(ValueError, match="rope_scaling.kind"):
        RopeScaling(kind="ntk-magic")


def test_sequence_longer_than_max_seq_len_is_rejected():
    model = build_model(_cfg())
    with pytest.raises(ValueError, match="exceeds max_seq_len=64"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_dse_compression_and_ngram_hash_respect_documents():
    from stem.models.dse import DSEMemory, compression_map
    assert compression_map(["Apple", " apple", "APPLE ", "pear", "Café", "cafe"]).tolist() == [0, 0, 0, 3, 4, 4]
    cfg = _cfg(dse={"layers": [1], "rows_per_head": 31, "d_mem": 8, "heads": 2})
    mem = DSEMemory(cfg, 1)
    cids = torch.tensor([[5, 6, 7, 5, 6, 7]])
    rows = mem._rows(cids, None)
    assert len(rows) == 2 * 2 and all(r.max() < p for r, p in zip(rows, mem.primes))
    # the same trigram hashes to the same rows; across a document start the history is dropped
    assert all(r[0, 2] == r[0, 5] for r in rows)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1]])
    rows_doc = mem._rows(cids, docs)
    assert any(r[0, 4] != rd[0, 4] for r, rd in zip(rows, rows_doc))  # position 4 reached into doc 0 before
    assert all(rd[0, 0] == rd[0, 3] for rd in rows_doc)  # both are document starts with the same token
    # by hand: row = (c_t m_0 ^ (c_{t-1} + 1) m_1 ^ (c_{t-2} + 1) m_2) mod p per table (orders 2, 3 x 2 heads);
    # history before the row start is padding and mixes as 0, so it differs from token id 0 (which mixes as 1)
    m, p = mem.multipliers.tolist(), mem.primes.tolist()
    r = mem._rows(torch.tensor([[0, 5, 0]]), None)
    assert [r[k][0].tolist() for k in (0, 2)] == [
        [0, (5 * m[0][0] ^ 1 * m[0][1]) % p[0], (0 ^ 6 * m[0][1]) % p[0]],
        [0, (5 * m[2][0] ^ 1 * m[2][1]) % p[2], (0 ^ 6 * m[2][1] ^ 1 * m[2][2]) % p[2]]]


# ---- routed MoE (ffn kind ``moe``, stem/models/moe.py): DeepSeekMoE, the DSE paper's baseline ------------

def _moe(**kw):
    cfg = _cfg(**{"moe_experts": 5, "moe_shared": 2, "moe_top_k": 2, "moe_d_ff": 8, **kw})
    torch.manual_seed(1)
    f = build_ffn("moe", cfg, 1)
    for p in f.parameters():   # trained-looking weights (a router at init std routes almost uniformly)
        torch.nn.init.normal_(p, std=0.5)
    return f


def _swiglu(x, wg, wu, wd):
    return wd @ (F.silu(wg @ x) * (wu @ x))


def test_moe_matches_a_per_token_reference(xs):
    """y_t = sum of the shared experts + sum over top-k of s_{i,t} FFN_i(x_t), s = softmax of the router's
    logits, gates not renormalised: one token at a time in float64, each shared expert separately (the module
    runs them as one SwiGLU of 2 f hidden units)."""
    x, ids = xs
    f = _moe()
    out = f(x, ids)
    w = {n: p.detach().double() for n, p in f.named_parameters()}
    fe = 8
    for b in range(2):
        for t in range(5):
            h = x[b, t].double()
            s = torch.softmax(w["router.weight"] @ h, dim=0)
            top = sorted(range(5), key=lambda i: -s[i].item())[:2]
            y = sum(_swiglu(h, w["shared.w_gate.weight"][j * fe:(j + 1) * fe], w["shared.w_up.weight"][j * fe:(j + 1) * fe],
                            w["shared.w_down.weight"][:, j * fe:(j + 1) * fe]) for j in range(2))
            y = y + sum(s[i] * _swiglu(h, w["experts.w_gate"][i], w["experts.w_up"][i], w["experts.w_down"][i])
                        for i in top)
            torch.testing.assert_close(out[b, t].double(), y, rtol=1e-5, atol=1e-5)
    no_shared = _moe(moe_shared=0)
    assert no_shared.shared is None and no_shared(x, ids).shape == x.shape


def test_moe_balance_loss_by_hand():
    """L = alpha sum_i f_i P_i, f_i = E / (k T) #{t: i in top-k}, P_i = mean_t s_{i,t}. Router logits set to
    x's first E coordinates: E = 2, k = 1, tokens with logits (ln 3, 0) -> s = (3/4, 1/4)."""
    f = build_ffn("moe", _cfg(moe_experts=2, moe_top_k=1, moe_d_ff=4, moe_aux_coef=0.1), 1)
    with torch.no_grad():
        f.router.weight.zero_()
        f.router.weight[0, 0] = f.router.weight[1, 1] = 1.0
    a, b = [math.log(3), 0.0], [0.0, math.log(3)]
    x = torch.zeros(1, 2, 16)
    x[0, 0, :2], x[0, 1, :2] = torch.tensor(a), torch.tensor(b)
    f.train()(x, None)
    # one token each: f = (1, 1), P = (1/2, 1/2): L = alpha exactly (perfect balance)
    assert f.aux_loss.item() == pytest.approx(0.1 * (1 * 0.5 + 1 * 0.5))
    x[0, 1, :2] = torch.tensor(a)
    f(x, None)
    # both to expert 0: f = (2 / 2 * 2, 0) = (2, 0), P = (3/4, 1/4): L = 0.1 * 1.5
    assert f.aux_loss.item() == pytest.approx(0.1 * 1.5)
    f.eval()(x, None)
    assert f.aux_loss is None


def test_moe_balance_loss_matches_numpy(xs):
    import numpy as np
    x, ids = xs
    f = _moe(moe_top_k=3, moe_aux_coef=0.03).train()
    f(x, ids)
    h = x.reshape(-1, 16).numpy().astype(np.float64)
    logits = h @ f.router.weight.detach().numpy().astype(np.float64).T
    s = np.exp(logits - logits.max(1, keepdims=True))
    s /= s.sum(1, keepdims=True)
    top = np.argsort(-s, axis=1)[:, :3]
    counts = np.bincount(top.ravel(), minlength=5)
    expected = 0.03 * np.sum(5 / (3 * 10) * counts * s.mean(0))
    assert f.aux_loss.item() == pytest.approx(expected, rel=1e-5)


def test_moe_router_gets_gradient_from_gates_and_balance_loss(xs):
    x, ids = xs
    for coef, use_output in ((0.0, True), (0.01, False)):
        f = _moe(moe_aux_coef=coef).train()
        y = f(x, ids)
        (y.sum() if use_output else f.aux_loss).backward()
        assert f.router.weight.grad is not None and f.router.weight.grad.abs().sum() > 0


def test_moe_model_loss_is_ce_plus_balance_in_training_only():
    torch.manual_seed(0)
    model = build_model(_cfg(ffn=("dense",) + ("moe",) * 5, moe_experts=4, moe_d_ff=8))
    ids = torch.randint(0, 97, (2, 13))
    logits = model(ids[:, :-1])          # no targets: logits only, nothing kept
    assert model.aux_loss is None and all(m.aux_loss is None for m in model.aux_modules)
    ce = F.cross_entropy(logits.view(-1, 97), ids[:, 1:].reshape(-1))
    inputs = {}                          # each MoE layer's input, to recompute its balance loss from its routing
    hooks = [m.register_forward_hook(lambda m, a, out: inputs.update({m: a[0]})) for m in model.aux_modules]
    loss = model(ids[:, :-1], ids[:, 1:])
    for h in hooks:
        h.remove()
    aux = 0.0
    for m, x in inputs.items():
        scores, _, chosen = m.route(x.reshape(-1, 16))
        aux = aux + m.balance_loss(scores, torch.bincount(chosen.reshape(-1), minlength=m.n_experts))
    assert len(inputs) == 5 and model.aux_loss.item() == pytest.approx(aux.item(), rel=1e-6)
    torch.testing.assert_close(loss, ce + aux)
    model.eval()
    torch.testing.assert_close(model(ids[:, :-1], ids[:, 1:]), ce)
    assert model.aux_loss is None
    dense = build_model(_cfg())
    assert dense.aux_modules == [] and dense(ids[:, :-1], ids[:, 1:]).grad_fn.name() == "NllLossBackward0"


def test_moe_activation_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    model = build_model(_cfg(ffn=("dense", "moe") * 3, moe_experts=4, moe_d_ff=8))
    ids = torch.randint(0, 97, (2, 13))
    grads = []
    for ckpt in (False, True):
        model.zero_grad(set_to_none=True)
        model.set_training_options(activation_checkpointing=ckpt)
        model(ids[:, :-1], ids[:, 1:]).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        assert all(m.aux_loss is None for m in model.aux_modules)   # the recomputation keeps none either
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_checkpointed_loss_in_chunks_is_the_token_mean_of_the_whole_micro_batch(monkeypatch):
    """Activation checkpointing computes the loss LOSS_CHUNK tokens at a time (issue 29, item 4: 1B's 32k extend on
    one GPU): over more than one chunk, with ignored targets, the same loss and gradients as in one piece."""
    import stem.models.model as M
    monkeypatch.setattr(M, "LOSS_CHUNK", 50)   # 4,096 in use: the same code over fewer tokens
    torch.manual_seed(0)
    model = build_model(_cfg(n_layers=2, ffn=("dense", "stem")))
    ids = torch.randint(0, 97, (3, 41))      # 120 tokens: chunks of 50, 50 and 20
    targets = ids[:, 1:].clone()
    targets[1, :25] = -1
    out = []
    for ckpt in (False, True):
        model.zero_grad(set_to_none=True)
        model.set_training_options(activation_checkpointing=ckpt)
        loss = model(ids[:, :-1], targets)
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(out[0][0], out[1][0], rtol=1e-6, atol=0)
    for a, b in zip(out[0][1], out[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_moe_config_errors_are_one_line():
    for kw, msg in (({"moe_top_k": 9}, r"moe_top_k=9: expected 1 <= moe_top_k <= moe_experts \(8\)"),
                    ({"moe_top_k": 0}, "moe_top_k=0"), ({"moe_experts": 0}, "moe_experts=0: expected >= 1"),
                    ({"moe_shared": -1}, "moe_shared=-1"), ({"moe_d_ff": -4}, "moe_d_ff=-4"),
                    ({"moe_aux_coef": -0.1}, "moe_aux_coef=-0.1")):
        with pytest.raises(ValueError, match=msg):
            _cfg(**kw)


def test_moe_keys_left_out_of_specs_at_their_defaults():
    """A model that keeps the MoE defaults (every existing variant) has the JSON it had before they existed."""
    assert not any(k.startswith("moe_") for k in _cfg().to_dict())
    cfg = _cfg(ffn=("moe",) * 6, moe_top_k=3, moe_d_ff=8)
    d = cfg.to_dict()
    assert d["moe_top_k"] == 3 and d["moe_d_ff"] == 8 and "moe_experts" not in d
    assert ModelConfig.from_dict(d) == cfg


def test_moe_accounting_by_hand():
    """350M paper shapes, variant moe (every layer from 1, config/variants.yaml, ModelConfig defaults): per MoE
    layer the dense SwiGLU 3 d d_ff is replaced by a router d E, 1 shared and E = 8 routed experts of
    3 d f (f = d_ff), top-2: total + (1 + 8) 3 d f + d E, active + (1 + 2) 3 d f + d E."""
    d, f, e, n = 960, 2560, 8, 31
    dense = 376_075_200
    moe = _acc("350m", "moe")
    assert moe["sparse_layers"] == list(range(1, 32))
    assert moe["total_params"] == moe["paper_total_params"] == dense + n * ((1 + e) * 3 * d * f + d * e - 3 * d * f)
    assert moe["active_params"] == dense + n * ((1 + 2) * 3 * d * f + d * e - 3 * d * f)
    assert moe["gflops_per_token"] == 2 * moe["active_params"] / 1e9
    tiny = C.model_config_for(C.experiment.load(C.REPO / "config" / "tiny.yaml"), "350m", "moe")
    from stem.models.accounting import accounting
    acc, (d, f) = accounting(build_model(tiny, "meta")), (64, 64)   # 1 shared + top-2 of 8 experts, 64 wide
    dense_tiny = accounting(build_model(C.model_config_for(C.experiment.load(C.REPO / "config" / "tiny.yaml"),
                                                           "350m", "dense"), "meta"))
    per_layer = 3 * d * 192
    assert acc["active_params"] == dense_tiny["active_params"] + 5 * (3 * 3 * d * f + d * 8 - per_layer)
    assert acc["total_params"] == dense_tiny["total_params"] + 5 * (9 * 3 * d * f + d * 8 - per_layer)


def test_dse_mode_disabled_is_the_model_without_the_add_and_forced_is_gate_one():
    """The inference-only DSE gate override (DSE paper App. G): ``disabled`` gives exactly the logits of the same
    weights with the DSE add removed from the block; ``forced`` gives u = W_V e (gate 1) through Eq. 5, by hand;
    ``normal`` is the untouched model; the mode is neither a parameter nor saved."""
    import math
    torch.manual_seed(0)
    model = build_model(_cfg(dse={"layers": [1, 3], "rows_per_head": 31, "d_mem": 8, "heads": 2})).eval()
    for m in model.modules():   # a non-zero convolution, so Eq. 5's refinement takes part in the check
        if hasattr(m, "conv"):
            torch.nn.init.normal_(m.conv.weight, std=0.3)
    ids = torch.randint(0, 97, (2, 9))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    normal = model(ids)
    model.set_dse_mode("disabled")
    disabled = model(ids)
    assert set(model.state_dict()) == set(state) and all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    mems = {i: blk.dse for i, blk in enumerate(model.layers) if blk.dse is not None}
    model.set_dse_mode("normal")
    for blk in model.layers:
        blk.dse = None          # the baseline computation: x -> attention -> FFN, no memory add
    assert torch.equal(disabled, model(ids)) and not torch.allclose(disabled, normal)
    for i, mem in mems.items():
        model.layers[i].dse = mem
    assert torch.equal(model(ids), normal)
    # forced, by hand at the first DSE layer: u = W_V e, y = SiLU(conv(RMSNorm(u))) + u
    mem, h = mems[1], torch.randn(2, 9, 16)
    cids = model.dse_compress[ids]
    e = torch.cat([t(r) for t, r in zip(mem.tables, mem._rows(cids, None))], -1)
    u = e @ mem.w_value.weight.T
    n = u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + 1e-5) * mem.norm_u.weight
    w = mem.conv.weight[:, 0, :]        # (d, 4), dilation 3: tap i reads position t - (3 - i) * 3
    conv = torch.zeros_like(n)
    for t in range(9):
        for i in range(4):
            s = t - (3 - i) * mem.dilation
            if s >= 0:
                conv[:, t] += n[:, s] * w[:, i]
    want = F.silu(conv) + u
    model.set_dse_mode("forced")
    assert torch.allclose(mem(h, cids, None), want, atol=1e-5)
    score = (mem.norm_h(h) * mem.norm_k(e @ mem.w_key.weight.T)).sum(-1, keepdim=True) / math.sqrt(16)
    model.set_dse_mode("normal")
    assert not torch.allclose(mem(h, cids, None), want, atol=1e-3) and (torch.sigmoid(score) < 0.99).all()
    with pytest.raises(ValueError, match="dse_mode 'off': expected one of normal, disabled, forced"):
        model.set_dse_mode("off")
    with pytest.raises(ValueError, match="has no DSE memory"):
        build_model(_cfg()).set_dse_mode("disabled")


def test_dse_paper_accounting_against_hand_formula():
    """The DSE paper's Sec. 3.1 counts (P_tot, P_act, P_free excluding embedding and head; DSE params = the
    hashed tables), by hand for a DSE model, a STEM model and a Hash-MoE model."""
    from stem.models.accounting import accounting
    V, d, L, kv_dim, f = 97, 16, 6, 8, 24             # TINY: 4 heads of 4, 2 kv heads
    block = 2 * d * d + 2 * d * kv_dim + 2 * d + 3 * d * f
    dense_body = L * block + d                          # + the final norm; embedding and head excluded
    # DSE in layers 1 and 4: 2 orders x 2 heads = 4 tables of width 8 / 4 = 2, rows = the first 4 primes >= 31
    tables = (31 + 37 + 41 + 43) * 2
    dse_rest = 2 * 8 * d + 3 * d + 4 * d                # w_key, w_value; 3 norms; depthwise conv kernel 4
    a = accounting(build_model(_cfg(dse={"layers": [1, 4], "rows_per_head": 31, "d_mem": 8, "heads": 2}), "meta"))
    assert a["p_tot"] == dense_body + 2 * (tables + dse_rest)
    assert a["p_act"] == dense_body + 2 * dse_rest
    assert a["p_free"] == 2 * tables and a["dse_params"] == 2 * tables
    assert a["total_params"] == a["p_tot"] + 2 * V * d   # the existing keys are unchanged
    stem = accounting(build_model(_cfg(ffn=("dense", "stem") * 3), "meta"))
    assert stem["p_tot"] == dense_body + 3 * (V * f - d * f) and stem["p_act"] == dense_body - 3 * d * f
    assert stem["p_free"] == 3 * V * f and stem["dse_params"] == 0
    moe = accounting(build_model(_cfg(ffn=("dense", "hashmoe") * 3, n_experts=4), "meta"))
    assert moe["p_free"] == 3 * 3 * 3 * d * f and moe["p_act"] == dense_body


def _primes_from(start: int, count: int) -> list[int]:
    """The first ``count`` primes >= start, by a numpy sieve (independent of stem.models.dse)."""
    import numpy as np
    hi = start + 64 * count + 1000
    sieve = np.ones(hi, bool)
    sieve[:2] = False
    for p in range(2, int(hi ** 0.5) + 1):
        if sieve[p]:
            sieve[p * p::p] = False
    return (np.flatnonzero(sieve[start:])[:count] + start).tolist()


@pytest.mark.parametrize("model", ["dse_27b", "dse_40b"])
def test_dse_table_params_at_the_dse_papers_table3_settings(model):
    """DSE-27B / DSE-40B's memory (DSE paper Table 3: 2 DSE layers, 8 heads, orders [2, 3], dim 1280, 'DSE Vocab
    Size' rows per order x head table) against its Table 1 '# DSE Parameters' (printed truncated to 0.1 B),
    built on the meta device. Paper numbers from reference/dse_paper/."""
    import math

    from stem.models.accounting import accounting
    from stem.report import paper_data as P
    t3 = P.load_table("dse_paper/table3").query("variant == @model").set_index("column")["value"]
    printed = P.load_table("dse_paper/table1").query("variant == @model").set_index("column")["value"]
    rows, d_mem, heads = int(t3["dse_rows"]), int(t3["dse_d_mem"]), int(t3["dse_heads"])
    orders = list(range(int(t3["dse_order_min"]), int(t3["dse_order_max"]) + 1))
    layers = [int(t3["dse_layer_first"]), int(t3["dse_layer_second"])]
    cfg = ModelConfig.from_dict({"vocab_size": 1024, "d_model": int(t3["d_model"]), "n_layers": int(t3["n_layers"]),
                                 "n_heads": 20, "n_kv_heads": 20, "d_ff": 256, "max_seq_len": 64,
                                 "dse": {"layers": layers, "orders": orders, "heads": heads, "rows_per_head": rows,
                                         "d_mem": d_mem}})
    a = accounting(build_model(cfg, "meta"))
    n_tables = len(orders) * heads
    assert a["dse_params"] == len(layers) * sum(_primes_from(rows, n_tables)) * (d_mem // n_tables)
    assert a["dse_params"] == pytest.approx(len(layers) * rows * d_mem, rel=1e-4)   # ~5.79 B / ~18.53 B
    assert math.floor(a["dse_params"] / 1e8) / 10 == printed["dse_params_b"]        # 5.7 / 18.5 as printed


def test_dse_kv_cache_matches_full_forward_and_uncached_greedy():
    """DSE under a KV cache: the N-gram history and the causal conv's inputs come from the cached prefix, so
    prefill + one-token steps give the full forward's logits, and cached greedy decoding (single and
    left-padded batched) gives exactly the uncached tokens."""
    from stem.eval.generate import greedy_generate, greedy_generate_batch
    torch.manual_seed(0)
    model = build_model(_cfg(dse={"layers": [0, 3], "rows_per_head": 31, "d_mem": 8, "heads": 2})).eval()
    with torch.no_grad():
        for layer in (0, 3):   # the conv starts at zero; give it taps so the cached inputs matter
            model.layers[layer].dse.conv.weight.normal_(std=0.5)
        model.lm_head.weight.mul_(20)   # well-separated logits: no near-ties for greedy decoding
    ids = torch.randint(0, 97, (2, 20))
    full = model(ids)
    cache = KVCache()
    steps = [model(ids[:, :7], cache=cache)] + [model(ids[:, 7:9], cache=cache)] + \
        [model(ids[:, t:t + 1], cache=cache) for t in range(9, 20)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert cache.dse[0]["ids"].shape == (2, 2) and cache.dse[3]["conv"].shape == (2, 3 * 3, 16)
    stale = KVCache()   # the same steps with the DSE state dropped after the prefill: not the full forward
    model(ids[:, :7], cache=stale)
    stale.dse.clear()
    assert not torch.allclose(model(ids[:, 7:9], cache=stale), full[:, 7:9], atol=1e-3)
    prompts = [ids[0, :5].tolist(), ids[1, :11].tolist(), ids[0, 3:12].tolist()]
    uncached = [greedy_generate(model, p, 12, use_cache=False) for p in prompts]
    assert [greedy_generate(model, p, 12, use_cache=True) for p in prompts] == uncached
    assert greedy_generate_batch(model, prompts, 12) == uncached
    assert len(set(map(tuple, uncached))) == 3 and all(len(g) == 12 for g in uncached)


class _SdpaCalls(torch.overrides.TorchFunctionMode):
    """Records, at every SDPA call, whether cuDNN's attention kernel was allowed (the flag the dispatcher reads)."""

    def __init__(self):
        super().__init__()
        self.cudnn_allowed = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            self.cudnn_allowed.append(torch.backends.cuda.cudnn_sdp_enabled())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="cuDNN attention is CUDA's"))])
def test_attention_leaves_out_cudnn_outside_training_only(device):
    """cuDNN attention builds a plan per new shape: ~75 ms per decoded token of the 1B model on an H100 against
    a 13 ms step (docs/gpu.md). On CUDA, evaluation and decoding (eval mode) leave it out and training keeps
    SDPA's choice; the CPU, which has no cuDNN attention, pays no context in either mode."""
    model = build_model(_cfg(n_layers=2, ffn=("dense", "stem")), device)
    ids = torch.randint(0, 97, (2, 8), device=device)
    for training, expected in ((True, True), (False, device == "cpu")):
        model.train(training)
        with _SdpaCalls() as calls:
            model(ids)
        assert calls.cudnn_allowed == [expected] * 2
    assert torch.backends.cuda.cudnn_sdp_enabled()   # restored after the call
