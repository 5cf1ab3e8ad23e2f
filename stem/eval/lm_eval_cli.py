"""``stem-lm-eval``: lm-eval's own command line with the ``stem`` model registered.

lm-eval 0.4.13 finds a model name only in its registry, which holds its built-in models plus the
classes imported in the running process (no entry-point or plugin discovery for models), so the
stock ``lm_eval --model stem`` cannot see a model defined outside its tree. This command imports
``stem.eval.lm`` (registering ``stem``) and then runs lm-eval's CLI with the arguments unchanged::

    stem-lm-eval --model stem --model_args pretrained=results/tiny/1b/stem/extend/checkpoint \\
        --tasks hellaswag --limit 10
    python -m stem.eval.lm_eval_cli ...      # the same, without the installed script
"""
from __future__ import annotations

from lm_eval.__main__ import cli_evaluate

import stem.eval.lm  # noqa: F401  (registers the model "stem" with lm-eval)


def main() -> None:
    cli_evaluate()


if __name__ == "__main__":
    main()
