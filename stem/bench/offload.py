"""``python -m stem bench offload``: the offloaded STEM engine (stem.models.offload) measured on a trained
checkpoint beside the papers' systems claims, and the STEM paper's efficiency statements (Sec. 3.2.3-3.2.4,
Table 1) measured where they can be here.

- decode: teacher-forced decoding of held-out text (the val split of the checkpoint's own training data):
  ``batch`` rows, a ``prompt``-token prefill, then ``steps`` decode steps of one true token per row with a
  KV cache. Tokens/s of the resident model, the offloaded one, and offloaded + LFU cache at several sizes,
  interleaved per repeat (median), with the engine's hit rate and bytes moved per token.
- hit rate vs cache rows on the same stream: the engine's own ``LFUCache`` replayed on the ids (the timed
  runs' counters equal it). The paper's cache budget is the memory the removed up-projections free:
  d_model x d_ff per STEM layer = d_model rows of its table.
- FFN memory on the compute device: dense (same shapes), STEM resident, STEM offloaded.
- parameter bytes read per decoded token (batch 1), dense vs STEM, by forward hooks (``AccessMeter``):
  Table 1's 3 d d_ff vs 2 d d_ff + d_ff (the row), Sec. 3.2.3's M_dec with its KV term.
- unique ids per training batch, uniq(BL) (Table 1's communication term), on the training split.
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from stem import config as C
from stem import layout as L
from stem import provenance
from stem.data.shards import ShardSet
from stem.eval.lm import load_for_eval
from stem.config.experiment import load
from stem.io import atomic_write_json
from stem.models.spec import ModelConfig
from stem.models.model import Attention, KVCache, build_model
from stem.models.offload import (LFUCache, OffloadedHashedTable, OffloadedTable, dse_row_ids, dse_tables, offload,
                                 token_tables)
from stem.checkpoint import check_identity

PAPER = {
    "hit_rate": ("STEM Sec. 3.4: 'we utilize the property that the input token ids follow a Zipfian distribution "
                 "to implement a memory-efficient LFU cache with more than 80% hit rate'"),
    "throughput": ("DSE paper Sec. 1 / App. H Table 6: offloading a 100B-parameter table to host memory "
                   "'incurs negligible throughput overhead (< 3%)' (1.9% on the 4B, 2.8% on the 8B backbone)"),
    "ffn_freed": "STEM Sec. 3.2.4: offloading the tables 'frees up roughly one-third of the FFN parameter memory'",
}
DEFAULT_CHECKPOINT = L.checkpoint("tiny", "350m", "stem", "pretrain")


# ---- inputs ----------------------------------------------------------------------------------------------
def _manifest(spec: dict, ckpt) -> Path:
    """The first data source the checkpoint was trained on (its val split is held out)."""
    data = spec.get("data") or {}
    if not data:
        raise ValueError(f"{Path(ckpt) / 'config.json'}: no 'data' section to take held-out text from")
    path = Path(next(iter(data.values()))["manifest"])
    return path if path.is_absolute() else C.REPO / path


def tokens(manifest, split: str, n: int | None = None) -> np.ndarray:
    s = ShardSet(Path(manifest).parent, split)
    n = len(s) if n is None else n
    if len(s) < n:
        raise ValueError(f"{manifest}: the {split} split holds {len(s)} tokens, the benchmark needs {n} "
                         "(lower --batch / --prompt / --steps)")
    return s.get(0, n).astype(np.int64)


# ---- hit rate -------------------------------------------------------------------------------------------
def replay_hit_rate(prompt: np.ndarray, steps: np.ndarray, vocab: int, cache_rows: int,
                    warm: np.ndarray | None = None) -> float:
    """Hit rate of the decode steps (cached / unique ids per step) after a prefill of ``prompt`` (B, P):
    the engine's LFUCache fed the ids the engine would see; ``warm``: ids read once before (e.g. the
    training split: the cache starts with its most frequent ids and their counts)."""
    cache = LFUCache(vocab, cache_rows)
    if warm is not None:
        cache.access(*np.unique(warm, return_counts=True))
    cache.access(*np.unique(prompt, return_counts=True))
    hits = unique = 0
    for col in steps.T:
        u, n = np.unique(col, return_counts=True)
        hits += int(cache.access(u, n)[0].sum())
        unique += len(u)
    return hits / unique


def replay_hit_rate_tables(rows: list[np.ndarray], prompt: int, cache_rows: int, sizes: list[int],
                           warm: list[np.ndarray] | None = None) -> float:
    """``replay_hit_rate`` over several tables with their own row ids (the DSE tables): ``rows[k]`` (B, T) the
    row ids table k reads over the streams (its first ``prompt`` columns the prefill), ``sizes[k]`` its rows,
    each with its own cache of min(cache_rows, size) rows; hits / unique rows summed over the tables."""
    hits = unique = 0
    for k, r in enumerate(rows):
        sub_hits = replay_hit_rate(r[:, :prompt], r[:, prompt:], sizes[k], min(cache_rows, sizes[k]),
                                   None if warm is None else warm[k])
        n = sum(len(np.unique(col)) for col in r[:, prompt:].T)
        hits, unique = hits + sub_hits * n, unique + n
    return hits / unique


def dse_rows_of(model, tokens: np.ndarray) -> list[np.ndarray]:
    """The row ids (as ``tokens``' shape, 2-D) every DSE table of ``model`` reads over ``tokens`` (a full
    forward's, which a KV-cache decode reproduces step by step)."""
    return [r.numpy() for r in dse_row_ids(model, torch.from_numpy(tokens))]


# ---- decoding ---------------------------------------------------------------------------------------------
@torch.no_grad()
def decode_seconds(model, prompt: torch.Tensor, steps: torch.Tensor) -> float:
    """Wall time of the decode steps (the prefill is not timed); the engine's counters cover the steps."""
    engine = getattr(model, "offload_engine", None)
    if engine is not None:
        engine.reset()
    cache = KVCache()
    model(prompt, cache=cache)
    if engine is not None:
        engine.reset_stats()
    sync = torch.cuda.synchronize if prompt.device.type == "cuda" else (lambda *_: None)
    sync(prompt.device)   # the clock reads finished GPU work, not the launch queue
    t = time.perf_counter()
    for i in range(steps.shape[1]):
        model(steps[:, i:i + 1], cache=cache)
    sync(prompt.device)
    return time.perf_counter() - t


def ffn_bytes(model, layer: int | None = None) -> int:
    """Bytes of the FFN parameters the model (or one layer) holds on its device; offloaded tables hold none."""
    blocks = model.layers if layer is None else [model.layers[layer]]
    return sum(p.numel() * p.element_size() for block in blocks for p in block.ffn.parameters())


# ---- parameter bytes read per decoded token ---------------------------------------------------------------
class AccessMeter:
    """Bytes a forward reads, by (layer, kind), from forward hooks: a linear or norm reads its whole weight,
    an embedding or (offloaded) table the rows of its unique ids, attention with a KV cache its layer's keys
    and values. Kinds: embedding, attn, kv, norm, ffn, table (rows of a token-indexed table), head."""

    def __init__(self, model):
        self.bytes: dict = defaultdict(int)
        tables = {id(m) for _, _, m in token_tables(model)} | {id(t) for _, _, _, t in dse_tables(model)}
        hashed_bytes = {t: h.row_bytes for t, h in enumerate(getattr(getattr(model, "offload_engine", None),
                                                                     "hashed", []))}
        self.handles = []
        for name, m in model.named_modules():
            parts = name.split(".")
            layer = int(parts[1]) if parts[0] == "layers" and len(parts) > 1 else None
            if isinstance(m, (nn.Embedding, OffloadedTable, OffloadedHashedTable)):
                row = m.embedding_dim * m.weight.element_size() if isinstance(m, nn.Embedding) else \
                    hashed_bytes[m.index] if isinstance(m, OffloadedHashedTable) else m.engine.row_bytes
                kind = "table" if id(m) in tables or isinstance(m, (OffloadedTable, OffloadedHashedTable)) else \
                    ("embedding" if layer is None else "ffn")
                self._hook(m, layer, kind, lambda args, out, row=row: row * torch.unique(args[0]).numel())
            elif isinstance(m, Attention):
                self._hook(m, layer, "kv", lambda args, out: 0 if args[4] is None else sum(
                    t[args[5]].numel() * t[args[5]].element_size() for t in (args[4].k, args[4].v)))
            own = list(m.parameters(recurse=False))
            if own and not isinstance(m, (nn.Embedding, OffloadedTable)):
                kind = ("head" if layer is None and name == "lm_head" else "dse" if ".dse." in f".{name}."
                        else "norm" if all(p.dim() == 1 for p in own)
                        else "ffn" if ".ffn" in f".{name}" else "attn" if ".attn" in f".{name}" else "other")
                n = sum(p.numel() * p.element_size() for p in own)
                self._hook(m, layer, kind, lambda args, out, n=n: n)

    def _hook(self, m, layer, kind, count):
        def hook(module, args, out):
            self.bytes[(layer, kind)] += int(count(args, out))
        self.handles.append(m.register_forward_hook(hook))

    def total(self, kind=None, layer="any") -> int:
        return sum(v for (l_, k), v in self.bytes.items() if (kind is None or k == kind) and (layer == "any" or l_ == layer))

    def close(self):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def decode_step_access(model, prompt: torch.Tensor, next_ids: torch.Tensor) -> AccessMeter:
    """The bytes one decode step reads after prefilling ``prompt``."""
    cache = KVCache()
    model(prompt, cache=cache)
    meter = AccessMeter(model)
    model(next_ids, cache=cache)
    meter.close()
    return meter


def unique_per_batch(train: np.ndarray, batch: int, seq_len: int, n: int = 16, seed: int = 0) -> dict:
    """uniq(BL) over ``n`` batches of ``batch`` random windows of ``seq_len`` tokens of the training split."""
    rng = np.random.default_rng(seed)
    counts = [len(np.unique(np.stack([train[s:s + seq_len] for s in rng.integers(0, len(train) - seq_len, batch)])))
              for _ in range(n)]
    return {"batch": batch, "seq_len": seq_len, "tokens": batch * seq_len, "uniq_mean": float(np.mean(counts)),
            "uniq_min": int(min(counts)), "uniq_max": int(max(counts)), "batches": n}


def paper_shapes(dtype=torch.bfloat16) -> list[dict]:
    """FFN memory on the device at the paper's shapes (config/paper.yaml, models on the meta device): dense,
    STEM with its tables offloaded, the tables; and the cache budget (d_model rows) as a share of V."""
    exp = load(C.REPO / "config" / "paper.yaml")
    size = torch.empty((), dtype=dtype).element_size()
    rows = []
    for scale in exp.matrix:
        dense, stem = (build_model(C.model_config_for(exp, scale, v), "meta") for v in ("dense", "stem"))
        tables = sum(m.weight.numel() for _, _, m in token_tables(stem)) * size
        ffn = [sum(p.numel() for b in m.layers for p in b.ffn.parameters()) * size for m in (dense, stem)]
        rows.append({"scale": scale, "dtype": str(dtype).removeprefix("torch."), "dense_ffn_bytes": ffn[0],
                     "stem_offloaded_ffn_bytes": ffn[1] - tables, "table_bytes": tables,
                     "stem_layers": len(token_tables(stem)), "layers": stem.cfg.n_layers,
                     "freed_vs_dense_model": 1 - (ffn[1] - tables) / ffn[0],
                     "cache_budget_rows": stem.cfg.d_model, "budget_fraction_of_vocab": stem.cfg.d_model / stem.cfg.vocab_size})
    return rows


# ---- the benchmark ---------------------------------------------------------------------------------------
def bench_offload(checkpoint=DEFAULT_CHECKPOINT, batch: int = 8, prompt: int = 32, steps: int = 96,
                  cache_rows: list[int] | None = None, curve: list[int] | None = None, repeats: int = 3) -> dict:
    ckpt = Path(checkpoint)
    resident, _, spec = load_for_eval(ckpt, "cpu")
    check_identity(ckpt, spec, None, "this offload benchmark")   # a checkpoint copied into another variant's slot
    cfg = resident.cfg
    vocab, d, d_ff = cfg.vocab_size, cfg.d_model, cfg.d_ff
    if prompt + steps > cfg.max_seq_len:
        raise ValueError(f"--prompt {prompt} + --steps {steps} exceed the checkpoint's max_seq_len {cfg.max_seq_len}")
    manifest = _manifest(spec, ckpt)
    val = tokens(manifest, "val")
    if len(val) < batch * (prompt + steps):
        raise ValueError(f"{manifest}: the val split holds {len(val)} tokens, the benchmark needs "
                         f"{batch * (prompt + steps)} (lower --batch / --prompt / --steps)")
    streams = val[:len(val) // batch * batch].reshape(batch, -1)  # the whole split as `batch` concurrent streams
    p_ids, s_ids = streams[:, :prompt], streams[:, prompt:prompt + steps]
    n_stem, hashed = len(token_tables(resident)), dse_tables(resident)
    if not n_stem and not hashed:
        raise ValueError(f"{ckpt / 'config.json'}: variant {spec.get('variant')!r} has no STEM or DSE tables to offload")
    sizes = [t.weight.shape[0] for _, _, _, t in hashed]
    top = vocab if n_stem else max(sizes)       # a cache larger than the table holds the whole table
    cache_rows = cache_rows or sorted({min(top, r) for r in (d, 4 * d, 16 * d)})
    curve = curve or sorted({*(2 ** k for k in range(3, 20) if 2 ** k < top), top, d, *cache_rows})

    configs = _configs(ckpt, resident, cache_rows)
    decode = _decode(configs, torch.from_numpy(p_ids), torch.from_numpy(s_ids), repeats, n_stem)
    train = tokens(manifest, "train")
    if n_stem:
        hit_curve = [{"cache_rows": r, "fraction_of_vocab": r / vocab,
                      "hit_rate": replay_hit_rate(streams[:, :prompt], streams[:, prompt:], vocab, r),
                      "hit_rate_warm": replay_hit_rate(streams[:, :prompt], streams[:, prompt:], vocab, r, train)}
                     for r in curve]
    else:   # every DSE table its own row ids and cache (rows per table; fraction of the largest table)
        rows, warm = dse_rows_of(resident, streams), dse_rows_of(resident, train[None, :])
        hit_curve = [{"cache_rows": r, "fraction_of_vocab": r / top,
                      "hit_rate": replay_hit_rate_tables(rows, prompt, r, sizes),
                      "hit_rate_warm": replay_hit_rate_tables(rows, prompt, r, sizes, [w[0] for w in warm])}
                     for r in curve]
    dense_cfg = ModelConfig.from_dict({**cfg.to_dict(), "ffn": ["dense"] * cfg.n_layers, "dse": None})
    dense = build_model(dense_cfg).to(next(resident.parameters()).dtype).eval()
    return {"experiment": spec.get("experiment"), "checkpoint": str(ckpt), "variant": spec.get("variant"),
            "scale": spec.get("scale"), "device": "cpu", "threads": torch.get_num_threads(),
            "shapes": {"vocab": vocab, "d_model": d, "d_ff": d_ff, "layers": cfg.n_layers, "stem_layers": n_stem,
                       "dtype": str(next(resident.parameters()).dtype).removeprefix("torch.")},
            "workload": {"held_out": str(manifest.relative_to(C.REPO) if manifest.is_relative_to(C.REPO) else manifest), "batch": batch, "prompt": prompt, "steps": steps,
                         "repeats": repeats, "curve_steps": streams.shape[1] - prompt},
            "decode": decode, "hit_rate_curve": hit_curve,
            "memory": _memory(resident, configs["offload cache=0"], dense, n_stem, hashed),
            "access": _access(resident, dense, p_ids, s_ids, n_stem, hashed),
            "uniq_train_batch": _uniq_train_batches(resident, spec, train, n_stem),
            "paper_shapes": paper_shapes(), "paper": PAPER,
            "provenance": provenance.record({"checkpoint": str(ckpt), "batch": batch, "prompt": prompt, "steps": steps,
                                             "cache_rows": cache_rows, "curve": curve, "repeats": repeats},
                                            [manifest], train_spec=spec, tokenizer=ckpt / "tokenizer.json")}


def _configs(ckpt: Path, resident, cache_rows: list[int]) -> dict:
    """The models whose decoding is timed, by name: resident, offloaded with each cache size (0: none), and
    offloaded without prefetch (each STEM layer fetches its rows when it runs)."""
    configs = {"resident": resident}
    for n in [0, *cache_rows]:
        configs[f"offload cache={n}"] = load_for_eval(ckpt, "cpu", offload=True, cache_rows=n)[0]
    configs["offload cache=0 no prefetch"] = sync = load_for_eval(ckpt, "cpu")[0]
    offload(sync, ckpt / "model.safetensors", prefetch=False)
    return configs


def _decode(configs: dict, p_t: torch.Tensor, s_t: torch.Tensor, repeats: int, n_stem: int) -> list[dict]:
    """Decode tokens/s of each model, interleaved over ``repeats`` (the median); hit rate and bytes moved from
    the engines' counters (a DSE-only model: its tables' counters)."""
    batch, steps = s_t.shape
    times = defaultdict(list)
    stats = {}
    for _ in range(repeats):
        for name, model in configs.items():
            times[name].append(decode_seconds(model, p_t, s_t))
            if hasattr(model, "offload_engine"):
                stats[name] = model.offload_engine.stats()
    decode = []
    base = batch * steps / statistics.median(times["resident"])
    pre = "" if n_stem else "dse_"
    for name, model in configs.items():
        rate = batch * steps / statistics.median(times[name])
        st = stats.get(name)
        decode.append({"config": name, "cache_rows": st["cache_rows"] if st else None, "tokens_per_s": rate,
                       "vs_resident": rate / base, "hit_rate": st[f"{pre}hit_rate"] if st else None,
                       "unique_per_total": st[f"{pre}unique_per_total"] if st else None,
                       "bytes_per_token": st["all_bytes_per_token"] if st else 0.0})
    return decode


def _memory(resident, off, dense, n_stem: int, hashed: list) -> dict:
    """FFN and parameter memory on the device: the dense model, the resident model, ``off`` (its tables
    offloaded)."""
    cfg = resident.cfg
    memory = {"dense_ffn_bytes": ffn_bytes(dense), "stem_resident_ffn_bytes": ffn_bytes(resident),
              "stem_offloaded_ffn_bytes": ffn_bytes(off),
              "table_bytes_offloaded": off.offload_engine.freed_bytes,
              "stem_layers": n_stem, "layers": cfg.n_layers, "dse_tables": len(hashed),
              "dse_layers": len({layer for _, layer, _, _ in hashed}),
              "resident_param_bytes": sum(p.numel() * p.element_size() for p in resident.parameters()),
              "offloaded_param_bytes": sum(p.numel() * p.element_size() for p in off.parameters()),
              "dense_param_bytes": sum(p.numel() * p.element_size() for p in dense.parameters())}
    if n_stem:
        i = next(i for i, k in enumerate(cfg.ffn) if k != "dense")  # a STEM layer, offloaded vs the dense one
        memory["freed_vs_dense_per_stem_layer"] = 1 - ffn_bytes(off, i) / ffn_bytes(dense, i)
        memory["freed_vs_dense_model"] = 1 - memory["stem_offloaded_ffn_bytes"] / memory["dense_ffn_bytes"]
    memory["cache_budget_rows"] = cfg.d_model if n_stem else None  # the removed up-projections' memory, in rows
    return memory


def _access(resident, dense, p_ids: np.ndarray, s_ids: np.ndarray, n_stem: int, hashed: list) -> dict:
    """Parameter bytes read per decoded token (batch 1), the dense model vs the resident one, beside the
    paper's Sec. 3.2.3 formula (MHA, batch 1)."""
    cfg = resident.cfg
    one_p, one_s = torch.from_numpy(p_ids[:1]), torch.from_numpy(s_ids[:1, :1])
    access = {}
    sparse_layer = (next(i for i, k in enumerate(cfg.ffn) if k != "dense") if n_stem else hashed[0][1])
    for name, model in (("dense", dense), ("stem" if n_stem else "dse", resident)):
        m = decode_step_access(model, one_p, one_s)
        layer = sparse_layer if name != "dense" else 0
        access[name] = {"total": m.total(), "ffn": m.total("ffn"), "table_rows": m.total("table"),
                        "kv": m.total("kv"), "attn": m.total("attn"), "dse": m.total("dse"),
                        "stem_layer_ffn": m.total("ffn", layer), "stem_layer_table": m.total("table", layer)}
    context = p_ids.shape[1] + 1
    access["paper_saving_fraction_formula"] = cfg.d_ff / (4 * cfg.d_model + 2 * context + 3 * cfg.d_ff)
    access["context_length"] = context
    return access


def _uniq_train_batches(resident, spec: dict, train: np.ndarray, n_stem: int) -> list[dict]:
    """uniq(BL): unique ids per training batch at 1, 1x and 4x the checkpoint's batch size, and the table rows
    a step would communicate."""
    tc = spec.get("train") or {}
    b, sl = int(tc.get("batch_size", 16)), int(tc.get("seq_len", 128))
    batches = [unique_per_batch(train, bb, sl) for bb in sorted({1, b, 4 * b})]
    row_bytes = resident.cfg.d_ff * next(resident.parameters()).element_size()
    for r in batches:
        r["comm_bytes_per_step"] = r["uniq_mean"] * row_bytes * n_stem  # forward; training doubles it (Table 1 notes)
        r["uniq_fraction_of_vocab"] = r["uniq_mean"] / resident.cfg.vocab_size
    return batches


# ---- output ----------------------------------------------------------------------------------------------
def render(r: dict) -> str:
    """The benchmark's figures as text (`bench offload`'s output, offload/offload.md): decode throughput and hit
    rates, then the memory and bytes read of the STEM tables (or the DSE tables)."""
    dse = not r["shapes"]["stem_layers"]
    return "\n".join(_decode_lines(r, dse) + (_dse_memory_lines(r) if dse else _stem_memory_lines(r)))


def _decode_lines(r: dict, dse: bool) -> list[str]:
    s, w, mem = r["shapes"], r["workload"], r["memory"]
    what = (f"{mem['dse_layers']} DSE layers of {mem['dse_tables'] // max(mem['dse_layers'], 1)} hashed tables" if dse
            else f"{s['stem_layers']} STEM")
    lines = [f"Offloaded {'DSE' if dse else 'STEM'} tables, {r['checkpoint']} (experiment {r['experiment']}: "
             f"{s['layers']} layers, {what}, V={s['vocab']}, d={s['d_model']}, d_ff={s['d_ff']}, {s['dtype']}), "
             f"{r['device']}, {r['threads']} thread(s)",
             f"decode: {w['batch']} rows of held-out text ({w['held_out']}, val split), {w['prompt']}-token prefill, "
             f"{w['steps']} teacher-forced steps, KV cache; median of {w['repeats']} interleaved runs",
             f"{'config':28} {'tok/s':>9} {'vs resident':>11} {'hit rate':>9} {'uniq/total':>10} {'bytes/token':>11}"]
    for x in r["decode"]:
        hit = "-" if x["hit_rate"] is None else f"{x['hit_rate']:.1%}"
        uniq = "-" if x["unique_per_total"] is None else f"{x['unique_per_total']:.3f}"
        lines.append(f"{x['config']:28} {x['tokens_per_s']:9.0f} {x['vs_resident']:11.3f} {hit:>9} {uniq:>10} "
                     f"{x['bytes_per_token']:11.0f}")
    lines.append(f"paper: {PAPER['throughput']}")
    lines.append(f"hit rate vs cache rows (LFU, LRU tie-break{', per DSE table: hashed N-gram row ids' if dse else ''}): "
                 f"the whole val split as {w['batch']} streams, "
                 f"{w['prompt']}-token prefill, {w['curve_steps']} decode steps; cold = empty cache at the start, "
                 "warm = counts of the training split read first:")
    budget = mem["cache_budget_rows"]
    for x in r["hit_rate_curve"]:
        mark = "  <- the removed up-projection's memory (d_model rows)" if x["cache_rows"] == budget else ""
        lines.append(f"  {x['cache_rows']:7d} rows ({x['fraction_of_vocab']:6.1%} of {'a table' if dse else 'V'}): "
                     f"cold {x['hit_rate']:6.1%}, warm {x['hit_rate_warm']:6.1%}{mark}")
    lines.append(f"paper: {PAPER['hit_rate']}")
    return lines


def _dse_memory_lines(r: dict) -> list[str]:
    mem, acc, mib = r["memory"], r["access"], 2 ** 20
    dn, ds = acc["dense"], acc["dse"]
    return [f"parameters on the device: dense model {mem['dense_param_bytes'] / mib:.2f} MiB, DSE resident "
            f"{mem['resident_param_bytes'] / mib:.2f} MiB, DSE offloaded {mem['offloaded_param_bytes'] / mib:.2f} "
            f"MiB ({mem['table_bytes_offloaded'] / mib:.2f} MiB of DSE tables moved off)",
            f"parameter bytes read per decoded token (batch 1, context {acc['context_length']}): dense "
            f"{dn['total']:,}, DSE {ds['total']:,} (DSE gating/norms {ds['dse']:,} + table rows "
            f"{ds['table_rows']:,}); whole model {ds['total'] / dn['total']:.3f}x dense"]


def _stem_memory_lines(r: dict) -> list[str]:
    mem, acc, mib = r["memory"], r["access"], 2 ** 20
    lines = [f"FFN parameters on the device: dense {mem['dense_ffn_bytes'] / mib:.2f} MiB, STEM resident "
             f"{mem['stem_resident_ffn_bytes'] / mib:.2f} MiB, STEM offloaded {mem['stem_offloaded_ffn_bytes'] / mib:.2f} "
             f"MiB ({mem['table_bytes_offloaded'] / mib:.2f} MiB of tables moved off); freed vs dense: "
             f"{mem['freed_vs_dense_per_stem_layer']:.1%} of a STEM layer's FFN, "
             f"{mem['freed_vs_dense_model']:.1%} of the model's FFN memory ({mem['stem_layers']}/{mem['layers']} "
             "layers STEM)"]
    for x in r["paper_shapes"]:
        lines.append(f"  paper shapes {x['scale']} ({x['dtype']}): dense FFN {x['dense_ffn_bytes'] / 2 ** 30:.2f} GiB, STEM "
                     f"offloaded {x['stem_offloaded_ffn_bytes'] / 2 ** 30:.2f} GiB ({x['freed_vs_dense_model']:.1%} freed; "
                     f"{x['stem_layers']}/{x['layers']} layers STEM), tables off the device {x['table_bytes'] / 2 ** 30:.2f} GiB; "
                     f"cache budget d_model = {x['cache_budget_rows']} rows = {x['budget_fraction_of_vocab']:.1%} of V")
    lines.append(f"paper: {PAPER['ffn_freed']}")
    dn, st = acc["dense"], acc["stem"]
    lines.append(f"parameter bytes read per decoded token (batch 1, context {acc['context_length']}): dense "
                 f"{dn['total']:,} (FFN {dn['ffn']:,}), STEM {st['total']:,} (FFN {st['ffn']:,} + table rows "
                 f"{st['table_rows']:,}); whole model {st['total'] / dn['total']:.3f}x dense")
    lines.append(f"  one STEM layer: FFN {st['stem_layer_ffn']:,} + row {st['stem_layer_table']:,} vs dense "
                 f"{dn['stem_layer_ffn']:,} (Table 1: 2 d d_ff + d_ff vs 3 d d_ff); Sec. 3.2.3 saving fraction "
                 f"d_ff/(4d+2L+3d_ff) = {acc['paper_saving_fraction_formula']:.3f} (MHA; this model's GQA attention "
                 "reads less)")
    lines.append("unique ids per training batch (training split), Table 1's uniq(BL) d_ff communication:")
    for x in r["uniq_train_batch"]:
        lines.append(f"  B={x['batch']:3d} x L={x['seq_len']}: uniq {x['uniq_mean']:7.1f} of {x['tokens']} tokens "
                     f"({x['uniq_mean'] / x['tokens']:.3f}; {x['uniq_fraction_of_vocab']:.1%} of V) -> "
                     f"{x['comm_bytes_per_step'] / mib:.3f} MiB of rows per step (all STEM layers)")
    return lines


def main(args):
    torch.set_num_threads(args.threads or 1)  # one thread unless asked: steadier timings on a shared machine
    r = bench_offload(args.checkpoint, args.batch, args.prompt, args.steps, args.cache_rows, repeats=args.repeats)
    print(render(r))
    if args.json:
        atomic_write_json(args.json, r)
    if args.figure:
        from stem.report.figures import hit_rate_figure, save  # lazy: matplotlib only when a figure is asked for
        save(hit_rate_figure(r), args.figure)
    return r
