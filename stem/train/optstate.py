"""The optimizer state carried from one stage to the next (``reset_optimizer: false``): a DCP checkpoint beside
the stage's weights (``checkpoint/optimizer/``), keyed by parameter name, row-sharded tables' moments in id
order (stem.train.tables), so the next stage may run at another world size."""
from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

from stem.checkpoint import first_line
from stem.train.tables import logical_state


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns that it assumes one process when there is no process group: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_optimizer(folder, model, opt):
    """The optimizer state, keyed by parameter name, as a DCP checkpoint in ``folder``: every rank writes
    its own shards (no gather), and it reshards on load, so the next stage may run at another world size.
    Collective: every rank calls it."""
    # torch.distributed.checkpoint: a heavy import, only when optimizer state is saved or loaded
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict   # likewise
    osd = get_optimizer_state_dict(model, opt)
    logical_state(model, osd=osd)   # row-sharded tables' moments in id order (stem.train.tables)
    with _single_process_quiet():
        dcp.save({"optim": osd}, checkpoint_id=str(folder))


def load_optimizer(folder, model, opt):
    """Restore the moments and step counts saved by save_optimizer into ``opt``; the hyper-parameters
    (LR multipliers, weight decay, betas, eps) stay those ``opt`` was built with (the new stage's)."""
    # torch.distributed.checkpoint: a heavy import, only when optimizer state is saved or loaded
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict  # likewise
    folder = Path(folder)
    if not (folder / ".metadata").is_file():
        raise ValueError(f"{folder}: no optimizer state in this checkpoint (the previous stage saves it only when "
                         "the next stage sets reset_optimizer: false; rerun it, or set reset_optimizer: true)")
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    state = {"optim": get_optimizer_state_dict(model, opt)}
    logical_state(model, osd=state["optim"])
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=str(folder))
    except Exception as e:
        raise ValueError(f"{folder}: unreadable optimizer state ({type(e).__name__}: {first_line(e)})") from None
    logical_state(model, osd=state["optim"], inverse=True)
    set_optimizer_state_dict(model, opt, state["optim"])
    for g, h in zip(opt.param_groups, hyper):
        g.update(h)
