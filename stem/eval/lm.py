"""The ``stem`` model for lm-evaluation-harness: a checkpoint folder written by the training stages.

    stem-lm-eval --model stem --model_args pretrained=results/tiny/1b/stem/extend/checkpoint ...
    (lm-eval's own CLI, every flag unchanged, with this model registered: see lm_eval_cli.py;
    the stock ``lm_eval`` command cannot load models defined outside lm-eval's tree)
    simple_evaluate(model="stem", model_args={"pretrained": ckpt_dir, "batch_size": 32}, ...)
    model_args ``offload=true,cache_rows=N``: STEM tables off the device (stem.models.offload), N cached rows
    model_args ``dse_mode=disabled|forced``: the DSE gate forced to 0 or 1 (the DSE paper's App. G; stem.models.dse)

    model_args ``truncation=left|middle|error``: what a request longer than the context keeps (``truncate``)

- ``loglikelihood``: requests sorted by length (longest first), truncated to the model's context
  (``truncation``), right-padded into batches (causal attention: padding never changes the real positions,
  so results do not depend on the batch size beyond float round-off).
- ``loglikelihood_rolling``: non-overlapping windows of the model's context (perplexity).
- ``generate_until``: greedy decoding with a KV cache (recomputation for models without one),
  stopping at EOS, at any stop string (cut off) or after ``max_gen_toks`` tokens; the prompt truncated to the
  context less ``max_gen_toks``.

Every truncated request is counted per task (``truncation_counts``: the eval JSON's ``truncation``).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from stem.checkpoint import load_checkpoint, load_offloaded
from stem.data.tokenizer import load_tokenizer
from stem.eval.generate import greedy_generate, greedy_generate_batch
from stem.options import Truncation, values


def load_for_eval(ckpt_dir, device: str | None = None, dtype: str | None = None, offload: bool = False,
                  cache_rows: int = 0):
    """(model, tokenizer, spec) from a checkpoint folder, in eval mode; clear errors on bad folders. With
    ``offload`` the STEM tables stay off the device (stem.models.offload; ``model.offload_engine``) and are
    never read into memory whole: only the rest of the model is loaded, on ``device``."""
    ckpt = Path(ckpt_dir)
    if not ckpt.is_dir():
        raise ValueError(f"checkpoint {ckpt}: no such folder (train that stage first)")
    if not (ckpt / "tokenizer.json").is_file():
        raise ValueError(f"checkpoint {ckpt}: tokenizer.json is missing (an incomplete or foreign checkpoint)")
    device = pick_device(device)
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    if offload:
        try:
            model, spec = load_offloaded(ckpt, device, getattr(torch, dtype), cache_rows)
        except ValueError as e:
            raise ValueError(f"checkpoint {ckpt}: {e}") from None
    else:
        model, spec = load_checkpoint(ckpt, device)
        model = model.to(getattr(torch, dtype)).eval()
    tok = load_tokenizer(ckpt / "tokenizer.json")
    if tok.vocab_size > model.cfg.vocab_size:
        raise ValueError(f"checkpoint {ckpt}: tokenizer vocab {tok.vocab_size} > model vocab {model.cfg.vocab_size}")
    return model, tok, spec


def pick_device(requested: str | None) -> str:
    """The device to run on: ``requested`` if this machine has it, else the one it has. lm-eval's CLI
    passes ``cuda:0`` when no ``--device`` is given, so a missing CUDA falls back to the CPU (said on
    stderr) instead of failing; the choice is always printed."""
    have_cuda = torch.cuda.is_available()
    device = requested or ("cuda" if have_cuda else "cpu")
    if device.startswith("cuda") and not have_cuda:
        print(f"stem: device {requested!r} requested but this machine has no CUDA; using cpu", file=sys.stderr)
        device = "cpu"
    elif device.startswith("mps") and not torch.backends.mps.is_available():
        print(f"stem: device {requested!r} requested but MPS is not available; using cpu", file=sys.stderr)
        device = "cpu"
    print(f"stem: evaluating on device {device}", file=sys.stderr)
    return device


@register_model("stem")
class StemLM(TemplateLM):
    def __init__(self, pretrained: str, device: str | None = None, dtype: str | None = None,
                 batch_size: int | str = 32, max_gen_toks: int = 256, max_length: int | None = None,
                 use_cache: bool = True, offload: bool | str = False, cache_rows: int | str = 0,
                 dse_mode: str = "normal", truncation: str = "left", **kwargs):
        super().__init__()
        offload = _flag("offload", offload)
        if not str(cache_rows).isdigit():
            raise ValueError(f"model argument cache_rows={cache_rows!r}: expected a whole number of rows >= 0")
        if offload is False and int(cache_rows):
            raise ValueError(f"cache_rows={cache_rows}: a row cache needs offload=true")
        self.model, self.tok, self.spec = load_for_eval(pretrained, device, dtype, offload, int(cache_rows))
        self.model.set_dse_mode(dse_mode)   # the DSE gate override of App. G (inference only)
        self.offload = getattr(self.model, "offload_engine", None)  # counters: self.offload.stats()
        self._device = next(self.model.parameters()).device
        self.batch_size = 32 if batch_size in ("auto", None) else int(batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self._max_length = int(max_length or self.model.cfg.max_seq_len)
        self.use_cache = bool(use_cache)
        self.pretrained = str(pretrained)
        self.set_truncation(truncation)
        self._tasks = None   # the task of each request of the loglikelihood call under way

    # ---- truncation -----------------------------------------------------------------------------
    def set_truncation(self, policy: str) -> None:
        """The policy for requests longer than the context (``truncate``); the counts start again."""
        if policy not in values(Truncation):
            raise ValueError(f"truncation={policy!r}: expected one of {', '.join(values(Truncation))}")
        self.truncation = policy
        self.truncation_counts: dict = {}   # task -> {"requests", "truncated", "tokens_dropped"}

    def _fit(self, ids: list[int], room: int, task, policy: str | None = None, keep_last: int = 0) -> list[int]:
        """``ids`` in ``room`` tokens by the policy (``truncate``), counted under ``task``."""
        n = self.truncation_counts.setdefault(task, {"requests": 0, "truncated": 0, "tokens_dropped": 0})
        n["requests"] += 1
        if len(ids) <= room:
            return ids
        policy = policy or self.truncation
        if policy == Truncation.ERROR:
            raise ValueError(f"truncation=error: a request of task {task} has {len(ids)} tokens, more than the "
                             f"{room} the model's context leaves it (max_length {self.max_length}); expected a "
                             f"prompt that fits, or the suite's truncation: left or middle")
        if not n["truncated"]:   # said once per task (lm-eval's CLI users have no eval JSON)
            print(f"stem: task {task}: a request of {len(ids)} tokens cut to {room} (truncation={policy}); "
                  "further cuts are counted, not printed", file=sys.stderr)
        n["truncated"] += 1
        kept = truncate(ids, room, policy, keep_last)
        n["tokens_dropped"] += len(ids) - len(kept)
        return kept

    # ---- tokenizer ------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self):
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return self.pretrained

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return self.tok.encode_batch([string])[0]

    def tok_decode(self, ids) -> str:
        return self.tok.decode(ids)

    # ---- loglikelihood --------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False):
        self._tasks = [getattr(r, "task_name", None) for r in requests]   # TemplateLM drops them: for the counts
        try:
            return super().loglikelihood(requests, disable_tqdm)
        finally:
            self._tasks = None

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, tasks=None, **kwargs):
        """requests: [(cache_key, context_ids, continuation_ids)] -> [(logprob, is_greedy)]; ``tasks``: the
        task of each (for the truncation counts; default: those of the loglikelihood call under way)."""
        tasks = tasks or self._tasks or [None] * len(requests)
        rows = []  # (index, input ids, number of continuation tokens)
        for i, (_, ctx, cont) in enumerate(requests):
            if not cont:
                raise ValueError("loglikelihood request with an empty continuation")
            whole = self._fit(ctx + cont, self.max_length + 1, tasks[i], keep_last=len(cont))  # the context window
            rows.append((i, whole[:-1], whole[len(whole) - len(cont):]))
        rows.sort(key=lambda r: -len(r[1]))
        out: list = [None] * len(rows)
        for b in range(0, len(rows), self.batch_size):
            batch = rows[b:b + self.batch_size]
            width = len(batch[0][1])
            x = torch.zeros(len(batch), width, dtype=torch.long)
            for j, (_, inp, _) in enumerate(batch):
                x[j, :len(inp)] = torch.tensor(inp)
            logits = self.model(x.to(self.device))
            for j, (i, inp, cont) in enumerate(batch):
                n = len(cont)
                lp = F.log_softmax(logits[j, len(inp) - n:len(inp)].float(), dim=-1)
                target = torch.tensor(cont, device=lp.device)
                out[i] = (float(lp.gather(1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all()))
        for (key, _, _), res in zip(requests, out):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        windows, owners = [], []
        for i, req in enumerate(requests):
            ids = self.tok_encode(req.args[0])
            for w in get_rolling_token_windows(ids, self.eot_token_id, self.max_length, context_len=1):
                ctx, cont = make_disjoint_window(w)
                windows.append((None, ctx, cont))
                owners.append(i)
        scores = self._loglikelihood_tokens(windows, tasks=[getattr(requests[i], "task_name", None) for i in owners])
        totals = [0.0] * len(requests)
        for i, (lp, _) in zip(owners, scores):
            totals[i] += lp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    # ---- generation -----------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False):
        """Requests with the same stop strings and budget are decoded together, longest first."""
        groups: dict = {}
        for i, req in enumerate(requests):
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            if kwargs.get("do_sample"):
                raise ValueError("the stem model decodes greedily only (do_sample=True requested)")
            until = kwargs.get("until") or []
            until = (until,) if isinstance(until, str) else tuple(until)
            key = (until, int(kwargs.get("max_gen_toks", self.max_gen_toks)))
            groups.setdefault(key, []).append(i)
        out: list = [None] * len(requests)
        for (until, max_new), idx in groups.items():
            texts = self.generate_many([requests[i].args[0] for i in idx], list(until), max_new,
                                       [getattr(requests[i], "task_name", None) for i in idx])
            for i, text in zip(idx, texts):
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out

    @torch.no_grad()
    def generate_many(self, contexts: list[str], until: list[str], max_new: int, tasks=None,
                      truncation: str | None = None) -> list[str]:
        """Greedy continuations, cut before the first stop string; batches of similar lengths. ``tasks``: the
        task of each context (truncation counts); ``truncation``: this call's policy over the model's."""
        max_new = max(1, min(max_new, self.max_length - 1))
        tasks = tasks or [None] * len(contexts)
        prompts = [self._fit(ids, self.max_length - max_new, task, truncation) or [self.eot_token_id]
                   for ids, task in zip(self.tok.encode_batch(contexts), tasks)]
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        stop = (lambda toks: any(s in self.tok_decode(toks) for s in until)) if until else None
        out: list = [None] * len(prompts)
        for b in range(0, len(order), self.batch_size):
            idx = order[b:b + self.batch_size]
            if self.use_cache:
                gens = greedy_generate_batch(self.model, [prompts[i] for i in idx], max_new, self.eot_token_id, stop)
            else:
                gens = [greedy_generate(self.model, prompts[i], max_new, self.eot_token_id, False, stop) for i in idx]
            for i, g in zip(idx, gens):
                out[i] = cut_at_stop(self.tok_decode(g), until)
        return out

    def generate(self, context: str, until: list[str], max_new: int) -> str:
        return self.generate_many([context], until, max_new)[0]


def truncate(ids: list, room: int, policy: str, keep_last: int = 0) -> list:
    """``ids`` cut to at most ``room`` tokens: ``left`` keeps the last ``room`` (lm-eval's models); ``middle`` is
    LongBench's pred.py exactly (``tokens[:half] + tokens[-half:]``, half = room // 2: 2 * floor(room / 2) tokens)
    applied to all but the last ``keep_last`` tokens (a scored continuation: kept whole, outside the halves, as
    pred.py cuts the prompt to the room the answer leaves)."""
    if len(ids) <= room:
        return ids
    if policy == Truncation.LEFT:
        return ids[len(ids) - room:]
    if policy == Truncation.MIDDLE:
        keep = min(keep_last, room)
        body, half = ids[:len(ids) - keep], (room - keep) // 2
        return body[:half] + body[len(body) - half:] + ids[len(ids) - keep:]
    raise ValueError(f"truncation={policy!r}: expected left or middle to cut a request")


def _flag(name: str, value) -> bool:
    """A boolean model argument: True/False, or the strings true/false (lm-eval passes strings as typed)."""
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "false"):
        return str(value).lower() == "true"
    raise ValueError(f"model argument {name}={value!r}: expected true or false")


def cut_at_stop(text: str, until: list[str]) -> str:
    """Text before the earliest stop string."""
    for s in until:
        if s:
            text = text.split(s, 1)[0]
    return text
