"""A trainer's life (stem/train/lifecycle.py): it dies with the process that started it, and a second trainer
on the same state directory refuses to start. Real trainer processes on the tiny dataset, no Slurm needed."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stem.train import lifecycle

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _wait(pred, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _start_under_fake_snakemake(spec, tmp_path):
    """parent (stands for Snakemake) -> bash (the rule's shell) -> launch.py (exec) -> trainer; like rules/train.smk."""
    shell = (f"{sys.executable} -m workflow_scripts.launch --owner-pid $PPID -- {sys.executable} -m workflow_scripts.train"
             f" --spec '{json.dumps(spec)}' --threads 1 2> {tmp_path / 'train.log'}; echo shell-done")
    parent_code = ("import subprocess, sys, time\n"
                   "p = subprocess.Popen(['bash', '-c', sys.argv[1]])\n"
                   "print(p.pid, flush=True)\n"
                   "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", parent_code, shell], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                              text=True)
    bash_pid = int(parent.stdout.readline())
    return parent, bash_pid


@pytest.mark.parametrize("killed", ["owner", "shell"])
def test_trainer_dies_with_its_parent_and_a_second_trainer_refuses(spec_factory, tmp_path, killed):
    spec = spec_factory(tmp_path / "job", steps=100000, checkpoint_interval=2)
    state = tmp_path / "job" / "_state"
    parent, bash_pid = _start_under_fake_snakemake(spec, tmp_path)
    trainer = None
    try:
        _wait(lambda: (state / "latest").exists(), 120, "the first trainer's state")
        holder = (state / "LOCK").read_text().strip()
        host, pid = holder.split(":")
        trainer = int(pid)
        assert host == socket.gethostname() and "workflow_scripts.train" in Path(f"/proc/{trainer}/cmdline").read_text()

        if killed == "owner":   # a second trainer on the same state refuses, naming the holder
            second = subprocess.run([sys.executable, "-m", "workflow_scripts.train", "--spec", json.dumps(spec)],
                                    cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
            assert second.returncode == 1
            assert second.stderr.strip().splitlines() == [
                f"error: {state / 'LOCK'}: training state is in use by {holder}; refusing to start a second trainer "
                "on it (wait for that process to exit, or stop it)"]
            assert _alive(trainer)

        os.kill(parent.pid if killed == "owner" else bash_pid, signal.SIGKILL)
        _wait(lambda: not _alive(trainer), 60, f"the trainer to exit after its {killed} was killed")
    finally:
        parent.kill()
        parent.wait()
        for pid in (trainer, bash_pid):  # left running only if the test failed
            if pid and _alive(pid):
                os.kill(pid, signal.SIGKILL)
    events = (state / "events.log").read_text()
    assert "stopped by signal 15" in events, events          # it saved its state on the way out
    lifecycle.lock_state_dir(state).close()                   # and released the lock: a rerun can start


def test_lock_names_its_holder_and_is_released_on_close(tmp_path):
    first = lifecycle.lock_state_dir(tmp_path / "_state")
    assert (tmp_path / "_state" / "LOCK").read_text() == f"{socket.gethostname()}:{os.getpid()}\n"
    # flock locks belong to the open file: a second open in this very process conflicts like another process
    with pytest.raises(lifecycle.StateLocked, match=f"in use by {socket.gethostname()}:{os.getpid()};"):
        lifecycle.lock_state_dir(tmp_path / "_state")
    first.close()
    lifecycle.lock_state_dir(tmp_path / "_state").close()


def test_stop_signals_set_the_flag_and_handlers_are_restored(tmp_path):
    before = signal.getsignal(signal.SIGUSR1)
    with lifecycle.job(tmp_path / "_state", rank=0) as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        _wait(lambda: stop["signal"] is not None, 5, "the flag")
        assert stop["signal"] == signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) == before
