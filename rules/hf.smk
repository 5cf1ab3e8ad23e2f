# A trained checkpoint as a transformers folder (docs/huggingface.md; stem/hf/export.py). Asked for by path,
# not part of rule all:
#   snakemake --profile profiles/local results/tiny/1b/stem/extend/hf


rule export_hf:
    input:
        checkpoint=L.checkpoint(*L.STAGE),
    output:
        directory(L.hf_export(*L.STAGE)),
    log:
        L.export_hf_log(*L.STAGE),
    conda:
        ENV
    shell:
        "python -m stem export-hf {input.checkpoint} {output} > {log} 2>&1"
