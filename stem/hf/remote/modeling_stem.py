"""A STEM-pipeline model for transformers: ``LlamaForCausalLM`` whose FFN ("mlp") of some layers is another
module (written by ``python -m stem export-hf``; load with ``trust_remote_code=True``).

Which module a layer gets is data, not code: ``config.ffn_kinds`` names each layer's FFN kind and
``config.ffn_modules`` says, per kind, the module it becomes (written at export from the pipeline's registry,
stem.models.registry.FFNFacts.hf); this file knows module shapes only (``MODULES``):

- ``swiglu``          y = W_d(SiLU(g) * u), g and u each a sum of ``proj`` (W_gate x, W_up x) and ``table``
                      (U[t]: the layer's V x d_ff table, read by token id t)
- ``hash_experts``    top-1 of E SwiGLU experts chosen by a fixed token -> expert map (a saved buffer)
- ``routed_experts``  shared SwiGLU + softmax-routed top-k experts (gates not renormalised; routing in fp32)

Everything else (attention, norms, RoPE, cache, generation) is transformers' Llama. The token ids reach the
table / hash layers through the model's forward (``input_ids`` is required; ``inputs_embeds`` is refused).
``config.stem_rope`` (the YaRN paper's ramp, linear in the rotation count r, which transformers' ``yarn``
does not implement) replaces the rotary embedding by ``PaperYarnRotaryEmbedding``.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaForCausalLM

from .configuration_stem import StemLlamaConfig


class _TokenIds:
    """The current forward's token ids (and DSE's compressed ids), shared by the layers that read them."""
    ids = None
    cids = None


def _swiglu(x, w_gate, w_up, w_down):
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


class SwiGLU(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return _swiglu(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)


class SwiGLUMLP(nn.Module):
    """y = W_d(SiLU(g) * u); ``spec["gate"]`` / ``spec["up"]``: the terms of g and u, ``proj`` (``gate_proj`` /
    ``up_proj``) or ``table`` (one V x d_ff table shared by both, read by the current token ids)."""

    def __init__(self, config, spec, token_ids):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate, self.up, self.token_ids = list(spec["gate"]), list(spec["up"]), token_ids
        if not self.gate or not self.up or set(self.gate + self.up) - {"proj", "table"}:
            raise ValueError(f"ffn_modules: {spec!r}; expected gate and up as lists of proj and table")
        if "proj" in self.gate:
            self.gate_proj = nn.Linear(d, f, bias=False)
        if "proj" in self.up:
            self.up_proj = nn.Linear(d, f, bias=False)
        if "table" in self.gate + self.up:
            self.table = nn.Embedding(config.vocab_size, f)
        self.down_proj = nn.Linear(f, d, bias=False)

    def _operand(self, terms, proj, x, row):
        parts = [proj(x) if term == "proj" else row for term in terms]
        return sum(parts[1:], parts[0])

    def forward(self, x):
        row = self.table(self.token_ids.ids) if "table" in self.gate + self.up else None
        gate = self._operand(self.gate, getattr(self, "gate_proj", None), x, row)
        return self.down_proj(F.silu(gate) * self._operand(self.up, getattr(self, "up_proj", None), x, row))


class HashMoEMLP(nn.Module):
    def __init__(self, config, spec, token_ids):
        super().__init__()
        e, d, f = config.n_experts, config.hidden_size, config.intermediate_size
        self.token_ids = token_ids
        self.w_gate = nn.Parameter(torch.empty(e, f, d))
        self.w_up = nn.Parameter(torch.empty(e, f, d))
        self.w_down = nn.Parameter(torch.empty(e, d, f))
        self.register_buffer("expert_of_token", torch.zeros(config.vocab_size, dtype=torch.long))

    def forward(self, x):
        flat, expert = x.reshape(-1, x.shape[-1]), self.expert_of_token[self.token_ids.ids.reshape(-1)]
        order = torch.argsort(expert, stable=True)
        counts = torch.bincount(expert, minlength=self.w_up.shape[0]).tolist()
        ys = [_swiglu(h, self.w_gate[e], self.w_up[e], self.w_down[e])
              for e, h in enumerate(flat.index_select(0, order).split(counts))]
        return torch.cat(ys).index_select(0, torch.argsort(order)).reshape(x.shape)


class RoutedExperts(nn.Module):
    def __init__(self, e, d, f):
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(e, f, d))
        self.w_up = nn.Parameter(torch.empty(e, f, d))
        self.w_down = nn.Parameter(torch.empty(e, d, f))


class RoutedMoEMLP(nn.Module):
    def __init__(self, config, spec, token_ids):
        super().__init__()
        d, f = config.hidden_size, config.moe_d_ff or config.intermediate_size
        self.n_experts, self.top_k = config.moe_experts, config.moe_top_k
        self.router = nn.Linear(d, config.moe_experts, bias=False)
        self.shared = SwiGLU(d, config.moe_shared * f) if config.moe_shared else None
        self.experts = RoutedExperts(config.moe_experts, d, f)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        t, k = flat.shape[0], self.top_k
        scores = F.linear(flat.float(), self.router.weight.float()).softmax(dim=-1)
        gates, chosen = torch.topk(scores, k, dim=-1)
        expert = chosen.reshape(-1)
        counts = torch.bincount(expert, minlength=self.n_experts).tolist()
        order = torch.argsort(expert, stable=True)
        ex = self.experts
        ys = [_swiglu(h, ex.w_gate[e], ex.w_up[e], ex.w_down[e])
              for e, h in enumerate(flat.index_select(0, order // k).split(counts))]
        out = torch.cat(ys).index_select(0, torch.argsort(order)).view(t, k, -1)
        y = (out * gates.unsqueeze(-1).to(out.dtype)).sum(dim=1)
        if self.shared is not None:
            y = y + self.shared(flat)
        return y.view(x.shape)


# the module shapes a layer's FFN may take (config.ffn_modules[kind]["module"]), built as cls(config, spec, token_ids)
MODULES = {"swiglu": SwiGLUMLP, "hash_experts": HashMoEMLP, "routed_experts": RoutedMoEMLP}


def paper_yarn_inv_freq(head_dim, theta, rope):
    """YaRN (Peng et al. 2023) as its paper writes it: dimension d turns r = L / lambda_d times over the
    original context L; gamma(r) = clamp((r - alpha) / (beta - alpha), 0, 1);
    theta_d' = (1 - gamma) theta_d / s + gamma theta_d; attention temperature sqrt(1/t) = 0.1 ln s + 1."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    s, alpha, beta, length = rope["factor"], rope["beta_slow"], rope["beta_fast"], rope["original_max_seq_len"]
    gamma = ((length * inv / (2 * math.pi) - alpha) / (beta - alpha)).clamp(0, 1)
    return ((1 - gamma) * inv / s + gamma * inv).float(), 0.1 * math.log(s) + 1.0


class PaperYarnRotaryEmbedding(nn.Module):
    """cos/sin as LlamaRotaryEmbedding returns them, from the paper-ramp YaRN frequencies (computed per call:
    head_dim / 2 numbers, so nothing depends on how buffers are initialised on load)."""

    def __init__(self, config):
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.theta, self.rope = config.rope_parameters["rope_theta"], config.stem_rope

    def forward(self, x, position_ids):
        inv_freq, scale = paper_yarn_inv_freq(self.head_dim, self.theta, self.rope)
        freqs = position_ids[..., None].float() * inv_freq.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scale).to(x.dtype), (emb.sin() * scale).to(x.dtype)


class DSEMemory(nn.Module):
    """The DSE hashed N-gram memory (Cheng et al.; the pipeline's stem.models.dse), added to the residual stream
    before a layer's attention: suffix N-grams of the compressed ids hashed by K heads into per-head tables,
    key / value projections, gate sigmoid(RMSNorm(h) . RMSNorm(k) / sqrt(d)), u = gate * value,
    y = SiLU(Conv1D(RMSNorm(u))) + u (depthwise causal convolution, dilation = max order). The hash constants
    (primes, multipliers) come from the config (``dse_hash``); there is no incremental state, so a model with
    DSE runs without a KV cache (``use_cache: false``: each step recomputes the prefix)."""

    def __init__(self, config, primes, multipliers):
        super().__init__()
        dc = config.stem_model["dse"]
        self.orders, self.heads, self.d_model = tuple(dc["orders"]), dc["heads"], config.hidden_size
        self.primes, self.multipliers = list(primes), [list(m) for m in multipliers]
        width = dc["d_mem"] // len(self.primes)
        self.tables = nn.ModuleList(nn.Embedding(p, width) for p in self.primes)
        self.w_key = nn.Linear(dc["d_mem"], config.hidden_size, bias=False)
        self.w_value = nn.Linear(dc["d_mem"], config.hidden_size, bias=False)
        self.norm_h = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm_k = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm_u = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.dilation = max(self.orders)
        self.conv = nn.Conv1d(config.hidden_size, config.hidden_size, dc["conv_kernel"], groups=config.hidden_size,
                              dilation=self.dilation, bias=False)

    def rows(self, cids):
        rows, t = [], 0
        for n in self.orders:
            grams = [cids] + [F.pad(cids, (j, 0), value=-1)[:, :-j] + 1 for j in range(1, n)]
            for _ in range(self.heads):
                mix = torch.zeros_like(cids)
                for j, g in enumerate(grams):
                    mix = mix ^ (g * self.multipliers[t][j])
                rows.append(mix % self.primes[t])
                t += 1
        return rows

    def forward(self, h, cids):
        mem = torch.cat([tab(r) for tab, r in zip(self.tables, self.rows(cids))], dim=-1)
        key, value = self.w_key(mem), self.w_value(mem)
        key = key.to(self.norm_k.weight.dtype)   # as the pipeline's: autocast's bf16 key, its norm's fp32 weight
        gate = torch.sigmoid((self.norm_h(h) * self.norm_k(key)).sum(-1, keepdim=True) / math.sqrt(self.d_model))
        u = gate * value
        x = self.norm_u(u)
        w, t = self.conv.weight[:, 0, :], x.shape[1]
        conv = torch.zeros_like(x)
        for i in range(w.shape[1]):
            shift = (w.shape[1] - 1 - i) * self.dilation
            if shift < t:
                conv = conv + F.pad(x, (0, 0, shift, 0))[:, :t] * w[:, i]
        return F.silu(conv) + u


def _dse_pre_hook(module, args, kwargs):
    """x = x + DSE(x) before the decoder layer (the pipeline's Block order)."""
    if args:
        h = args[0]
        return (h + module.dse(h, module.token_ids.cids),) + tuple(args[1:]), kwargs
    h = kwargs["hidden_states"]
    return args, {**kwargs, "hidden_states": h + module.dse(h, module.token_ids.cids)}


class StemLlamaForCausalLM(LlamaForCausalLM):
    config_class = StemLlamaConfig

    def __init__(self, config):
        super().__init__(config)
        self._token_ids = _TokenIds()
        for layer, kind in zip(self.model.layers, config.ffn_kinds):
            spec = getattr(config, "ffn_modules", {}).get(kind) or {}
            if spec.get("module") not in MODULES:
                raise ValueError(f"ffn_modules[{kind!r}]: {spec!r}; expected a module among {', '.join(MODULES)}")
            layer.mlp = MODULES[spec["module"]](config, spec, self._token_ids)
        if getattr(config, "stem_rope", None):
            self.model.rotary_emb = PaperYarnRotaryEmbedding(config)
        self.has_dse = bool(getattr(config, "dse_hash", None))
        if self.has_dse:   # DSE vocabulary compression (a saved buffer) and the DSE layers
            self.register_buffer("dse_compress", torch.arange(config.vocab_size))
            for i, hc in config.dse_hash.items():
                layer = self.model.layers[int(i)]
                layer.dse, layer.token_ids = DSEMemory(config, hc["primes"], hc["multipliers"]), self._token_ids
                layer.register_forward_pre_hook(_dse_pre_hook, with_kwargs=True)
        self.post_init()

    def forward(self, input_ids=None, *args, **kwargs):
        if input_ids is None:
            raise ValueError("this model reads token ids in its FFN layers: pass input_ids, not inputs_embeds")
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if self.has_dse and cache is not None and cache.get_seq_length() > 0:
            raise ValueError("a model with DSE keeps no incremental N-gram state: run it without a KV cache "
                             "(use_cache=False)")
        self._token_ids.ids = input_ids
        self._token_ids.cids = self.dse_compress[input_ids] if self.has_dse else None
        try:
            return super().forward(input_ids, *args, **kwargs)
        finally:
            self._token_ids.ids = self._token_ids.cids = None
