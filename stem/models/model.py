"""Llama-style decoder: RMSNorm, RoPE, GQA attention through SDPA, per-layer FFN kinds, untied head.

``forward(ids, targets=None, positions=None, cache=None)``: ``positions`` (B, T) are per-token
positions that restart at 0 at each document start (supplied by the data loader, torchtitan style);
when given, attention is causal *within* documents only and RoPE uses them. Without them the model
is plainly causal with positions 0..T-1.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import lru_cache

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.nn.attention import SDPBackend, sdpa_kernel

from stem.models.attention import flex_document_mask
from stem.models.spec import LOSS_CHUNK, ModelConfig
from stem.models.dse import DSE_MODES, DSEMemory, token_compression
from stem.models.ffn import build_ffn
from stem.models.registry import OPTIM_GROUPS, check_facts, param_roles
from stem.models.rope import apply_rope, inv_frequencies, rope_cos_sin


# SDPA's kernels outside training, cuDNN's left out: it builds an execution plan per new shape, and evaluation and
# decoding change the shape every call (a KV cache one token longer, requests of other lengths). On an H100
# (torch 2.11) that cost about 75 ms per decoded token of the 1B model against a 13 ms step (docs/gpu.md,
# item f). Training's shapes are fixed, so it keeps SDPA's own choice. The CPU has no cuDNN attention: unchanged.
INFERENCE_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class KVCache:
    """Per-layer keys/values for incremental decoding (concatenation; fine for evaluation sizes)."""

    k: list = field(default_factory=list)
    v: list = field(default_factory=list)
    length: int = 0
    dse: dict = field(default_factory=dict)   # layer -> DSE memory state (its N-gram history and conv inputs)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if layer == len(self.k):
            self.k.append(k), self.v.append(v)
        else:
            self.k[layer] = torch.cat([self.k[layer], k], dim=2)
            self.v[layer] = torch.cat([self.v[layer], v], dim=2)
        return self.k[layer], self.v[layer]


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """Document index per token: a new document starts wherever the position resets to 0."""
    return (positions == 0).cumsum(dim=1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * self.hd, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.hd, cfg.d_model, bias=False)

    def forward(self, x, cos, sin, mask, cache: KVCache | None = None, layer: int = 0):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.hd).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv, self.hd).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        if callable(mask):  # a flex-attention block mask builder's result
            y = mask(q, k, v)
        elif self.training or not q.is_cuda:   # the CPU has no cuDNN: no context (~30 us, half a tiny SDPA)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                               enable_gqa=self.n_kv != self.n_heads)
        else:
            with sdpa_kernel(INFERENCE_SDPA):
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                   enable_gqa=self.n_kv != self.n_heads)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.kind = cfg.ffn[layer]
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.ffn = build_ffn(self.kind, cfg, layer)
        check_facts(self.kind, self.ffn, cfg, layer)   # the kind's registered facts (the DAG's) are its module's
        self.dse = DSEMemory(cfg, layer) if cfg.dse is not None and layer in cfg.dse.layers else None

    def forward(self, x, ids, cos, sin, mask, cache=None, layer=0, cids=None, doc_ids=None):
        if self.dse is not None:
            x = x + self.dse(x, cids, doc_ids, None if cache is None else cache.dse.setdefault(layer, {}))
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, cache, layer)
        return x + self.ffn(self.ffn_norm(x), ids)


def build_model(cfg: ModelConfig, device=None) -> "Transformer":
    """Instantiate the model (on ``device``; ``"meta"`` costs no memory)."""
    with torch.device(device or "cpu"):
        return Transformer(cfg)


@lru_cache(maxsize=None)
def meta_model(model_json: str) -> "Transformer":
    """The model of a spec's ``model`` JSON on the meta device, built once per distinct config (the workflow asks
    about the same few models for hundreds of jobs while it builds the DAG). Shared: read it, never change it."""
    return build_model(ModelConfig.from_dict(json.loads(model_json)), "meta")


TIED_HEAD = "lm_head.weight"   # with tie_embeddings it is tok_emb.weight: saved once, under the embedding's name


def saved_state(state: dict, cfg: ModelConfig | None) -> dict:
    """A state dict as written to disk: a tied model's head left out (it is the embedding; safetensors refuses two
    names for one tensor). ``cfg`` None: a module that is not a Transformer (saved as it is)."""
    return {k: v for k, v in state.items() if not (cfg is not None and cfg.tie_embeddings and k == TIED_HEAD)}


def loaded_state(state: dict, cfg: ModelConfig | None) -> dict:
    """A state dict read from disk, for a model built from ``cfg`` (None: not a Transformer, read as it is): a tied
    model's head is its embedding."""
    if cfg is not None and cfg.tie_embeddings and TIED_HEAD not in state and "tok_emb.weight" in state:
        return {**state, TIED_HEAD: state["tok_emb.weight"]}
    return state


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)  # untied (Sec. 4.1) unless tie_embeddings
        self.tie_weights()
        inv_freq, self.rope_mscale = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # DSE vocabulary compression (identity until set from the tokenizer; saved with the weights).
        self.register_buffer("dse_compress", torch.arange(cfg.vocab_size), persistent=cfg.dse is not None)
        self.flex_mask_fn = None  # stem.models.attention.flex_document_mask (set_training_options, CUDA)
        # modules adding an auxiliary loss to the training objective (stem.models.registry); a plain list, so
        # they are not registered twice
        self.aux_modules = [m for m in self.modules() if m is not self and hasattr(m, "aux_loss")]
        self.aux_loss = None
        self.activation_checkpointing = False
        if self.inv_freq.device.type != "meta":
            self.init_weights()

    def tie_weights(self):
        """With ``tie_embeddings`` the LM head is the token embedding: one parameter under two names."""
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def to_empty(self, *, device, recurse: bool = True):
        """``nn.Module.to_empty`` (materialise a meta model), tied again: it gives each name its own tensor."""
        super().to_empty(device=device, recurse=recurse)
        self.tie_weights()
        return self

    # ---- initialisation -------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed: int | None = None):
        if seed is not None:
            torch.manual_seed(seed)
        std, out_std = self.cfg.init_std, self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # norms are initialised to ones by their modules
            nn.init.normal_(p, std=out_std if name.endswith(("wo.weight", "w_down.weight", "w_down")) else std)
        for m in self.modules():  # parameters whose declared role says their module initialises them
            if any(r.init == "module" for r in (getattr(m, "param_roles", None) or {}).values()):
                m.reset_parameters()
            elif isinstance(m, nn.RMSNorm):
                nn.init.ones_(m.weight)
        self.inv_freq.copy_(inv_frequencies(self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling)[0])
        self.dse_compress.copy_(torch.arange(self.cfg.vocab_size))
        for m in self.modules():   # DSE hash constants: buffers not saved with the weights
            if isinstance(m, DSEMemory):
                m.reset_buffers()

    def set_training_options(self, activation_checkpointing: bool = False, flex_attention: bool = False):
        """How training runs, not what it computes: recompute each block in backward (activation
        checkpointing); build packed rows' document masks with flex attention (used on CUDA only)."""
        self.activation_checkpointing = activation_checkpointing
        self.flex_mask_fn = None
        if flex_attention:
            self.flex_mask_fn = flex_document_mask

    def set_dse_vocabulary(self, tok):
        """DSE's vocabulary compression from the tokenizer's token texts (saved with the weights)."""
        self.dse_compress.copy_(token_compression(tok, self.cfg.vocab_size).to(self.dse_compress.device))

    def set_dse_mode(self, mode: str):
        """Inference-only override of every DSE gate (stem.models.dse: ``normal``, ``disabled``, ``forced``);
        changes no parameter or buffer, so neither training nor checkpoints see it."""
        if mode not in DSE_MODES:
            raise ValueError(f"dse_mode {mode!r}: expected one of {', '.join(DSE_MODES)}")
        mems = [m for m in self.modules() if isinstance(m, DSEMemory)]
        if not mems and mode != "normal":
            raise ValueError(f"dse_mode {mode!r}: this model has no DSE memory")
        for m in mems:
            m.mode = mode

    # ---- forward --------------------------------------------------------------------------------
    def forward(self, ids, targets=None, positions=None, cache: KVCache | None = None, attn_mask=None):
        """``attn_mask`` (with ``positions``) overrides the mask built here, e.g. for left-padded batched
        decoding; it is a boolean (B, 1, T, S) mask of allowed keys."""
        b, t = ids.shape
        offset = cache.length if cache is not None else 0
        length = offset + t if attn_mask is None else int(positions.max()) + 1
        if length > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {length} exceeds max_seq_len={self.cfg.max_seq_len} "
                             "(raise max_seq_len together with a rope_scaling for longer contexts)")
        doc_ids = None
        if attn_mask is not None:
            mask = attn_mask
        elif positions is None:
            positions = torch.arange(offset, offset + t, device=ids.device).expand(b, t)
            mask = None if offset == 0 else self._cache_mask(t, offset, ids.device)
        else:
            doc_ids = document_ids(positions)
            mask = self.document_mask(doc_ids)
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.rope_mscale)
        cids = self.dse_compress[ids] if self.cfg.dse is not None else None
        x = self.tok_emb(ids)
        for i, layer in enumerate(self.layers):
            if self.activation_checkpointing and self.training and cache is None:
                x = torch.utils.checkpoint.checkpoint(layer, x, ids, cos, sin, mask, None, i, cids, doc_ids,
                                                      use_reentrant=False)
            else:
                x = layer(x, ids, cos, sin, mask, cache, i, cids, doc_ids)
        if cache is not None:
            cache.length += t
        aux = self._take_aux_losses()
        if targets is None:
            return self.lm_head(self.norm(x))
        if self.activation_checkpointing and self.training and cache is None:
            loss = self._chunked_loss(x, targets)
        else:
            logits = self.lm_head(self.norm(x))
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        if aux is None:
            return loss
        self.aux_loss = aux.detach()
        return loss + aux

    def _chunked_loss(self, x, targets):
        """Activation checkpointing's loss: the final norm, the head and the cross-entropy of ``LOSS_CHUNK`` tokens
        at a time, each recomputed in backward, so one chunk's fp32 logits are alive rather than the
        micro-batch's (12 B x vocabulary a token: 47 GiB for 32,768 tokens of a 128,256-token vocabulary); the
        same token mean."""
        x, y = x.reshape(-1, x.size(-1)), targets.reshape(-1)
        total = sum(torch.utils.checkpoint.checkpoint(self._loss_sum, x[i:i + LOSS_CHUNK], y[i:i + LOSS_CHUNK],
                                                      use_reentrant=False) for i in range(0, y.numel(), LOSS_CHUNK))
        return total / (y != -1).sum()

    def _loss_sum(self, x, y):
        return F.cross_entropy(self.lm_head(self.norm(x)).float(), y, ignore_index=-1, reduction="sum")

    def _take_aux_losses(self):
        """The sum of the auxiliary losses this forward's modules set (``aux_loss``, stem.models.registry: the
        routed MoE's balance losses), None if none (eval mode, or no such module); each is reset to None, so
        no graph outlives its forward. The last sum is kept, detached, as ``self.aux_loss`` (for the log)."""
        self.aux_loss = None
        if not self.aux_modules:
            return None
        taken = [m.aux_loss for m in self.aux_modules if m.aux_loss is not None]
        for m in self.aux_modules:
            m.aux_loss = None
        return torch.stack(taken).sum() if taken else None

    def document_mask(self, doc_ids):
        if self.flex_mask_fn is not None and doc_ids.is_cuda:
            return self.flex_mask_fn(doc_ids)
        t = doc_ids.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=doc_ids.device).tril()
        return ((doc_ids.unsqueeze(2) == doc_ids.unsqueeze(1)) & causal).unsqueeze(1)

    @staticmethod
    def _cache_mask(t, offset, device):
        q = torch.arange(offset, offset + t, device=device).unsqueeze(1)
        return torch.arange(offset + t, device=device).unsqueeze(0) <= q

    # ---- parameter groups and accounting ---------------------------------------------------------
    def param_groups(self) -> dict[str, list[nn.Parameter]]:
        """Named optimizer groups, in ``OPTIM_GROUPS`` order: a parameter's declared role names its group,
        else ``norm`` (1-D) or ``matrix``. Asserts that they cover every parameter exactly once."""
        roles = param_roles(self)
        groups: dict[str, list] = {name: [] for name in OPTIM_GROUPS}
        for p in self.parameters():
            key = roles[id(p)].group if id(p) in roles else "norm" if p.dim() < 2 else "matrix"
            groups[key].append(p)
        n_grouped = sum(p.numel() for ps in groups.values() for p in ps)
        assert n_grouped == sum(p.numel() for p in self.parameters()), "optimizer groups miss parameters"
        return {k: v for k, v in groups.items() if v}
