"""The thin entry points the rules call (``python -m workflow_scripts.X``). Under ``python -m stem.warm`` (make
smoke) a job hands itself to the warm server and exits with the status of its run there (stem/warm.py)."""
from stem.warm import hand_off

hand_off()
