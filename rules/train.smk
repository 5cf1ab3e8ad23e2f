# Training stages. One rule for every stage: the stage's spec (config) says where it starts from
# (init_from) and what it reads (data mixture). Resumable state lives in {stage}/_state (undeclared),
# so a failed, preempted or timed-out job resumes when it is rerun or retried.
#
# Slurm resources come from the experiment config's `cluster:` section (config/paper.yaml), so a user
# edits one place: partition/account/constraint for every job, nodes x GPUs per scale for training.
# A training job runs workflow_scripts/launch.py, which runs the trainer directly (one process), under
# torchrun (one node, several GPUs), or one torchrun per node through srun (several nodes: rule
# train_multinode, which carries the `mpi` resource so the jobstep executor leaves the srun to us).
# Snakemake clears the log of a retried job; {stage}/_state/events.log keeps the stop/resume history.


def cluster_resources(kind, scale=None):
    """sbatch resources of one job kind: "train" (at a scale), "eval" (one GPU) or "cpu" (none)."""
    cl = config.get("cluster") or {}
    res = {res_key: cl[key] for key, res_key in (("partition", "slurm_partition"), ("account", "slurm_account"),
                                                  ("constraint", "constraint")) if cl.get(key)}
    if kind == "train":
        t = (cl.get("train") or {}).get(scale) or {"nodes": 1, "runtime": 60,
                                                   "gpus_per_node": 0 if config["device"] == "cpu" else 1}
        nodes, gpus = t["nodes"], t["gpus_per_node"]
        res.update(nodes=nodes, runtime=t["runtime"],
                   cpus_per_task=t.get("cpus") or gpus * t.get("cpus_per_gpu", 1) or 1,
                   mem_mb=t.get("mem_mb") or gpus * t.get("mem_mb_per_gpu", 0) or 4000)
        if gpus and nodes == 1:
            res["gpu"] = gpus  # sbatch --gpus=G; the jobstep's srun gets --gpus=G too
        elif gpus:  # per-node GPUs, one task (one torchrun) per node; tasks_per_gpu=0 keeps --ntasks-per-gpu off
            res.update(gres=f"gpu:{gpus}", mpi="srun", tasks=nodes, tasks_per_gpu=0)
        return res
    j = cl.get(kind) or {}
    res.update(runtime=j.get("runtime", 60), mem_mb=j.get("mem_mb", 4000))
    if j.get("cpus"):
        res["cpus_per_task"] = j["cpus"]
    if j.get("gpus"):
        res["gpu"] = j["gpus"]
    return res


def _train_setting(scale, key):
    return (((config.get("cluster") or {}).get("train") or {}).get(scale) or {}).get(key)


def _scales_regex(multinode):
    scales = [s for s in C.SCALES if ((_train_setting(s, "nodes") or 1) > 1) == multinode]
    return "|".join(scales) or "(?!)"  # "(?!)" matches nothing


def _train_res(key):
    return lambda w: cluster_resources("train", w.scale)[key]


def apply_cluster_defaults():
    """Partition/account/constraint and the "cpu" job size for rules that do not set their own (data, reports)."""
    cpu = cluster_resources("cpu")
    cpu.pop("cpus_per_task", None)  # a rule's `threads` sets its CPUs
    defaults = Resources.from_mapping(cpu)
    for r in list(workflow.rules) + [None]:
        target = workflow.resource_settings._parsed_default_resources if r is None else r.resources
        for k, v in defaults.items():
            target.setdefault(k, v)


from snakemake.resources import Resources  # noqa: E402

apply_cluster_defaults()  # rules defined so far; and the defaults of rules defined after this file


def train_inputs(w):
    spec = C.train_spec(config, w.scale, w.variant, w.stage)
    inputs = {"tokenizer": spec["tokenizer"]}
    inputs.update({f"tokens_{src}": C.tokens_manifest(EXP, w.scale, src).rsplit("/", 1)[0] for src in spec["data"]})
    if spec["init_from"]:
        inputs["init"] = spec["init_from"]
    return inputs


rule train:
    input:
        unpack(train_inputs),
    output:
        summary="results/{experiment}/{scale}/{variant}/{stage}/summary.json",
        metrics="results/{experiment}/{scale}/{variant}/{stage}/metrics.jsonl",
        checkpoint=directory("results/{experiment}/{scale}/{variant}/{stage}/checkpoint"),
    wildcard_constraints:
        scale=_scales_regex(multinode=False),
    params:
        spec=lambda w: as_json(C.train_spec(config, w.scale, w.variant, w.stage)),
        gpus_per_node=lambda w: cluster_resources("train", w.scale).get("gpu", 0),
        strategy=(config.get("cluster") or {}).get("strategy", "fsdp"),
    threads: lambda w: cluster_resources("train", w.scale)["cpus_per_task"]
    resources:
        **{k: _train_res(k) for k in ("nodes", "runtime", "cpus_per_task", "mem_mb")},
        **{k: v for k, v in cluster_resources("cpu").items() if k in ("slurm_partition", "slurm_account", "constraint")},
        gpu=lambda w: cluster_resources("train", w.scale).get("gpu", 0),
    log:
        "logs/{experiment}/{scale}/{variant}/{stage}/train.log",
    conda:
        ENV
    shell:
        "STEM_PARALLEL={params.strategy} python -m workflow_scripts.launch --nodes {resources.nodes}"
        " --gpus-per-node {params.gpus_per_node} --cpus-per-node {resources.cpus_per_task} --"
        " python -m workflow_scripts.train --spec {params.spec:q} --threads {threads} 2> {log}"


use rule train as train_multinode with:
    wildcard_constraints:
        scale=_scales_regex(multinode=True),
    params:
        spec=lambda w: as_json(C.train_spec(config, w.scale, w.variant, w.stage)),
        gpus_per_node=lambda w: _train_setting(w.scale, "gpus_per_node"),
        strategy=(config.get("cluster") or {}).get("strategy", "fsdp"),
    resources:
        **{k: _train_res(k) for k in ("nodes", "runtime", "cpus_per_task", "mem_mb", "gres", "tasks", "tasks_per_gpu")},
        **{k: v for k, v in cluster_resources("cpu").items() if k in ("slurm_partition", "slurm_account", "constraint")},
        mpi="srun",
