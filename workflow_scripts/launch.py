"""Start a (possibly distributed) training command, with or without Slurm.

    python workflow_scripts/launch.py --nodes N --gpus-per-node G [--cpus-per-node C] -- CMD ...

- one process (G <= 1, N == 1): runs CMD itself (the single-process path; no torchrun);
- one node, G processes: ``torchrun --standalone --nproc-per-node G CMD`` (inside a Slurm job step, or on
  a workstation without Slurm);
- N > 1 nodes (or --srun): inside a Slurm allocation, one torchrun per node through
  ``srun --nodes N --ntasks-per-node 1``, rendezvous ``c10d`` on the allocation's first node.
  Snakemake's jobstep executor strips most SLURM_* variables (SLURM_JOB_ID survives), so the node list
  is asked from Slurm (squeue) and the counts come from the arguments, not the environment.

The final command replaces this process (exec), so Slurm's SIGTERM (time limit, scancel, preemption) and
its early warning SIGURG (``sbatch --signal=URG@N``, rules/train.smk) reach srun/torchrun/the trainer
directly; torchrun passes both on to its workers and waits ``--stop-grace`` seconds for them; the trainer
saves its state and exits 128 + signal, the job fails, Snakemake's ``retries`` resubmits it and training
resumes from the state. ``--owner-pid`` makes the trainer stop when that process (Snakemake) dies.
``--dry-run`` prints the command.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys

# torchrun's default (SIGTERM,SIGINT,SIGHUP,SIGQUIT) plus Slurm's early warning SIGURG (rules/train.smk) and
# SIGUSR1: on any of them it sends that signal to its workers and waits --shutdown-timeout seconds (default
# 30) before SIGKILL. Without this it ignores SIGURG and dies of SIGUSR1, leaving its workers unsaved.
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGURG"


def first_node(job_id: str) -> str:
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or subprocess.run(
        ["squeue", "-h", "-j", job_id, "-o", "%N"], check=True, capture_output=True, text=True).stdout.strip()
    hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True, capture_output=True,
                           text=True).stdout.split()
    if not hosts:
        raise SystemExit(f"launch: no nodes found for Slurm job {job_id}")
    return hosts[0]


def build_command(nodes: int, gpus_per_node: int, cpus_per_node: int | None, cmd: list[str], srun: bool = False,
                  env=os.environ, stop_grace: int | None = None) -> list[str]:
    nproc = max(1, gpus_per_node)
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                # pass Slurm's early warning on to the workers, like SIGTERM, and give them time to save
                f"--signals-to-handle={TORCHRUN_SIGNALS}"]
    if stop_grace:
        torchrun.append(f"--shutdown-timeout={stop_grace}")
    if nodes == 1 and not srun:
        if nproc == 1:
            return list(cmd)
        return torchrun[:3] + ["--standalone"] + torchrun[3:] + ["--no-python", *cmd]
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        raise SystemExit(f"launch: {nodes} nodes requested but this is not a Slurm allocation (no SLURM_JOB_ID)")
    port = 29500 + int(job_id) % 1000  # distinct per job, in case two jobs share a node
    step = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    if cpus_per_node:
        step.append(f"--cpus-per-task={cpus_per_node}")  # a step gets 1 CPU per task unless told otherwise
    rdzv = [f"--nnodes={nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={first_node(job_id)}:{port}",
            f"--rdzv-id=stem-{job_id}"]
    return step + torchrun + rdzv + ["--no-python", *cmd]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=0, help="processes per node (0: one CPU process)")
    p.add_argument("--cpus-per-node", type=int, default=None)
    p.add_argument("--srun", action="store_true", help="use the srun + c10d path even on one node")
    p.add_argument("--stop-grace", type=int, default=None, metavar="S",
                   help="seconds torchrun lets its workers save after a stop signal before it kills them")
    p.add_argument("--owner-pid", type=int, default=None, metavar="PID",
                   help="the trainer stops (saving its state) when this process exits; the rule passes $PPID, "
                        "the Snakemake process running it (see stem/train/lifecycle.py)")
    p.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("no command given (put it after --)")
    full = build_command(args.nodes, args.gpus_per_node, args.cpus_per_node, cmd, args.srun,
                         stop_grace=args.stop_grace)
    if args.owner_pid is not None:
        os.environ["STEM_OWNER_PID"] = str(args.owner_pid)
    print("launch: " + shlex.join(full), file=sys.stderr, flush=True)
    if args.dry_run:
        print(shlex.join(full))
        return
    os.execvp(full[0], full)


if __name__ == "__main__":
    main()
