"""CKA layer alignment (the DSE paper's Sec. 6, Eqs. 8-9, Fig. 3b-c): which baseline layer each DSE layer's
representations resemble.

Linear CKA between the hidden states X (n, d) of baseline layer i and Y (n, d') of DSE layer j on the same n
tokens, CKA = HSIC(K, L) / sqrt(HSIC(K, K) HSIC(L, L)) with K = X X^T, L = Y Y^T and HSIC the unbiased
estimator of Song et al. (2012) (``hsic1``), accumulated over minibatches of ``batch`` tokens as Nguyen et al.
(2021) and Davari et al. (2022) do: each of the three HSIC terms is the mean of its per-minibatch values.
S[i, j] is that CKA for every (baseline layer i, DSE layer j) pair of block outputs (0-based). The soft
alignment a_j (Eq. 9) is the S-weighted centroid of the ``topk`` baseline layers most similar to DSE layer j;
a_j > j means DSE layer j looks like a deeper baseline layer. The top-k centroid is biased at the ends (a_0 >= 0
is pulled up, a_{L-1} down, for any model), so the same index of the baseline against itself, a_j^self from
CKA(baseline, baseline), is kept as the reference: ``shift`` = a_j - a_j^self (0 for a copy of the baseline).

Tokens: the paper takes the final token of each named entity (Few-NERD). ``tokens: entities`` does the same
with the synthetic world's entity names (countries, capitals and cities, people) where they occur in the
held-out text (a source's validation split, ``windows`` windows of ``seq_len`` tokens): the position of the
last token of each occurrence, at most ``n_tokens`` of them. ``tokens: all`` takes the first ``n_tokens``
held-out tokens (a world-less experiment).
"""
from __future__ import annotations

import torch

from stem.analysis.common import encode, layer_outputs, load, load_baseline, val_windows, world_of


def hsic1(K: torch.Tensor, L: torch.Tensor) -> torch.Tensor:
    """Unbiased HSIC (Song et al. 2012, Eq. 5) of two n x n Gram matrices (n >= 4): with K~, L~ the matrices
    with zeroed diagonals, [tr(K~L~) + 1'K~1 1'L~1 / ((n-1)(n-2)) - 2/(n-2) 1'K~L~1] / (n(n-3))."""
    n = K.shape[0]
    if n < 4:
        raise ValueError(f"unbiased HSIC: needs at least 4 samples per minibatch, got {n}")
    K = K - torch.diag_embed(torch.diagonal(K))
    L = L - torch.diag_embed(torch.diagonal(L))
    KL = K @ L
    return (torch.trace(KL) + K.sum() * L.sum() / ((n - 1) * (n - 2)) - 2 * KL.sum() / (n - 2)) / (n * (n - 3))


def minibatch_cka(xs: list[torch.Tensor], ys: list[torch.Tensor], batch: int) -> torch.Tensor:
    """S[i, j] = linear CKA of xs[i] (n, d) and ys[j] (n, d') (rows: the same n tokens) over the ``n // batch``
    consecutive minibatches of ``batch`` rows (a remainder is left out): per-minibatch unbiased HSICs
    averaged, then the CKA ratio."""
    n = xs[0].shape[0]
    if any(t.shape[0] != n for t in xs + ys):
        raise ValueError("minibatch CKA: every layer's features must have the same tokens (rows)")
    nb = n // batch
    if nb < 1:
        raise ValueError(f"minibatch CKA: {n} tokens, fewer than one minibatch of {batch}")
    hxy, hxx, hyy = torch.zeros(len(xs), len(ys), dtype=torch.float64), torch.zeros(len(xs)), torch.zeros(len(ys))
    hxx, hyy = hxx.double(), hyy.double()
    for b in range(nb):
        sl = slice(b * batch, (b + 1) * batch)
        Ks = [x[sl].double() @ x[sl].double().T for x in xs]
        Ls = [y[sl].double() @ y[sl].double().T for y in ys]
        hxx += torch.stack([hsic1(K, K) for K in Ks])
        hyy += torch.stack([hsic1(L, L) for L in Ls])
        hxy += torch.stack([torch.stack([hsic1(K, L) for L in Ls]) for K in Ks])
    return hxy / torch.sqrt(hxx[:, None] * hyy[None, :])   # the 1/nb of each mean cancels


def soft_alignment(S, k: int) -> list[float]:
    """Eq. 9: for every column j, sum_{i in top-k of S[:, j]} S[i, j] i / sum S[i, j] (0-based i)."""
    S = torch.as_tensor(S, dtype=torch.float64)
    k = min(k, S.shape[0])
    out = []
    for j in range(S.shape[1]):
        val, idx = torch.topk(S[:, j], k)
        out.append(float((val * idx.double()).sum() / val.sum()))
    return out


def entity_names(world) -> list[str]:
    """The synthetic world's named entities: countries, their capitals and cities, people."""
    names = {c.name for c in world.countries} | {c.capital for c in world.countries}
    names |= {city for c in world.countries for city in c.cities} | {p.name for p in world.people}
    return sorted(names)


def entity_positions(tok, names: list[str], x: torch.Tensor) -> list[tuple[int, int]]:
    """(window, position) of the last token of every occurrence of a name (tokenised with a leading space, as
    it reads inside a sentence) in the windows ``x``, in text order; a name's tokens merging with a neighbour
    are simply not found."""
    pats: dict[int, list[list[int]]] = {}
    for n in names:
        ids = encode(tok, " " + n)
        pats.setdefault(ids[0], []).append(ids)
    out = set()
    for w, row in enumerate(x.tolist()):
        for t, first in enumerate(row):
            for p in pats.get(first, ()):
                if row[t:t + len(p)] == p:
                    out.add((w, t + len(p) - 1))
    return sorted(out)


@torch.no_grad()
def features(model, x: torch.Tensor, where: list[tuple[int, int]], batch: int = 8) -> list[torch.Tensor]:
    """Every block's output at the (window, position) pairs ``where``, (n, d) per layer."""
    device, per_layer = model.tok_emb.weight.device, None
    for b in range(0, len(x), batch):
        outs, _ = layer_outputs(model, x[b:b + batch].to(device))
        sel = [(w - b, t) for w, t in where if b <= w < b + batch]
        wi = torch.tensor([s[0] for s in sel], dtype=torch.long, device=device)
        ti = torch.tensor([s[1] for s in sel], dtype=torch.long, device=device)
        got = [h[wi, ti].double().cpu() for h in outs]
        per_layer = got if per_layer is None else [torch.cat([a, g]) for a, g in zip(per_layer, got)]
    return per_layer


def run(ckpt_dir, spec: dict) -> dict:
    model, tok, _ = load(ckpt_dir, spec.get("device", "cpu"))
    base, _, _ = load_baseline(ckpt_dir, spec)
    n = min(spec["seq_len"], model.cfg.max_seq_len, base.cfg.max_seq_len)
    starts, x = val_windows(spec["manifest"], n, spec["windows"])
    if spec["tokens"] == "entities":
        if not spec.get("world"):
            raise ValueError("analysis.cka.tokens 'entities': needs the synthetic world (config key 'world'); "
                             "use tokens: all")
        where = entity_positions(tok, entity_names(world_of(spec)), x)[:spec["n_tokens"]]
    elif spec["tokens"] == "all":
        where = [(w, t) for w in range(x.shape[0]) for t in range(x.shape[1])][:spec["n_tokens"]]
    else:
        raise ValueError(f"analysis.cka.tokens {spec['tokens']!r}: expected 'entities' or 'all'")
    n_tok = len(where)
    if n_tok < max(4, spec["batch"]):
        raise ValueError(f"analysis.cka: {n_tok} tokens found in {spec['windows']} held-out windows, fewer than one "
                         f"minibatch of {spec['batch']} (raise windows or lower batch)")
    fb = features(base, x, where)
    S = minibatch_cka(fb, features(model, x, where), spec["batch"])
    a = soft_alignment(S, spec["topk"])
    ref = soft_alignment(minibatch_cka(fb, fb, spec["batch"]), spec["topk"])
    return {"analysis": "cka", "source": spec["source"], "seq_len": n, "starts": starts.tolist(),
            "tokens": spec["tokens"], "n_tokens": n_tok, "minibatches": n_tok // spec["batch"],
            "batch": spec["batch"], "topk": spec["topk"], "baseline": spec["baseline"],
            "S": S.tolist(), "rows": "baseline layer i", "columns": "model layer j", "alignment": a,
            "self_alignment": ref, "shift": [aj - r for aj, r in zip(a, ref)]}
