# STEM reproduction workflow: tokenize -> pretrain -> midtrain -> extend -> evaluate -> aggregate.
#   snakemake --profile profiles/local            # the embedded default (config/tiny.yaml), on the CPU
#   snakemake --profile profiles/slurm            # the paper's scale (config/paper.yaml), on Slurm
# One target, e.g.: snakemake --profile profiles/local results/tiny/350m/stem_half/pretrain/summary.json
# The DSE paper's Sec. 3 sweeps: snakemake --profile profiles/local --cores 2 sweep_rho (or sweep_slots)

# The default config, loaded once here (profiles do not load it again). With --replace-workflow-config
# (profiles/slurm) it would be discarded anyway, so it is not read at all: "Config file(s)" names only
# the file in use. A --configfile on the command line (e.g. config/rehearsal.yaml) is the whole config too,
# not an overlay on the default's keys.
if not (workflow.config_settings.replace_workflow_config or workflow.config_settings.configfiles):

    configfile: f"{workflow.basedir}/config/tiny.yaml"


include: "rules/common.smk"
include: "rules/data.smk"
include: "rules/train.smk"
include: "rules/eval.smk"
include: "rules/analyze.smk"
include: "rules/report.smk"
include: "rules/bench.smk"
include: "rules/sweep.smk"
include: "rules/hf.smk"


from stem import knowledge as KN  # noqa: E402

knowledge_outputs = lambda: KN.targets(EXPERIMENT)  # noqa: E731  (every point's summary and knowledge analysis)


rule all:
    default_target: True
    input:
        train_outputs(),
        eval_outputs(),
        analysis_outputs(),
        params_tables(),
        report_outputs(),
        sweep_outputs(),  # [] unless sweeps.in_all (rules/sweep.smk)
        knowledge_outputs(),  # [] without a knowledge: section (stem/knowledge.py)
