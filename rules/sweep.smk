# The DSE paper's Sec. 3 sweeps (stem/sweeps.py), from the config's `sweeps:` section. Each point is a generated
# variant id (rho_0p833, slots_4096) trained by the ordinary train rule at sweeps.scale / sweeps.stage (with
# sweeps.train over the stage's settings), so results live in results/{experiment}/{scale}/{variant}/{stage}/.
#   snakemake --profile profiles/local --cores 2 sweep_rho      # Fig. 2 left: loss vs rho (sparsity allocation)
#   snakemake --profile profiles/local --cores 2 sweep_slots    # Fig. 2 right: loss vs log DSE slots, fitted
# Outputs: reports/{experiment}/sweeps/{rho,slots}.{json,md,png,pdf}. Not part of `rule all` unless
# sweeps.in_all is true (then the report's figures sweep_rho and sweep_slots draw them too).
from stem import sweeps as SW  # noqa: E402


sweep_outputs = lambda: SW.targets(EXPERIMENT)  # noqa: E731  (used by `rule all`: [] unless sweeps.in_all)


rule sweep_report:
    input:
        summaries=lambda w: SW.summaries(EXPERIMENT, w.kind),
    output:
        json=L.sweep_file("{experiment}", "{kind}", "json"),
        md=L.sweep_file("{experiment}", "{kind}", "md"),
        png=L.sweep_file("{experiment}", "{kind}", "png"),
        pdf=L.sweep_file("{experiment}", "{kind}", "pdf"),
    wildcard_constraints:
        kind="|".join(SW.KINDS),
    params:
        spec=lambda w: as_json(C.config_part(EXPERIMENT, ("experiment", "archs", "variant_overrides", "sweeps"))),
    log:
        L.sweep_log("{experiment}", "{kind}"),
    conda:
        ENV
    shell:
        "MPLBACKEND=Agg python -m workflow_scripts.sweep --spec {params.spec:q} --kind {wildcards.kind}"
        " --json {output.json} --md {output.md} --png {output.png} --pdf {output.pdf} 2> {log}"


rule sweep_rho:
    input:
        lambda w: L.sweep_files(EXP, "rho"),


rule sweep_slots:
    input:
        lambda w: L.sweep_files(EXP, "slots"),
