"""A suite kind as a plugin module (config ``plugins: [toy_suite_kind]``; tests/test_plugins.py): the mean
log-probability of each pair's continuation given its context, pairs from a JSON file. Torch-free at import."""
import json
from dataclasses import dataclass

from stem.eval.spec import SuiteSettings, suite_kind


@dataclass(frozen=True, kw_only=True)
class ToySettings(SuiteSettings):   # the suite's keys: any other is refused at the config check
    pairs_file: str | None = None   # default data/<experiment>/toy_pairs.json


def _resolve(exp, spec: dict) -> None:   # completes the suite's spec from the experiment config
    spec.setdefault("pairs_file", f"data/{exp.experiment}/toy_pairs.json")


def _inputs(exp, spec: dict) -> dict:    # the eval job's inputs besides the checkpoint
    return {"pairs": spec["pairs_file"]}


@suite_kind("toy_logprob", resolve=_resolve, inputs=_inputs, settings=ToySettings)
def toy_logprob(lm, spec: dict, limit=None):
    from lm_eval.api.instance import Instance   # lm-eval: heavy, only in the eval job
    with open(spec["pairs_file"]) as f:
        pairs = json.load(f)[:limit]
    lps = [lp for lp, _ in lm.loglikelihood([Instance("loglikelihood", {}, tuple(p), i) for i, p in enumerate(pairs)])]
    mean = sum(lps) / len(lps)
    entry = {"metric": "mean_logprob", "value": mean, "stderr": None, "n": len(pairs), "version": "toy-1"}
    return {"tasks": {spec["suite"]: entry}, "groups": {}}, {"logprobs": lps}, "tests.toy_suite_kind"
