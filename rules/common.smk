import json
import math
import sys

sys.path.insert(0, workflow.basedir)
from stem import config as C  # noqa: E402
from stem import layout as L  # noqa: E402  (every path of the workflow)
from stem.train.plan import cluster_train  # noqa: E402  (torch-free: a training job's nodes and GPUs)

try:  # the typed tree (stem.config.experiment), built once: types, ranges, cross-references; one line naming the key
    EXPERIMENT = C.experiment.parse(config, origin="workflow config")
except C.ConfigError as e:
    raise WorkflowError(str(e))

EXP = EXPERIMENT.experiment
ENV = "../environment.yml"


wildcard_constraints:
    experiment=EXP,
    scale="|".join(C.SCALES),
    variant="[a-z][a-z0-9_]*",  # named variants and sweep points (rho_0p75, slots_4096)
    stage="|".join(C.STAGES),
    source="[A-Za-z0-9_]+",
    part=r"part\d{5}-of-\d{5}",


def as_json(obj):
    return json.dumps(obj, sort_keys=True)


def train_outputs():
    return [L.summary(EXP, s, v, st) for s, v, st in C.train_targets(EXPERIMENT) + C.seed_targets(EXPERIMENT)]


def params_tables():
    return [L.params_file(EXP, ext) for ext in L.PARAMS_FILES]


def train_inputs(w):
    """Tokenizer, token shards of the stage's mixture, and the previous stage's checkpoint (if any)."""
    spec = C.train_spec(EXPERIMENT, w.scale, w.variant, w.stage)
    inputs = {"tokenizer": spec["tokenizer"]}
    inputs.update({f"tokens_{src}": d["manifest"] for src, d in spec["data"].items()})   # a knowledge point: its own
    cal = (spec.get("insert") or {}).get("calibration")
    if cal and cal["source"] not in spec["data"]:   # init calibrated on another source than the stage's data
        inputs[f"tokens_{cal['source']}"] = cal["manifest"]
    if cal and cal.get("step0"):   # init calibrated's choice: the best of the step-0 analysis (stem.train.calibration)
        inputs["step0"] = cal["step0"]
    if cal and cal.get("entities"):   # the dense model's texts about the facts' entities (rule entity_text)
        inputs["entity_text"] = cal["entities"]["out"]
    if spec["init_from"] and not spec["init_from"].startswith(C.HF_PREFIX):   # hf: read when the job starts
        inputs["init"] = spec["init_from"]
    return inputs


# ---- Slurm resources from the experiment config's `cluster:` section (see rules/train.smk) ----
def cluster_resources(kind, scale=None):
    """sbatch resources of one job kind: "train" (at a scale), "eval" (one GPU) or "cpu" (none)."""
    cl = EXPERIMENT.cluster
    res = {res_key: getattr(cl, key) for key, res_key in (("partition", "slurm_partition"), ("account", "slurm_account"),
                                                           ("constraint", "constraint")) if getattr(cl, key)}
    if kind == "train":
        t = cluster_train(EXPERIMENT, scale)   # the job's world size in the job itself: stem.train.plan.job_layout
        nodes, gpus = t.nodes, t.gpus_per_node
        res.update(nodes=nodes, runtime=t.runtime,
                   cpus_per_task=t.cpus or gpus * (t.cpus_per_gpu or 1) or 1,
                   mem_mb=t.mem_mb or gpus * (t.mem_mb_per_gpu or 0) or 4000)
        if gpus and nodes == 1:
            res["gpu"] = gpus  # sbatch --gpus=G; the jobstep's srun gets --gpus=G too
        elif gpus:  # per-node GPUs, one task (one torchrun) per node; tasks_per_gpu=0 keeps --ntasks-per-gpu off
            res.update(gres=f"gpu:{gpus}", mpi="srun", tasks=nodes, tasks_per_gpu=0)
        return res
    j = cl.job(kind)
    res.update(runtime=j.runtime or 60, mem_mb=j.mem_mb or 4000)
    if j.cpus:
        res["cpus_per_task"] = j.cpus
    if j.gpus:
        res["gpu"] = j.gpus
    return res


def state_bytes(scale, variant, stage):
    """Bytes of a training job's saved state: fp32 weights + AdamW's two fp32 moments, 12 B per parameter
    (stem.checkpoint / distributed.save_state; DCP writes the same total, shared over the ranks)."""
    from stem.models.spec import ModelConfig, param_count   # torch-free: the closed form

    model = C.train_spec(EXPERIMENT, scale, variant, stage)["model"]
    n = param_count(ModelConfig.from_dict(model))
    if n is None:  # an FFN kind registered without its `params` (stem.models.registry.FFNFacts): build it
        from stem.models.model import meta_model

        n = sum(p.numel() for p in meta_model(as_json(model)).parameters())
    return 12 * n


def stop_warning_seconds(scale, variant, stage):
    """N of `sbatch --signal=URG@N`: the time to write the state (state bytes / (nodes x the config's
    cluster.state_write_mb_s per node)) plus cluster.stop_margin_s (the step in flight, Slurm's 30 s KillWait
    is not counted on). Slurm sends the warning up to ~60 s early, never late."""
    cl = EXPERIMENT.cluster
    nodes = cluster_resources("train", scale)["nodes"]
    write = state_bytes(scale, variant, stage) / (nodes * cl.state_write_mb_s * 1e6)
    n = math.ceil(write) + cl.stop_margin_s
    runtime_s = 60 * cluster_resources("train", scale)["runtime"]
    if n >= runtime_s:
        raise WorkflowError(f"cluster.train.{scale}.runtime: {runtime_s // 60} min leaves no time to train before "
                            f"the stop warning, {n} s before the end ({variant}/{stage}: state write {write:.0f} s plus "
                            f"cluster.stop_margin_s); expected a runtime above {n // 60 + 1} min")
    return n


def _scales_regex(multinode):
    train = EXPERIMENT.cluster.train
    scales = [s for s in C.SCALES if (s in train and train[s].nodes > 1) == multinode]
    return "|".join(scales) or "(?!)"  # "(?!)" matches nothing


def _train_res(key):
    return lambda w: cluster_resources("train", w.scale)[key]


def add_cluster_defaults():
    """Partition/account/constraint and the "cpu" job size for rules that do not set their own (data, reports):
    added under Snakemake's default resources (`--default-resources` or a profile's `default-resources:` keep
    theirs) before the first rule is defined, so every rule starts from them, and the jobs Snakemake spawns
    (Slurm's job steps) are passed them with the rest."""
    if list(workflow.rules):
        raise WorkflowError("rules/common.smk: the cluster defaults must be set before the first rule is defined")
    cpu = cluster_resources("cpu")
    cpu.pop("cpus_per_task", None)  # a rule's `threads` sets its CPUs
    from snakemake.resources import Resources

    settings = workflow.resource_settings
    defaults = Resources.default("bare") if settings.default_resources is None else Resources.from_mapping(
        settings.default_resources).copy()
    for k, v in cpu.items():
        defaults.setdefault(k, v)
    settings.default_resources = defaults


add_cluster_defaults()  # before rules/*.smk define their rules (the Snakefile includes this file first)


