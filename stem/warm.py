"""Warm starts for the workflow's jobs: each job runs in a process forked from one that imported torch and
lm-eval once, instead of importing them anew (2-5 CPU s a job, about a third of a tiny job's CPU).

    python -m stem.warm -- snakemake --profile profiles/local      (what `make smoke` runs)

starts a server (it imports ``PRELOAD`` and waits on a Unix socket), runs the command with ``STEM_WARM`` naming
the socket, and stops the server when the command ends. A job's ``python -m workflow_scripts.X ARGS`` (the
rules' commands, unchanged) then hands itself to the server (``hand_off``, called by workflow_scripts/__init__.py):
it sends its module, arguments, working directory, environment and its stdin/stdout/stderr (the file
descriptors themselves), and waits. The server forks a monitor, which forks the worker: the worker takes the
job's descriptors, directory and environment and runs the module as ``python -m`` would; the monitor sends the
worker's pid (the client forwards signals to it: Slurm's SIGURG, Snakemake's SIGTERM, Ctrl-C) and its exit
status (a signal's death as 128 + N), and stops the worker if the client goes away. The job's code, its
inputs, outputs and logs are those of a cold start; only the interpreter start is shared. Without
``STEM_WARM`` (or when the server cannot be reached, or the command is not ``python -m MODULE ...``) a job
runs in its own process as before. Only third-party modules are preloaded: the project's own code is
imported by each job from disk. docs/design.md ("Warm starts").
"""
from __future__ import annotations

import argparse
import atexit
import importlib
import json
import os
import random
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import traceback

ENV = "STEM_WARM"
# what most jobs import; lm_eval.evaluator brings `datasets`; torch._dynamo: torch.optim imports it on a job's first
# optimizer (~1.7 s of CPU a training job on this machine, docs/design.md "Warm starts")
PRELOAD = ("numpy", "torch", "torch._dynamo", "lm_eval.evaluator")
FORWARD = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
           signal.SIGURG)
_HEADER = struct.Struct("!q")
_in_worker = False   # set in a forked worker: its own `python -m workflow_scripts.X` must not hand off again


def hand_off():
    """In a job started as ``python -m MODULE ARGS`` with ``STEM_WARM`` set: run it in the warm server's fork
    and exit with its status; otherwise return (the job runs here)."""
    path, argv = os.environ.get(ENV), sys.orig_argv
    if not path or _in_worker or len(argv) < 3 or argv[1] != "-m":
        return
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
    except OSError as e:
        print(f"warm start: no server at {ENV}={path} ({e.strerror}); running cold", file=sys.stderr)
        return
    payload = json.dumps({"module": argv[2], "args": argv[3:], "cwd": os.getcwd(), "env": dict(os.environ)})
    socket.send_fds(s, [_HEADER.pack(len(payload))], [0, 1, 2])
    s.sendall(payload.encode())
    pid = _HEADER.unpack(_recv(s, _HEADER.size))[0]
    for sig in FORWARD:
        signal.signal(sig, lambda n, _f: _kill(pid, n))
    status = _recv(s, _HEADER.size)
    os._exit(_HEADER.unpack(status)[0] if status else 1)


def _kill(pid: int, sig: int):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _recv(s: socket.socket, n: int) -> bytes:
    """n bytes, or b"" if the peer closed first."""
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            return b""
        out += chunk
    return out


def serve(path: str, preload=PRELOAD, ready=None):
    """Import ``preload``, listen on ``path`` and fork a monitor per job (never returns)."""
    for name in preload:
        importlib.import_module(name)
    if threading.active_count() != 1:   # a fork copies only the calling thread: refuse to serve with others
        raise SystemExit(f"warm start: preloading {preload} started threads; cannot fork safely")
    signal.signal(signal.SIGCHLD, _reap)   # reaped by wait(): their CPU time counts in the server's (time, farm-bench)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    server.settimeout(2.0)
    parent = os.getppid()
    if ready:
        ready()
    while True:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            if os.getppid() != parent:     # the command's wrapper is gone (killed): so is the server
                raise SystemExit(0)
            continue
        conn.setblocking(True)
        if os.fork() == 0:
            server.close()
            _monitor(conn)
        conn.close()


def _reap(_sig, _frame):
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def _monitor(conn: socket.socket):
    """Receive one job, fork its worker, report the worker's pid and exit status to the client."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    header, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
    job = json.loads(_recv(conn, _HEADER.unpack(header)[0]))
    pid = os.fork()
    if pid == 0:
        conn.close()
        _work(job, fds)
    for fd in fds:
        os.close(fd)
    conn.sendall(_HEADER.pack(pid))
    while True:
        readable, _, _ = select.select([conn], [], [], 0.05)
        if readable and not conn.recv(1):     # the client went away (killed): stop its job
            _kill(pid, signal.SIGTERM)
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            try:
                conn.sendall(_HEADER.pack(code if code >= 0 else 128 - code))
            finally:
                os._exit(0)


def _work(job: dict, fds: list[int]):
    """Become the job: its descriptors, directory and environment, then ``python -m`` its module."""
    global _in_worker
    _in_worker = True
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    for sig in FORWARD:
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    sys.path[0] = job["cwd"]
    sys.argv = [job["module"], *job["args"]]
    random.seed()                                   # a fresh process's entropy, as a cold start has
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    code = 0
    try:
        runpy.run_module(job["module"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        atexit._run_exitfuncs()
        for f in (sys.stdout, sys.stderr):
            f.flush()
    os._exit(code)


def _exit_code(code) -> int:
    """What ``sys.exit(code)`` makes the interpreter exit with."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def run(cmd: list[str], preload=PRELOAD) -> int:
    """Start a server, run ``cmd`` with STEM_WARM pointing at it, stop the server; cmd's exit status."""
    with tempfile.TemporaryDirectory(prefix="stem-warm-") as d:
        path = os.path.join(d, "server.sock")
        read, write = os.pipe()
        server = subprocess.Popen([sys.executable, "-c", f"from stem.warm import _serve_main; _serve_main({write})",
                                   path, *preload], pass_fds=(write,))
        os.close(write)
        ok = os.read(read, 1) == b"1"      # the server writes 1 once it listens (nothing if it failed)
        os.close(read)
        env = {**os.environ, ENV: path} if ok else dict(os.environ)
        if not ok:
            print("warm start: the server did not start; jobs start cold", file=sys.stderr)
        try:
            return subprocess.run(cmd, env=env).returncode
        finally:
            server.terminate()
            server.wait()


def _serve_main(ready_fd: int):
    def ready():
        os.write(ready_fd, b"1")
        os.close(ready_fd)
    serve(sys.argv[1], sys.argv[2:], ready)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m stem.warm", description="Run COMMAND with its workflow jobs "
                                "started warm (stem/warm.py).")
    p.add_argument("--preload", default=",".join(PRELOAD), help="modules the server imports (comma-separated)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        p.error("no command; expected -- COMMAND [ARGS...]")
    sys.exit(run(cmd, tuple(m for m in args.preload.split(",") if m)))


if __name__ == "__main__":
    main()
