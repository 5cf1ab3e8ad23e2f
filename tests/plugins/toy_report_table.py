"""A report table as a plugin module (config ``plugins: [toy_report_table]``; tests/test_plugins.py): each
trained model's lookup (non-active) parameters from its checkpoint's accounting. Reported only (no paper CSV)."""
from stem.config.experiment import Experiment
from stem.report import tables as T
from stem.report.registry import paper_table

NAME = "toy_lookup"


@paper_table(NAME, "Toy: lookup parameters", stages=("pretrain",), labels={"lookup_params": "Lookup params"},
             inputs=T.checkpoints_of(NAME))
def toy_lookup(exp: Experiment, res):
    stages = T.settings(exp).stages[NAME]
    cells = []
    for scale in T.scales_with(exp, stages[0]):
        for v in T.ordered_variants(exp, exp.matrix[scale].variants):
            acct, _ = res.first_accounting(scale, v, stages)
            cells.append(T.cell(NAME, scale, v, "lookup_params", acct and acct["total_params"] - acct["active_params"],
                                "checkpoint accounting", unit=""))
    return T.frame(cells)
