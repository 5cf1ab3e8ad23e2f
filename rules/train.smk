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
# The backbone's parallel strategy (cluster.strategy: fsdp or ddp) travels in the job spec (train.parallel).
#
# Stopping in time: Slurm sends SIGTERM at the time limit and SIGKILL KillWait (30 s by default) later, too
# little to save a paper-scale state (~81 GB for 1B STEM). So training jobs ask for an early warning,
# `sbatch --signal=URG@N` (resource slurm_extra), N = state write time at the config's
# cluster.state_write_mb_s per node + cluster.stop_margin_s (common.smk: stop_warning_seconds). Slurm sends
# it to every process of the job's steps: the trainer saves and exits, torchrun passes it on and waits N s
# (--stop-grace) before it would kill its workers, everything else ignores SIGURG (SIGUSR1 would kill the
# Snakemake jobstep and the shell in between; see stem/train/lifecycle.py). --owner-pid $PPID: the trainer
# stops (saving) if the Snakemake process running this shell dies, instead of running on as an orphan.


rule train:
    input:
        unpack(train_inputs),
    output:
        summary=L.summary(*L.STAGE),
        metrics=L.metrics(*L.STAGE),
        checkpoint=directory(L.checkpoint(*L.STAGE)),
    wildcard_constraints:
        scale=_scales_regex(multinode=False),
    params:
        spec=lambda w: as_json(C.train_spec(EXPERIMENT, w.scale, w.variant, w.stage)),
        gpus_per_node=lambda w: cluster_resources("train", w.scale).get("gpu", 0),
        stop_grace=lambda w: stop_warning_seconds(w.scale, w.variant, w.stage),
    threads: lambda w: cluster_resources("train", w.scale)["cpus_per_task"]
    resources:
        **{k: _train_res(k) for k in ("nodes", "runtime", "cpus_per_task", "mem_mb")},
        **{k: v for k, v in cluster_resources("cpu").items() if k in ("slurm_partition", "slurm_account", "constraint")},
        gpu=lambda w: cluster_resources("train", w.scale).get("gpu", 0),
        slurm_extra=lambda w: f"--signal=URG@{stop_warning_seconds(w.scale, w.variant, w.stage)}",
    log:
        L.train_log(*L.STAGE),
    conda:
        ENV
    shell:
        "python -m workflow_scripts.launch --nodes {resources.nodes}"
        " --gpus-per-node {params.gpus_per_node} --cpus-per-node {resources.cpus_per_task}"
        " --stop-grace {params.stop_grace} --owner-pid $PPID --"
        " python -m workflow_scripts.train --spec {params.spec:q} --threads {threads} 2> {log}"


use rule train as train_multinode with:
    wildcard_constraints:
        scale=_scales_regex(multinode=True),
    params:
        spec=lambda w: as_json(C.train_spec(EXPERIMENT, w.scale, w.variant, w.stage)),
        gpus_per_node=lambda w: EXPERIMENT.cluster.train[w.scale].gpus_per_node,
        stop_grace=lambda w: stop_warning_seconds(w.scale, w.variant, w.stage),
    resources:
        **{k: _train_res(k) for k in ("nodes", "runtime", "cpus_per_task", "mem_mb", "gres", "tasks", "tasks_per_gpu")},
        **{k: v for k, v in cluster_resources("cpu").items() if k in ("slurm_partition", "slurm_account", "constraint")},
        mpi="srun",
        slurm_extra=lambda w: f"--signal=URG@{stop_warning_seconds(w.scale, w.variant, w.stage)}",


# Before anything is submitted (not in a dry run): refuse a GPU training job of the DAG whose per-GPU peak,
# traced from one real training step at its world size (stem.train.gate.check; the trace, stem.train.memtrace,
# is cached per job in results/memory_traces), exceeds cluster.gpu_mem_gib. Jobs without GPUs (the tiny DAG) are not traced.
onstart:
    import os

    from stem.train import gate

    _train_jobs = {(j.wildcards.scale, j.wildcards.variant, j.wildcards.stage)
                   for j in workflow.dag.jobs if j.rule.name in ("train", "train_multinode")}
    _too_big = gate.check(EXPERIMENT, L.MEMORY_TRACES, workers=min(os.cpu_count() or 1, 8), only=_train_jobs)
    if _too_big:
        raise WorkflowError("\n".join(_too_big))


# Init calibrated's entity texts (insert.calibration.entities; stem.train.entity_text, docs/real.md): the dense
# checkpoint an insertion starts from writes a few sampled tokens after short prompts naming each entity of a facts
# file; the insertion's train job (train_inputs) calibrates on them beside its source's windows. One job per dense
# checkpoint, so it runs once whatever reads it.
rule entity_text:
    input:
        checkpoint=L.checkpoint(*L.STAGE),
        facts=lambda w: C.entity_text_spec(EXPERIMENT, w.scale, w.variant, w.stage)["facts"],
    output:
        L.entity_text(*L.STAGE),
    params:
        spec=lambda w: as_json(C.entity_text_spec(EXPERIMENT, w.scale, w.variant, w.stage)),
    threads: 1
    log:
        L.entity_text_log(*L.STAGE),
    conda:
        ENV
    shell:
        "python -m workflow_scripts.entity_text --spec {params.spec:q} --checkpoint {input.checkpoint}"
        " --out {output} --threads {threads} 2> {log}"
