"""Kill a training run with SIGKILL part-way, as a node failure would (the resume tests' shared harness)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from stem import config as C

TRAIN = "import json,sys; from stem.train.loop import train; train(json.loads(sys.argv[1]), threads=1)"


def sigkill_after_state(spec: dict, step: int, timeout: float = 120):
    """Run ``spec``'s training in a subprocess, SIGKILL it once its newest saved state is ``step`` or later, and
    check that it did not finish first (nothing declared written)."""
    proc = subprocess.Popen([sys.executable, "-c", TRAIN, json.dumps(spec)], cwd=C.REPO, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(C.REPO)})
    latest = Path(spec["out_dir"]) / "_state" / "latest"
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if latest.exists() and latest.read_text().strip() >= f"step_{step:08d}":
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (Path(spec["out_dir"]) / "summary.json").exists(), "the run finished before it could be killed"
