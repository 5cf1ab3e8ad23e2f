"""Warm starts (stem/warm.py): a job handed to the warm server behaves as a cold ``python -m`` start: the same
outputs, stdout/stderr, exit status (signal deaths included), signals forwarded to it, and a cold start when
no server answers."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

JOB = """
import os, signal, sys, time
what = sys.argv[1]
print("argv", sys.argv[1:], "cwd", os.path.basename(os.getcwd()), "env", os.environ.get("WARM_T"))
print("to stderr", file=sys.stderr)
if what == "exit":
    sys.exit(int(sys.argv[2]))
if what == "raise":
    raise ValueError("boom")
if what == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if what == "term":
    signal.signal(signal.SIGTERM, lambda *_: (open("got_term", "w").close(), sys.exit(7)))
    open("ready", "w").close()
    time.sleep(30)
"""


@pytest.fixture
def jobs(tmp_path):
    pkg = tmp_path / "warmjobs"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from stem.warm import hand_off\nhand_off()\n")
    (pkg / "job.py").write_text(textwrap.dedent(JOB))
    return tmp_path


def _job(cwd, *args, warm: bool, **kw):
    """``python -m warmjobs.job ARGS`` (warm: under ``python -m stem.warm``, which starts its own server)."""
    cmd = [sys.executable, "-m", "warmjobs.job", *args]
    if warm:
        cmd = [sys.executable, "-m", "stem.warm", "--preload", "json", "--", *cmd]
    env = {**os.environ, "WARM_T": "x", "PYTHONPATH": REPO}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=60, **kw)


@pytest.mark.parametrize("args,code", [(("exit", "0"), 0), (("exit", "3"), 3), (("raise",), 1),
                                       (("kill",), 128 + signal.SIGKILL)])
def test_a_warm_job_is_a_cold_job(jobs, args, code):
    cold, warm = _job(jobs, *args, warm=False), _job(jobs, *args, warm=True)
    assert (128 - cold.returncode if cold.returncode < 0 else cold.returncode) == warm.returncode == code
    assert warm.stdout == cold.stdout
    assert warm.stderr.splitlines()[0] == cold.stderr.splitlines()[0] == "to stderr"
    assert warm.stderr.splitlines()[-1] == cold.stderr.splitlines()[-1]   # "ValueError: boom" when it raises
    assert "argv ['%s'" % args[0] in warm.stdout and "cwd " + jobs.name in warm.stdout and "env x" in warm.stdout


def test_signals_reach_the_job(jobs):
    """SIGTERM sent to the job's client (as Snakemake or Slurm would) reaches the job, whose handler runs."""
    env = {**os.environ, "PYTHONPATH": REPO}
    server = subprocess.Popen([sys.executable, "-m", "stem.warm", "--preload", "json", "--", "sh", "-c",
                               f"{sys.executable} -m warmjobs.job term & echo $! > pid; wait"],
                              cwd=jobs, env=env)
    for _ in range(300):
        if (jobs / "ready").exists():
            break
        time.sleep(0.1)
    client = int((jobs / "pid").read_text())
    os.kill(client, signal.SIGTERM)
    assert server.wait(timeout=30) == 0
    assert (jobs / "got_term").exists()


def test_no_server_means_a_cold_start(jobs):
    env = {**os.environ, "PYTHONPATH": REPO, "STEM_WARM": str(jobs / "nothing.sock")}
    r = subprocess.run([sys.executable, "-m", "warmjobs.job", "exit", "5"], cwd=jobs, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 5 and "argv ['exit', '5']" in r.stdout
    assert r.stderr.startswith("warm start: no server at STEM_WARM=")


def test_a_workflow_job_hands_off(tmp_path):
    """The rules' own entry points: a bad spec is the same one line and exit 1, warm or cold."""
    cmd = [sys.executable, "-m", "workflow_scripts.analyze", "--spec", "{bad", "--checkpoint", "x", "--out",
           str(tmp_path / "o.json")]
    cold = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    warm = subprocess.run([sys.executable, "-m", "stem.warm", "--preload", "json", "--", *cmd], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert cold.returncode == warm.returncode == 1
    assert cold.stderr == warm.stderr and warm.stderr.startswith("error: --spec: not valid JSON")
    assert not (tmp_path / "o.json").exists()
