import json
import sys

from snakemake.utils import validate

sys.path.insert(0, workflow.basedir)
from stem import config as C  # noqa: E402

try:  # one clear line naming the key first; then Snakemake's own schema validation (same schema)
    C.validate_experiment(config, origin="workflow config")
except C.ConfigError as e:
    raise WorkflowError(str(e))
validate(config, schema="../config/schema.yaml")

EXP = config["experiment"]
ENV = "../environment.yml"


wildcard_constraints:
    experiment=EXP,
    scale="|".join(C.SCALES),
    variant="[a-z_]+",
    stage="|".join(C.STAGES),
    source="[A-Za-z0-9_]+",


def as_json(obj):
    return json.dumps(obj, sort_keys=True)


def train_outputs():
    return [f"{C.stage_dir(EXP, s, v, st)}/summary.json" for s, v, st in C.train_targets(config)]


def params_tables():
    return expand("reports/{exp}/params.{ext}", exp=EXP, ext=["csv", "md"])


def train_inputs(w):
    """Tokenizer, token shards of the stage's mixture, and the previous stage's checkpoint (if any)."""
    spec = C.train_spec(config, w.scale, w.variant, w.stage)
    inputs = {"tokenizer": spec["tokenizer"]}
    inputs.update({f"tokens_{src}": C.tokens_dir(EXP, w.scale, src) for src in spec["data"]})
    if spec["init_from"]:
        inputs["init"] = spec["init_from"]
    return inputs
