"""python -m utensil_ffi.distributed.launch --nproc-per-node N script.py [args...]

Start N copies of a Python script on this machine, one per GPU, with the environment torchrun
gives (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``) and a fresh ``UTENSIL_RUN_ID``; ``utensil_ffi.distributed.env_from_environ`` reads
it. Each process sees one GPU: ``CUDA_VISIBLE_DEVICES`` is its local rank (or that entry of the
launcher's own ``CUDA_VISIBLE_DEVICES`` list); ``--no-gpu-binding`` leaves it alone. ``MASTER_PORT`` is a free port unless given, with the port after it free too (the
communicator's bootstrap listens there).

When one process fails, the others are stopped (SIGTERM to each one's process group, SIGKILL
after ``--grace`` seconds) and the launcher exits with the failed process's code, so no rank
is left waiting for a peer that is gone and nothing is orphaned. Ctrl-C, SIGTERM, SIGHUP (the
terminal closed, the ssh session dropped) and SIGQUIT stop all of them the same way. A launcher
killed outright (SIGKILL, a crash) cannot stop them: on Linux each process is started with a
parent-death signal (SIGTERM), so it does not run on under PID 1 holding its GPU and ports.
Output goes straight to this terminal.
"""

import argparse
import ctypes
import ctypes.util
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

__all__ = ["main", "free_port"]


def free_port(host="127.0.0.1"):
    """A TCP port that is free now and whose successor is free too."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port >= 65535:
            continue
        with socket.socket() as s2:
            try:
                s2.bind((host, port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free pair of TCP ports found on %s" % host)


# The signals that stop every rank: they would otherwise end the launcher alone and leave the
# ranks (each in its own session, so the terminal's SIGHUP does not reach them) orphaned.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
_PR_SET_PDEATHSIG = 1


def _die_with(parent):
    """A preexec function: the child gets SIGTERM when the launcher's thread dies (Linux's
    PR_SET_PDEATHSIG), and exits at once if the launcher died before the call."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

    def arm():
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(128 + signal.SIGTERM)

    return arm


def _stop(procs, grace):
    """SIGTERM every live process group, then SIGKILL what is left after `grace` seconds."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while any(p.poll() is None for p in live) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in live:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def run(nproc, command, master_addr="127.0.0.1", master_port=None, grace=10.0, poll=0.05,
        bind_gpus=True):
    """Start `nproc` processes of `command` (a list) and supervise them; returns the exit code:
    0 when all succeeded, else the first failure's (128 + signal for a killed process)."""
    port = master_port or free_port(master_addr)
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    run_id = uuid.uuid4().hex
    procs = []
    interrupted = []

    def on_signal(signum, frame):
        interrupted.append(signum)

    old = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
    arm = _die_with(os.getpid()) if sys.platform.startswith("linux") else None
    try:
        for rank in range(nproc):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                       LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR=master_addr,
                       MASTER_PORT=str(port), UTENSIL_RUN_ID=run_id)
            if bind_gpus:
                env["CUDA_VISIBLE_DEVICES"] = visible[rank % len(visible)] if visible else str(rank)
            # each in a process group of its own: stopping it stops what it started as well
            procs.append(subprocess.Popen(command, env=env, start_new_session=True,
                                          preexec_fn=arm))
        while True:
            if interrupted:
                print("utensil_ffi.distributed.launch: interrupted; stopping %d processes" % nproc,
                      file=sys.stderr)
                _stop(procs, grace)
                return 128 + interrupted[0]
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                others = sum(c is None for c in codes)
                print("utensil_ffi.distributed.launch: rank %d exited with code %d; stopping "
                      "the %d still running" % (rank, code, others), file=sys.stderr)
                _stop(procs, grace)
                return code if code > 0 else 128 - code
            if all(c == 0 for c in codes):
                return 0
            time.sleep(poll)
    finally:
        _stop(procs, grace)
        for s, h in old.items():
            signal.signal(s, h)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m utensil_ffi.distributed.launch",
                                description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--nproc-per-node", type=int, required=True,
                   help="processes to start (one per GPU)")
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=None,
                   help="rank 0's port (default: a free one)")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds between SIGTERM and SIGKILL when stopping the others")
    p.add_argument("--no-gpu-binding", action="store_true",
                   help="do not set CUDA_VISIBLE_DEVICES per process")
    p.add_argument("script", help="the Python script every process runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    a = p.parse_args(argv)
    if a.nproc_per_node < 1:
        p.error("--nproc-per-node must be at least 1, got %d" % a.nproc_per_node)
    if a.master_port is not None and not 1 <= a.master_port <= 65534:
        p.error("--master-port must be in [1, 65534], got %d" % a.master_port)
    if not os.path.isfile(a.script):
        p.error("no such script: %s" % a.script)
    return run(a.nproc_per_node, [sys.executable, a.script] + a.args, a.master_addr,
               a.master_port, a.grace, bind_gpus=not a.no_gpu_binding)


if __name__ == "__main__":
    sys.exit(main())
