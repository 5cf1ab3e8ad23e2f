"""A training process's life: stop signals, dying with its parent, one trainer per state directory.

- Stop signals: SIGTERM (Slurm's time limit, scancel, preemption), SIGURG (the early warning that
  rules/train.smk asks Slurm for: ``sbatch --signal=URG@N``, N seconds before the time limit) and SIGUSR1
  only set a flag; the loop finishes its step, saves its state and exits 128 + signal, so Snakemake's
  ``retries`` resume it. Why URG and not the customary USR1: Slurm sends the warning to every process of
  every job step, and the Snakemake jobstep process and the rule's shell between the step and the trainer
  die of USR1 (default action: terminate), while every process ignores URG unless it handles it (only
  the trainer and torchrun, which passes it on, do). ``catch_stop_signals`` at the start of the process
  keeps a warning that arrives while it is still importing.
- Dying with the parent (Linux): ``die_with_parent`` asks the kernel for SIGTERM when the process that
  started the trainer dies (prctl PR_SET_PDEATHSIG; the parent is the rule's shell, or torchrun for its
  workers), and ``watch_owner`` polls one more process, the Snakemake process running the rule
  (``launch.py --owner-pid``), whose death would otherwise leave shell and trainer running as orphans.
  Either way the trainer stops like on Slurm's SIGTERM: state saved, exit 143.
- One trainer per state directory: ``lock_state_dir`` holds an exclusive ``flock`` on ``_state/LOCK``
  (which names its holder, ``host:pid``) while the job runs; a second trainer on the same state (e.g. a
  rerun after ``snakemake --unlock`` while the first still runs) refuses to start with one line naming the
  holder. The kernel drops the lock when the holder exits, however it exits. Under torchrun only rank 0
  takes it. On a shared filesystem flock must reach across nodes (NFS: yes; Lustre: mount with ``flock``).
"""
from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

WARNING_SIGNAL = signal.SIGURG   # sbatch --signal=URG@N (rules/train.smk)
STOP_SIGNALS = (signal.SIGTERM, WARNING_SIGNAL, signal.SIGUSR1)
PR_SET_PDEATHSIG = 1
OWNER_ENV = "STEM_OWNER_PID"   # set by workflow_scripts/launch.py --owner-pid; inherited by torchrun's workers


class StateLocked(RuntimeError):
    pass


class Stopped(Exception):
    """Raised by the loop once a stop signal's step is done and its state saved (on every rank, at the same
    step); ``job`` turns it into the exit status 128 + signal, after a line in the log and in events.log."""

    def __init__(self, sig: int, step: int, world: int = 1):
        super().__init__(f"stopped by signal {sig} at step {step}; state saved")
        self.signal, self.step, self.world = sig, step, world


def event(state_dir, text: str):
    """One line in ``{state_dir}/events.log``: the stop/resume history survives Snakemake's retries."""
    with open(Path(state_dir) / "events.log", "a") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")


_stop = {"signal": None}   # the first stop signal received (set by the handlers)


def _on_stop(sig, frame):
    if _stop["signal"] is None:
        _stop["signal"] = sig


def catch_stop_signals() -> dict:
    """Install the stop-signal handlers (main thread); returns the handlers they replaced."""
    return {s: signal.signal(s, _on_stop) for s in STOP_SIGNALS}


@contextmanager
def job(state_dir, rank: int | None = None):
    """Around one training job: the stop flag (yielded: ``{"signal": None | int}``, kept if a signal came
    before) and the state lock (rank 0). A ``Stopped`` raised inside exits 128 + signal (SystemExit). On exit
    the handlers are restored and the flag cleared."""
    previous = catch_stop_signals()
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    lock = None
    try:
        if rank == 0:
            lock = lock_state_dir(state_dir)
        yield _stop
    except Stopped as e:
        print(f"[{Path(state_dir).parent}] {e}", file=sys.stderr)
        if rank == 0:
            event(state_dir, f"{e} (world size {e.world})")
        raise SystemExit(128 + e.signal) from None
    finally:
        if lock is not None:
            lock.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
        _stop["signal"] = None


def lock_state_dir(state_dir):
    """An open file holding the exclusive lock on ``{state_dir}/LOCK``; raises StateLocked naming the holder."""
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / "LOCK"
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown (no holder written yet)"
        f.close()
        raise StateLocked(f"{path}: training state is in use by {holder}; refusing to start a second trainer "
                          f"on it (wait for that process to exit, or stop it)") from None
    f.seek(0)
    f.truncate()
    f.write(f"{socket.gethostname()}:{os.getpid()}\n")
    f.flush()
    return f


def die_with_parent(sig: int = signal.SIGTERM):
    """Linux: receive ``sig`` when the parent process dies (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before the request: no signal will come
        os.kill(os.getpid(), sig)


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), which tells a live pid from a reused one;
    None if it has exited (a zombie, not yet reaped by its parent, has exited too)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _alive(pid: int, started: str | None) -> bool:
    if Path("/proc").is_dir():
        now = _start_time(pid)
        return now is not None and (started is None or now == started)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def watch_owner(pid: int | None = None, sig: int = signal.SIGTERM, interval: float = 1.0):
    """Send ``sig`` to this process once ``pid`` (default: $STEM_OWNER_PID) has exited; a daemon thread."""
    if pid is None:
        if not os.environ.get(OWNER_ENV):
            return None
        pid = int(os.environ[OWNER_ENV])
    started = _start_time(pid)

    def run():
        while _alive(pid, started):
            time.sleep(interval)
        print(f"[lifecycle] owner process {pid} has exited; stopping (signal {int(sig)})", file=sys.stderr, flush=True)
        os.kill(os.getpid(), sig)

    thread = threading.Thread(target=run, name="stem-owner-watch", daemon=True)
    thread.start()
    return thread
