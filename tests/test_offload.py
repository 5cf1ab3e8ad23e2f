"""The offloaded inference engine (stem.models.offload): logits equal the resident model's for every STEM
variant, with and without cache and prefetch, full forwards and batched KV-cache decoding; the LFU/LRU cache
policy against a hand-worked sequence; the counters against hand-counted values."""
import copy

import numpy as np
import pytest
import torch

from stem import config as C
from stem.eval.generate import greedy_generate_batch
from stem.models.model import KVCache, build_model
from stem.models.offload import LFUCache, OffloadedHashedTable, OffloadedTable, offload
from stem.checkpoint import save_weights
from conftest import reshaped

VARIANTS = ["stem", "stem_gate", "stem_dagger", "stem_half", "stem_full"]
V, D_FF = 64, 24


def tiny_model(variant, n_kv_heads=1, vocab=V, tied=False):
    cfg = C.read_yaml(C.REPO / "config" / "tiny.yaml")
    cfg["archs"]["350m"].update(vocab_size=vocab, d_model=16, n_layers=4, n_heads=2, n_kv_heads=n_kv_heads, d_ff=D_FF,
                                max_seq_len=64, tie_embeddings=tied)
    torch.manual_seed(0)
    model = build_model(C.model_config_for(reshaped(cfg), "350m", variant)).eval()
    with torch.no_grad():  # tables as large as the activations, so a wrong row shows in the logits
        for block in model.layers:
            if hasattr(block.ffn, "table"):
                block.ffn.table.weight.normal_()
            if block.dse is not None:   # DSE: its tables too, and taps in its (zero-initialised) convolution
                for t in block.dse.tables:
                    t.weight.normal_()
                block.dse.conv.weight.normal_(std=0.5)
    return model


def offloaded(model, tmp_path, **kw):
    path = tmp_path / "model.safetensors"
    if not path.exists():
        save_weights(model, path)
    twin = copy.deepcopy(model)
    return twin, offload(twin, weights=path, **kw)


@torch.no_grad()
def decode_logits(model, prompt, steps):
    """Logits of a prefill and of ``steps`` batched decode steps with a KV cache (feeding the argmax)."""
    cache = KVCache()
    out = [model(prompt, cache=cache)]
    nxt = out[-1][:, -1:].argmax(-1)
    for _ in range(steps):
        out.append(model(nxt, cache=cache))
        nxt = out[-1][:, -1:].argmax(-1)
    return out


CASES = [(v, {"cache_rows": 8}) for v in VARIANTS] + [("stem_half", {"cache_rows": 0}),
                                                      ("stem_half", {"cache_rows": 8, "prefetch": False})] + \
    [("dse", {"cache_rows": 8}), ("dse", {"cache_rows": 0}), ("dse", {"cache_rows": 8, "prefetch": False})]


@pytest.mark.parametrize("variant,kw", CASES)
def test_logits_equal_resident(variant, kw, tmp_path):
    model = tiny_model(variant)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (3, 12), generator=g)
    with torch.no_grad():
        ref = [model(ids)] + decode_logits(model, ids, 4)  # the second pass over ids hits the cache
        assert not torch.equal(ref[0], build_model(model.cfg).eval()(ids)), "tables must matter"
    twin, engine = offloaded(model, tmp_path, **kw)
    assert not any(p.shape == (V, D_FF) for p in twin.parameters())  # the tables left the model
    assert sum(isinstance(m, OffloadedTable) for m in twin.modules()) == len(engine.far) > 0 or variant == "dse"
    assert sum(isinstance(m, OffloadedHashedTable) for m in twin.modules()) == len(engine.hashed)
    assert not any(p.dim() == 2 and p.shape[1] == 8 for p in twin.parameters())  # DSE: 64 / 8 tables wide
    with torch.no_grad():
        got = [twin(ids)] + decode_logits(twin, ids, 4)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert (engine.hits + engine.dse_hits > 0) == (kw["cache_rows"] > 0)
    if variant in ("stem_half", "dse"):  # the evaluator's left-padded batched decoding
        prompts = [[5, 6, 7], [8, 9], [1, 2, 3, 4]]
        assert greedy_generate_batch(twin, prompts, 5) == greedy_generate_batch(model, prompts, 5)
    engine.close()


def test_hit_evicted_in_the_same_forward_reads_its_row_first(tmp_path):
    """cache_rows=1: id 1 is cached, then a forward hits 1 and admits 2 (read 3 times) in its slot."""
    model = tiny_model("stem_half")
    twin, engine = offloaded(model, tmp_path, cache_rows=1)
    for ids in ([[1]], [[1, 2, 2, 2]], [[1, 2]]):
        x = torch.tensor(ids)
        assert torch.equal(twin(x), model(x))
    assert engine.cache.cached() == {2} and engine.hits == 2  # 1 in the second forward, 2 in the third


def test_lfu_lru_policy_hand_worked():
    c = LFUCache(10, 2)

    def step(ids):
        uniq, counts = np.unique(ids, return_counts=True)
        hit = c.access(uniq, counts)[0]
        return dict(zip(uniq.tolist(), hit.tolist())), c.cached()

    # (ids read, expected hits, expected cache after); counts / last reads worked out by hand
    assert step([1, 1, 2]) == ({1: False, 2: False}, {1, 2})        # 1: (2, t1), 2: (1, t1)
    assert step([3]) == ({3: False}, {1, 3})                          # 3: (1, t2) ties 2 on count, newer: 2 out
    assert step([2]) == ({2: False}, {1, 2})                          # 2: (2, t3) beats 3 (1, t2)
    assert step([3, 4]) == ({3: False, 4: False}, {2, 3})             # 3: (2, t4); 1 (2, t1) is the LRU of count 2
    assert step([2, 4]) == ({2: True, 4: False}, {2, 4})              # 2: (3, t5), 4: (2, t5) beats 3 (2, t4)
    assert step([5, 6]) == ({5: False, 6: False}, {2, 4})             # count 1 < 2: not admitted
    one = LFUCache(10, 1)
    one.access(np.array([7, 8]), np.array([1, 1]))
    assert one.cached() == {7}                                        # same count, same forward: smaller id
    assert LFUCache(10, 0).access(np.array([1]), np.array([1]))[0].tolist() == [False]


def test_counters_hand_counted(tmp_path):
    model = tiny_model("stem_half")  # STEM layers 1 and 3: 2 tables of 64 x 24 fp32, 96 bytes a row
    twin, engine = offloaded(model, tmp_path, cache_rows=2, prefetch=False)
    moved = []

    def counting(gather):  # count the rows the far tier really hands over
        def wrapped(ids):
            moved.append(len(ids))
            return gather(ids)
        return wrapped

    for f in engine.far:
        f.gather = counting(f.gather)
    twin(torch.tensor([[1, 2, 2, 3], [3, 3, 4, 1]]))  # 8 ids, 4 unique, no hit; 3 (x3) and 1 (x2, < 2) cached
    twin(torch.tensor([[3, 5]]))                       # 2 ids, 2 unique, 3 hits
    s = engine.stats()
    assert (s["forwards"], s["total_ids"], s["unique_ids"], s["hits"]) == (2, 10, 6, 1)
    assert s["hit_rate"] == pytest.approx(1 / 6) and s["unique_per_total"] == pytest.approx(0.6)
    assert moved == [4, 4, 1, 1]
    assert s["bytes_moved"] == (4 + 1) * 2 * 96 == 96 * sum(moved)
    assert s["bytes_per_token"] == pytest.approx(960 / 10)
    assert s["freed_bytes"] == 2 * 64 * 24 * 4


def test_bad_use_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no token-indexed tables"):
        offload(tiny_model("dense"), weights=tmp_path / "x")
    with pytest.raises(ValueError, match="pass weights="):
        offload(tiny_model("stem"))
    with pytest.raises(ValueError, match="cache_rows=65: expected 0"):
        offloaded(tiny_model("stem"), tmp_path, cache_rows=65)
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 3)
    with pytest.raises(ValueError, match="bad.safetensors: not a readable safetensors file"):
        offload(tiny_model("stem"), weights=tmp_path / "bad.safetensors")


def test_replayed_hit_rate_equals_the_engines(tmp_path):
    from stem.bench.offload import decode_seconds, replay_hit_rate
    model = tiny_model("stem_half")
    twin, engine = offloaded(model, tmp_path, cache_rows=6)
    rng = np.random.default_rng(0)
    ids = np.minimum(rng.zipf(1.3, (3, 14)), V) - 1  # Zipfian ids, as text
    decode_seconds(twin, torch.from_numpy(ids[:, :4]), torch.from_numpy(ids[:, 4:]))
    s = engine.stats()
    assert s["forwards"] == 10 and 0 < s["hit_rate"] < 1
    assert s["hit_rate"] == replay_hit_rate(ids[:, :4], ids[:, 4:], V, 6)


def test_bytes_read_per_decoded_token_match_the_papers_formula(tmp_path):
    """Sec. 3.2.3 / Table 1, batch 1, MHA: a layer reads 4d^2 + 2Ld (KV) + 3 d d_ff (dense) or 2 d d_ff (STEM)
    parameters, plus d_ff for the STEM row (Table 1's B_uniq d_ff); fp32."""
    from stem.bench.offload import decode_step_access
    d, f, L = 16, D_FF, 6
    models = {v: tiny_model(v, n_kv_heads=2) for v in ("dense", "stem_half")}  # MHA; STEM in layers 1 and 3
    models["offloaded"], _ = offloaded(models["stem_half"], tmp_path)
    prompt, step = torch.tensor([[3, 4, 5, 4, 3]]), torch.tensor([[7]])
    got = {k: decode_step_access(m, prompt, step) for k, m in models.items()}
    for layer in range(4):
        stem = layer in (1, 3)
        for name in ("stem_half", "offloaded") if stem else ("dense", "stem_half", "offloaded"):
            m = got[name]
            per_layer = sum(m.total(k, layer) for k in ("attn", "kv", "ffn")) // 4
            assert per_layer == 4 * d * d + 2 * L * d + (2 if stem else 3) * d * f, (name, layer)
            assert m.total("table", layer) == (4 * f if stem else 0)
            assert m.total("norm", layer) == 4 * 2 * d
    dense = sum(got["dense"].total(k, 1) for k in ("attn", "kv", "ffn"))
    stem = sum(got["stem_half"].total(k, 1) for k in ("attn", "kv", "ffn"))
    assert (dense - stem) / dense == pytest.approx(f / (4 * d + 2 * L + 3 * f))
    assert got["dense"].total("embedding") == got["dense"].total("head") // V == 4 * d  # one row; the whole head


def test_unique_ids_per_training_batch():
    from stem.bench.offload import unique_per_batch
    train = np.arange(1000) % 37
    r = unique_per_batch(train, batch=2, seq_len=10, n=3)
    assert r["tokens"] == 20 and r["uniq_max"] <= 20
    rng = np.random.default_rng(0)  # the same windows, counted by hand
    counts = [len({int(t) for s in rng.integers(0, 990, 2) for t in train[s:s + 10]}) for _ in range(3)]
    assert r["uniq_mean"] == pytest.approx(sum(counts) / 3) and r["uniq_min"] == min(counts)


def test_bench_offload_end_to_end(tiny_data, tmp_path, capsys):
    """python -m stem bench offload on a small checkpoint trained on nothing: the table, JSON and figure."""
    import json

    from stem.__main__ import main
    from stem.checkpoint import save_checkpoint
    model = tiny_model("stem_half", vocab=512)  # the tiny data's vocabulary
    spec = {"experiment": "test", "scale": "350m", "variant": "stem_half", "stage": "pretrain",
            "model": model.cfg.to_dict(), "data": {"web": {"manifest": tiny_data["manifests"]["web"], "weight": 1.0}},
            "train": {"batch_size": 2, "seq_len": 16}}
    ckpt = tmp_path / "ckpt"
    save_checkpoint(ckpt, model, spec, tiny_data["tokenizer"], {})
    out = tmp_path / "out"
    main(["bench", "offload", "--checkpoint", str(ckpt), "--batch", "8", "--prompt", "4", "--steps", "6",
          "--repeats", "1", "--cache-rows", "16", "--json", str(out / "o.json"), "--figure", str(out / "o.png")])
    r = json.loads((out / "o.json").read_text())
    assert (out / "o.png").stat().st_size > 0 and "hit rate vs cache rows" in capsys.readouterr().out
    assert [x["config"] for x in r["decode"]] == ["resident", "offload cache=0", "offload cache=16",
                                                   "offload cache=0 no prefetch"]
    no_cache = r["decode"][1]
    assert no_cache["bytes_per_token"] == pytest.approx(no_cache["unique_per_total"] * 2 * D_FF * 4)
    assert r["memory"]["freed_vs_dense_per_stem_layer"] == pytest.approx(1 / 3)
    assert r["memory"]["table_bytes_offloaded"] == 2 * 512 * D_FF * 4
    paper = {x["scale"]: x for x in r["paper_shapes"]}  # bf16; 350M: d 960, d_ff 2560, 10 of 32 layers STEM, V 32000
    assert paper["350m"]["dense_ffn_bytes"] == 32 * 3 * 960 * 2560 * 2
    assert paper["350m"]["stem_offloaded_ffn_bytes"] == (32 * 3 - 10) * 960 * 2560 * 2
    assert paper["350m"]["table_bytes"] == 10 * 32000 * 2560 * 2
    assert paper["1b"]["table_bytes"] == 5 * 128256 * 8192 * 2  # d 2048, d_ff 8192, 5 of 16 layers, V 128256
    assert paper["1b"]["freed_vs_dense_model"] == pytest.approx(5 / (16 * 3))
    with pytest.raises(SystemExit):
        main(["bench", "offload", "--checkpoint", str(ckpt), "--prompt", "60", "--steps", "8"])
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: --prompt 60 + --steps 8 exceed the checkpoint's max_seq_len 64"


def test_warm_replay_starts_with_the_most_frequent_ids():
    from stem.bench.offload import replay_hit_rate
    warm = np.array([5] * 3 + [6] * 2 + [7])  # the 2-row cache starts with 5 and 6
    steps = np.array([[5, 6, 7, 5]])          # hits: 5, 6, miss 7 (count 2 < 4, 3: not admitted), hit 5
    assert replay_hit_rate(np.array([[6]]), steps, 10, 2, warm) == 3 / 4
    # cold: the prefill caches 6; 5 misses (free slot), 6 hits (count 2), 7 misses and evicts 5 (count 1 like 7,
    # older), 5 misses again and evicts 7 (count 2 > 1): one hit in four
    assert replay_hit_rate(np.array([[6]]), steps, 10, 2) == 1 / 4


@pytest.mark.parametrize("dtype,tied", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_load_offloaded_never_reads_the_tables_into_the_model(tmp_path, dtype, tied):
    """The tables stay in the file (the engine's far tier), the logits are the resident model's, and a tied model
    (tie_embeddings) comes back tied: its head is its embedding, one tensor."""
    from stem.checkpoint import load_offloaded
    from stem.checkpoint import save_checkpoint
    model = tiny_model("stem_full", tied=tied)
    spec = {"experiment": "test", "scale": "350m", "variant": "stem_full", "stage": "pretrain",
            "model": model.cfg.to_dict()}
    (tmp_path / "tok.json").write_text("{}")
    save_checkpoint(tmp_path / "ckpt", model, spec, tmp_path / "tok.json", {})
    got, saved = load_offloaded(tmp_path / "ckpt", "cpu", dtype, cache_rows=4)
    assert saved["variant"] == "stem_full" and len(got.offload_engine.far) == 3
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(got(ids), model.to(dtype)(ids))
    assert (got.lm_head.weight is got.tok_emb.weight) == tied == (model.lm_head.weight is model.tok_emb.weight)
    from safetensors.torch import load_file, save_file
    state = load_file(tmp_path / "ckpt" / "model.safetensors")
    state["stray.weight"] = torch.zeros(2)
    save_file(state, tmp_path / "ckpt" / "model.safetensors")
    with pytest.raises(ValueError, match=r"weights do not match the model \(missing \[\], unexpected \['stray.weight'\]"):
        load_offloaded(tmp_path / "ckpt")


def test_far_tiers_return_exact_rows(tmp_path):
    """HostRows (the CUDA far tier; pinned only where CUDA exists) and MappedRows (bf16 file, cast on read)."""
    from safetensors.torch import save_file

    from stem.models.offload import HostRows, MappedRows
    w = torch.randn(10, 6)
    ids = np.array([7, 0, 3])
    assert torch.equal(HostRows(w).gather(ids), w[ids])
    save_file({"t": w.to(torch.bfloat16)}, tmp_path / "w.safetensors")
    rows = MappedRows(tmp_path / "w.safetensors", "t", torch.float32).gather(ids)
    assert torch.equal(rows, w.to(torch.bfloat16)[ids].float())
    with pytest.raises(ValueError, match="no 2-D float tensor 'u'"):
        MappedRows(tmp_path / "w.safetensors", "u", torch.float32)


def test_dse_tables_offloaded_rows_and_counters(tmp_path):
    """A DSE model (2 DSE layers of 2 orders x 4 heads = 8 tables, 8 columns each): the engine fetches every
    table's hashed rows, announced before the layers run, in layer order; counters against hand counts."""
    from stem.models.offload import dse_row_ids
    model = tiny_model("dse")
    assert model.cfg.dse.layers == (1, 2) and len(model.layers[1].dse.tables) == 8
    twin, engine = offloaded(model, tmp_path, cache_rows=3, prefetch=False)
    assert engine.order == [("dse", 1), ("dse", 2)] and len(engine.hashed) == 16 and not engine.far
    moved = []
    for h in engine.hashed:
        def counting(ids, gather=h.far.gather):
            moved.append(len(ids))
            return gather(ids)
        h.far.gather = counting
    ids = torch.tensor([[1, 2, 1, 2, 1, 2], [5, 6, 7, 1, 2, 1]])
    rows = dse_row_ids(model, ids)                  # the resident model's own row ids, table by table
    uniq = [len(torch.unique(r)) for r in rows]
    with torch.no_grad():
        assert torch.equal(twin(ids), model(ids))
    s = engine.stats()
    assert s["dse_total_rows"] == 16 * ids.numel() and s["dse_unique_rows"] == sum(uniq) == sum(moved)
    assert s["dse_hits"] == 0 and s["dse_bytes_moved"] == sum(uniq) * 8 * 4
    assert s["dse_bytes_per_token"] == pytest.approx(sum(uniq) * 32 / 12) and s["unique_ids"] == 0
    assert s["freed_bytes"] == sum(t.weight.numel() for b in model.layers if b.dse is not None
                                   for t in b.dse.tables) * 4
    moved.clear()
    with torch.no_grad():                           # the same ids again: each table's 3 most-read rows hit
        assert torch.equal(twin(ids), model(ids))
    hits = sum(min(3, u) for u in uniq)
    assert engine.stats()["dse_hits"] == hits and sum(moved) == sum(uniq) - hits
    top = max(t.weight.shape[0] for b in model.layers if b.dse is not None for t in b.dse.tables)
    assert top > V   # a DSE table's cache may hold more rows than the vocabulary, not more than its table
    assert offloaded(model, tmp_path, cache_rows=top)[1].stats()["cache_rows"] == top
    with pytest.raises(ValueError, match=f"cache_rows={top + 1}: expected 0 \\(no cache\\) to {top} \\(the largest DSE table\\)"):
        offloaded(model, tmp_path, cache_rows=top + 1)


def test_bench_offload_on_a_dse_checkpoint(tiny_data, tmp_path):
    """python -m stem bench offload on a small DSE checkpoint: its hashed tables offloaded, per-table counters."""
    import json

    from stem.checkpoint import save_checkpoint
    model = tiny_model("dse", vocab=512)
    spec = {"experiment": "test", "scale": "350m", "variant": "dse", "stage": "pretrain",
            "model": model.cfg.to_dict(), "data": {"web": {"manifest": tiny_data["manifests"]["web"], "weight": 1.0}},
            "train": {"batch_size": 2, "seq_len": 16}}
    save_checkpoint(tmp_path / "ckpt", model, spec, tiny_data["tokenizer"], {})
    from stem.bench.offload import bench_offload, render
    from stem.report.figures import hit_rate_figure, save
    r = json.loads(json.dumps(bench_offload(tmp_path / "ckpt", batch=4, prompt=4, steps=4, cache_rows=[16],
                                            curve=[8, 16, 64], repeats=1)))   # what `bench offload` runs
    assert "Offloaded DSE tables" in render(r)
    assert r["provenance"]["train_spec_sha256"] and r["provenance"]["tokenizer_sha256"]   # issue 32
    save(hit_rate_figure(r), tmp_path / "o.png")
    assert (tmp_path / "o.png").stat().st_size > 0
    no_cache, cached = r["decode"][1], r["decode"][2]
    assert no_cache["hit_rate"] == 0 and 0 < cached["hit_rate"] <= 1
    assert no_cache["bytes_per_token"] == pytest.approx(no_cache["unique_per_total"] * 16 * 8 * 4)  # 16 tables, 32 B rows
    tables = [t for b in model.layers if b.dse is not None for t in b.dse.tables]
    assert r["memory"]["table_bytes_offloaded"] == sum(t.weight.numel() for t in tables) * 4
    assert r["memory"]["resident_param_bytes"] - r["memory"]["offloaded_param_bytes"] == r["memory"]["table_bytes_offloaded"]
    assert r["access"]["dse"]["table_rows"] == 16 * 8 * 4   # one row of every table for the one decoded token
    assert [x["hit_rate"] for x in r["hit_rate_curve"]] == sorted(x["hit_rate"] for x in r["hit_rate_curve"])
