"""Out again (issue 30 item 5; docs/real.md): a checkpoint exported by ``export-hf`` scores the same under lm-eval's
stock ``hf`` model as under the ``stem`` model, on a local lm-eval task made from a prompt-set file (no hub).

The task (``{prompt}`` -> ``{answer}`` loglikelihood, metrics ``acc`` (the answer is the greedy continuation) and
``perplexity``) is written from the facts file's templates and entities (``stem.analysis.editing.read_facts``):

    analysis:
      hf_parity: {stages: {350m: [midtrain]}, facts: reference/real/facts.yaml, tolerance: 1.0e-3}

Both models run through ``lm_eval.simple_evaluate`` in this process: ``model="hf"`` is the class ``lm_eval --model hf``
instantiates, with ``pretrained=EXPORT,dtype=float32,trust_remote_code=True``; the same as a command line::

    lm_eval --model hf --model_args pretrained=EXPORT,dtype=float32,trust_remote_code=True \\
        --tasks facts_loglik --include_path TASK_DIR --device cpu --log_samples --output_path OUT

The result holds both models' metrics, every request's loglikelihood under each, their max |difference| and whether it
is within ``tolerance`` (nats; fp32: transformers computes RoPE in fp32, the pipeline in fp64). A difference above it
fails the job in one line (a gate: the export does not compute the model), and nothing is written.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import lm_eval.models  # noqa: F401  (registers lm-eval's own models, "hf" among them)
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

from stem.analysis.editing import read_facts
from stem.eval.lm import StemLM

TASK = "facts_loglik"


def write_task(facts_path, out_dir) -> int:
    """The lm-eval task ``facts_loglik`` (YAML + JSONL) in ``out_dir``; returns its number of documents."""
    kinds, _ = read_facts(facts_path)
    docs = [{"prompt": f["templates"][r].format(e=name), "answer": answers[r]}
            for f in kinds.values() for r in f["templates"] for name, answers in f["entities"].items()]
    out = Path(out_dir)
    (out / "facts.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    task = {"task": TASK, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(out / "facts.jsonl")}},
            "test_split": "test", "output_type": "loglikelihood", "doc_to_text": "{{prompt}}",
            "doc_to_target": "{{answer}}", "target_delimiter": "",   # the answers carry their leading space
            "metric_list": [{"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
                            {"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
            "metadata": {"version": 1.0, "source": str(facts_path)}}
    (out / f"{TASK}.yaml").write_text(json.dumps(task), encoding="utf-8")   # JSON is YAML
    return len(docs)


def _evaluate(model, model_args, tm: TaskManager, batch_size: int, device: str) -> dict:
    return simple_evaluate(model=model, model_args=model_args, tasks=[TASK], task_manager=tm, device=device,
                           batch_size=batch_size, num_fewshot=0, log_samples=True, random_seed=0, bootstrap_iters=0)


def _scores(res: dict) -> tuple[dict, list[float]]:
    metrics = {k.split(",")[0]: float(v) for k, v in res["results"][TASK].items()
               if k.split(",")[0] in ("acc", "perplexity")}
    samples = sorted(res["samples"][TASK], key=lambda s: s["doc_id"])
    return metrics, [float(s["resps"][0][0][0]) for s in samples]


def compare(ckpt_dir, export_dir, facts_path, tolerance: float, device: str = "cpu", batch_size: int = 8) -> dict:
    with tempfile.TemporaryDirectory(prefix="hf_parity_") as tmp:
        n = write_task(facts_path, tmp)
        tm = TaskManager(include_path=tmp, include_defaults=False)
        lm = StemLM(str(ckpt_dir), device=device, batch_size=batch_size)
        device = str(lm.device)   # CPU where the requested CUDA is absent, for both models
        stem_m, stem_ll = _scores(_evaluate(lm, None, tm, batch_size, device))
        del lm   # one model in memory at a time
        hf_m, hf_ll = _scores(_evaluate("hf", {"pretrained": str(export_dir), "dtype": "float32",
                                               "trust_remote_code": True}, tm, batch_size, device))
    diff = check(stem_ll, hf_ll, n, tolerance, export_dir)
    return {"analysis": "hf_parity", "task": TASK, "documents": n, "facts": str(facts_path), "export": str(export_dir),
           "stem": stem_m, "hf": hf_m, "metric_difference": {k: hf_m[k] - stem_m[k] for k in stem_m},
           "max_abs_loglik_diff": diff, "tolerance": tolerance, "within_tolerance": diff <= tolerance,
           "loglik": {"stem": stem_ll, "hf": hf_ll},
           "command": f"lm_eval --model hf --model_args pretrained={export_dir},dtype=float32,trust_remote_code=True "
                      f"--tasks {TASK} --include_path TASK_DIR --device cpu"}


def check(stem_ll: list[float], hf_ll: list[float], n: int, tolerance: float, where) -> float:
    """The max |loglikelihood difference| of the two models' ``n`` requests; one line when it is above
    ``tolerance`` or a request is missing."""
    diff = max((abs(a - b) for a, b in zip(stem_ll, hf_ll)), default=float("inf"))
    if len(stem_ll) != n or len(hf_ll) != n or not diff <= tolerance:
        raise ValueError(f"hf_parity {where}: max |loglikelihood difference| {diff:.3g} over {len(hf_ll)} of {n} "
                         f"requests; expected <= {tolerance} on all (the export does not compute the checkpoint's "
                         "model)")
    return diff


def run(ckpt_dir, spec: dict) -> dict:
    return compare(ckpt_dir, spec["hf_export"], spec["facts"], spec["tolerance"], spec.get("device", "cpu"))

