"""What the analyses share: loading a checkpoint, finding its token-indexed tables, scoring continuations."""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.nn.functional as F

from stem.checkpoint import check_identity, load_checkpoint, read_checkpoint_spec
from stem.data.shards import ShardSet
from stem.data.synth import make_world
from stem.data.tokenizer import load_tokenizer
from stem.models.registry import param_roles

TINY_NOTE = "tiny experiment: CPU-sized stand-in models on a synthetic world, never comparable to the paper's scale"


def load(ckpt_dir, device: str = "cpu"):
    """(model in eval mode in float32 on ``device`` (CPU when CUDA is absent), tokenizer, saved job spec);
    one-line errors on bad folders."""
    ckpt = Path(ckpt_dir)
    if not (ckpt / "tokenizer.json").is_file():
        raise ValueError(f"checkpoint {ckpt}: tokenizer.json is missing (not a finished checkpoint folder)")
    device = device if device.startswith("cuda") and torch.cuda.is_available() else "cpu"
    model, spec = load_checkpoint(ckpt, device)
    return model.float().eval(), load_tokenizer(ckpt / "tokenizer.json"), spec


def load_baseline(ckpt_dir, spec: dict):
    """The baseline checkpoint a comparative analysis reads (``spec["baseline_checkpoint"]``: the same
    experiment/scale/stage's ``spec["baseline"]`` variant) as ``load`` gives it; one-line error when it is not
    tokenised like ``ckpt_dir`` (the analyses compare the two models on the same token ids)."""
    base = Path(spec["baseline_checkpoint"])
    ours = Path(ckpt_dir) / "tokenizer.json"
    if (base / "tokenizer.json").is_file() and ours.is_file() and \
            (base / "tokenizer.json").read_bytes() != ours.read_bytes():
        raise ValueError(f"baseline checkpoint {base}: its tokenizer.json differs from {ours} (the baseline must "
                         "be a model of the same scale)")
    job = spec.get("job")   # the baseline: the job's experiment/scale/stage, variant spec["baseline"]
    expected = {**job, "variant": spec["baseline"]} if job and spec.get("baseline") else None
    check_identity(base, read_checkpoint_spec(base), expected, f"this analysis job's baseline ({spec.get('baseline')})")
    return load(base, spec.get("device", "cpu"))


def manifest_dir(manifest) -> Path:
    """The token-shard folder of ``manifest`` (a tokens ``manifest.json``); one line naming the file given when
    it is missing or not one (ShardSet reads its folder's manifest.json, not another file beside it)."""
    p = Path(manifest)
    if not p.is_file():
        raise ValueError(f"{p}: no such file (expected a tokens manifest.json written by the tokenize stage)")
    if p.name != "manifest.json":
        raise ValueError(f"{p}: not a token-shard manifest (expected the manifest.json of a tokenize stage's "
                         f"folder, e.g. data/<experiment>/tokens/<scale>/<source>/manifest.json)")
    return p.parent


def val_windows(manifest, n: int, windows: int):
    """(starts, ``windows`` windows of ``n`` tokens (LongTensor)) at evenly spaced offsets of the validation
    split of a source's token shards (the same windows for every model of a scale)."""
    shards = ShardSet(manifest_dir(manifest), "val")
    if len(shards) < n:
        raise ValueError(f"{manifest}: validation split has {len(shards)} tokens, fewer than one window of {n}")
    starts, rows = shards.windows(n, windows)
    return starts, torch.from_numpy(rows)


@torch.no_grad()
def layer_outputs(model, ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(every block's output hidden state (B, T, d), in layer order; the logits) of one ordinary forward pass,
    read by forward hooks on ``model.layers`` (removed afterwards, also on an error)."""
    outs: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda m, args, out: outs.append(out)) for layer in model.layers]
    try:
        logits = model(ids)
    finally:
        for h in hooks:
            h.remove()
    return outs, logits


def table_sites(model) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, weight) of every token-indexed table the model declares (role count ``lookup`` counted in the
    paper's table convention: the STEM tables, one per STEM layer), in layer order."""
    roles = param_roles(model)
    return [(n, p) for n, p in model.named_parameters()
            if id(p) in roles and roles[id(p)].count == "lookup" and roles[id(p)].paper_table]


def stem_layers(model) -> list[int]:
    """Indices of the layers holding a STEM table."""
    return sorted({int(n.split(".")[1]) for n, _ in table_sites(model) if n.startswith("layers.")})


def state_digest(model) -> str:
    """sha256 over every parameter and buffer's bytes (to check that an edit was undone bit for bit)."""
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def encode(tok, text: str) -> list[int]:
    return tok.encode_batch([text])[0]


@torch.no_grad()
def score_many(model, queries: list[tuple[list[int], list[list[int]]]], max_tokens: int = 8192):
    """For each (prompt, candidates): (sum log-probability of each candidate continuation after the prompt,
    the next-token log-probabilities after the prompt). Rows are right-padded into batches of at most
    ``max_tokens`` padded tokens (bounds the logits at a large vocabulary); causal attention keeps each row's
    real positions exact."""
    rows = [(qi, ci, p + c, len(p)) for qi, (p, cands) in enumerate(queries) for ci, c in enumerate(cands)]
    scores = [torch.empty(len(c)) for _, c in queries]
    nxt: list = [None] * len(queries)
    device = model.tok_emb.weight.device
    b = 0
    while b < len(rows):
        width = len(rows[b][2])
        e = b + 1
        while e < len(rows) and max(width, len(rows[e][2])) * (e + 1 - b) <= max_tokens:
            width = max(width, len(rows[e][2]))
            e += 1
        chunk = rows[b:e]
        x = torch.zeros(len(chunk), width, dtype=torch.long)
        for i, r in enumerate(chunk):
            x[i, :len(r[2])] = torch.tensor(r[2])
        logp = F.log_softmax(model(x.to(device)).float(), dim=-1)
        for i, (qi, ci, ids, n) in enumerate(chunk):
            pos = torch.arange(n - 1, len(ids) - 1, device=device)
            scores[qi][ci] = logp[i, pos, torch.tensor(ids[n:], device=device)].sum().cpu()
            if nxt[qi] is None:
                nxt[qi] = logp[i, n - 1].cpu()
        b = e
    return list(zip(scores, nxt))


def find_span(ids: list[int], span: list[int]) -> int:
    """Start of the first occurrence of ``span`` in ``ids``."""
    for i in range(len(ids) - len(span) + 1):
        if ids[i:i + len(span)] == span:
            return i
    raise ValueError(f"entity tokens {span} not found in prompt tokens {ids} (the tokenizer merges across the "
                     "entity's boundary: use a template with a space before the entity)")


def world_of(spec: dict):
    return make_world(**spec["world"])


def rel(path) -> str:
    return str(Path(path))
