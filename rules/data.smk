# Data: synthetic corpora (embedded default) -> tokenizer per scale -> token shards per (scale, source).
# The knowledge section's points read their own tokenizer and shards (stem.layout.KNOWLEDGE in the scale's place,
# data/{experiment}/knowledge/...): the same rules, the wildcard `scale` of these three rules a data key.
DATA_KEYS = "|".join([*C.SCALES, L.KNOWLEDGE])


rule corpus:
    output:
        L.corpus_path("{experiment}", "{source}"),
    params:
        spec=lambda w: as_json(C.corpus_spec(EXPERIMENT, w.source)),
    log:
        L.corpus_log("{experiment}", "{source}"),
    conda:
        ENV
    shell:
        "python -m workflow_scripts.corpus --spec {params.spec:q} --out {output} 2> {log}"


rule tokenizer:
    input:
        lambda w: [p for s in C.tokenizer_node(EXPERIMENT, w.scale).sources or [] for p in C.source_inputs(EXPERIMENT, s)],
    output:
        L.tokenizer_path("{experiment}", "{scale}"),
    wildcard_constraints:
        scale=DATA_KEYS,
    params:
        spec=lambda w: as_json(C.tokenizer_spec(EXPERIMENT, w.scale)),
    log:
        L.tokenizer_log("{experiment}", "{scale}"),
    conda:
        ENV
    shell:
        "python -m workflow_scripts.tokenizer --spec {params.spec:q} --out {output} 2> {log}"


# Tokenize is scattered: each source is split into `parts` jobs (sources.<name>.parts, default 1; a
# contiguous range of its files/shards each, see stem.data.sources), each its own (Slurm) job writing
# its part directory atomically; a killed job leaves no output and reruns alone. tokenize_gather
# (on the head node: it reads the parts' manifests only) writes the source's manifest over all parts.
rule tokenize_part:
    input:
        tokenizer=L.tokenizer_path("{experiment}", "{scale}"),
        documents=lambda w: C.source_inputs(EXPERIMENT, w.source),
    output:
        directory(L.tokens_part_dir("{experiment}", "{scale}", "{source}", "{part}")),
    wildcard_constraints:
        scale=DATA_KEYS,
    params:
        spec=lambda w: as_json(C.tokenize_spec(EXPERIMENT, w.scale, w.source, w.part)),
    threads: EXPERIMENT.cluster.job("tokenize").cpus or 2
    resources:
        **EXPERIMENT.cluster.job("tokenize").size(),
    log:
        L.tokenize_log("{experiment}", "{scale}", "{source}", "{part}"),
    conda:
        ENV
    shell:
        "python -m workflow_scripts.tokenize_source --spec {params.spec:q} --tokenizer {input.tokenizer}"
        " --out {output} --threads {threads} 2> {log}"


rule tokenize_gather:
    input:
        lambda w: [L.tokens_part_dir(EXP, w.scale, w.source, p) for p in C.part_names(EXPERIMENT, w.source)],
    output:
        L.tokens_manifest("{experiment}", "{scale}", "{source}"),
    wildcard_constraints:
        scale=DATA_KEYS,
    params:
        out=lambda w: L.tokens_dir(EXP, w.scale, w.source),
    localrule: True
    log:
        L.tokens_gather_log("{experiment}", "{scale}", "{source}"),
    conda:
        ENV
    shell:
        "python -m workflow_scripts.tokenize_gather --out {params.out} {input} 2> {log}"
