"""Process life cycle around the CPU backend's worker threads: interpreter exit and fork.

Each scenario runs in a child interpreter with a timeout, since the failures are a crash
(SIGSEGV at exit: the library was unloaded while threads it started still ran its code) or a
hang (a fork()ed child waiting forever for threads it did not inherit).

The child imports utensil_ffi from where this process imported it, so the same file can be run
against another checkout (PYTHONPATH=/other/checkout pytest tests/test_process_safety.py).
"""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import utensil_ffi as ut

PKG_ROOT = Path(ut.__file__).resolve().parent.parent
EXIT_RUNS = 20
TIMEOUT = 120

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="fork and /proc are Linux's")


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PKG_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.pop("UT_NUM_THREADS", None)
    return env


def _run(code, tmp_path=None, timeout=TIMEOUT):
    """Runs `code` in a new interpreter (its own process group, killed whole on timeout):
    (returncode, stdout, stderr); returncode None when it timed out."""
    args = [sys.executable, "-c", textwrap.dedent(code)]
    if tmp_path is not None:  # spawn needs an importable __main__: run it from a file
        script = tmp_path / "child_script.py"
        script.write_text(textwrap.dedent(code))
        args = [sys.executable, str(script)]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=_env(), start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return None, out, err


# ---- exit ------------------------------------------------------------------------------------

EXIT_SCRIPTS = {
    "matmul": """
        import utensil_ffi as ut
        a = ut.randn((300, 300))
        ut.matmul(a, a)
    """,
    "linear": """
        import utensil_ffi as ut
        ut.Linear(512, 512)(ut.randn((256, 512)))
    """,
}


@pytest.mark.parametrize("wait_policy", [None, "ACTIVE"], ids=["default", "spinning"])
@pytest.mark.parametrize("name", sorted(EXIT_SCRIPTS))
def test_exit_after_threaded_op(name, wait_policy):
    """The script ends right after a multi-threaded op: every run exits with status 0.

    OMP_WAIT_POLICY=ACTIVE keeps an OpenMP build's workers spinning until the process ends, so
    the old build crashed in every run (without it, in 7 to 15 of 20 on an idle machine); the
    library no longer uses OpenMP and must not care."""
    code = textwrap.dedent(EXIT_SCRIPTS[name])
    env = _env()
    if wait_policy:
        env["OMP_WAIT_POLICY"] = wait_policy
    failures = []
    # a few at a time: a loaded machine makes the exit race (if there is one) more likely
    for batch in range(0, EXIT_RUNS, 4):
        procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env,
                                  start_new_session=True)
                 for _ in range(min(4, EXIT_RUNS - batch))]
        for p in procs:
            try:
                _, err = p.communicate(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                _, err = p.communicate()
                failures.append("timeout")
                continue
            if p.returncode != 0:
                failures.append("status %d: %s" % (p.returncode, err.strip()[-300:]))
    assert not failures, "%d of %d runs failed: %s" % (len(failures), EXIT_RUNS, failures[:3])


# ---- fork and spawn --------------------------------------------------------------------------

# The child's answer: its matmul (compared with numpy's in float64), whether it equals the
# one-thread result bit for bit, its thread count and the threads its process holds after the op.
CHILD_FN = """
import os
import numpy as np
import utensil_ffi as ut

def child_work(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((300, 300)).astype(np.float32)
    y = rng.standard_normal((300, 300)).astype(np.float32)
    nt = ut.get_num_threads()
    got = np.asarray(ut.matmul(ut.from_numpy(x), ut.from_numpy(y)))
    tasks = len(os.listdir("/proc/self/task"))
    ut.set_num_threads(1)
    one = np.asarray(ut.matmul(ut.from_numpy(x), ut.from_numpy(y)))
    ut.set_num_threads(nt)
    ref = x.astype(np.float64) @ y.astype(np.float64)
    ok = bool(np.allclose(got, ref, rtol=1e-4, atol=1e-3))
    return ok, bool(np.array_equal(got, one)), nt, tasks
"""


def _fork_script(method, threads):
    return CHILD_FN + textwrap.dedent("""
        import multiprocessing as mp

        if __name__ == "__main__":
            if {threads} is not None:
                ut.set_num_threads({threads})
            a = ut.randn((300, 300))
            ut.matmul(a, a)                      # the parent's workers now exist
            ut.Linear(512, 512)(ut.randn((256, 512)))
            ctx = mp.get_context("{method}")
            with ctx.Pool(1) as pool:
                print("RESULT", pool.apply_async(child_work, (7,)).get(timeout=60), flush=True)
            print("PARENT", child_work(8), flush=True)  # and the parent still works
    """).format(method=method, threads=threads)


@pytest.mark.parametrize("threads", [None, 2], ids=["default_threads", "two_threads"])
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_child_process_runs_parallel_ops(method, threads, tmp_path):
    """After a parallel op in the parent, a multiprocessing child (fork or spawn) computes a
    correct matmul on more than one thread, without hanging."""
    if method not in __import__("multiprocessing").get_all_start_methods():
        pytest.skip("no %s start method" % method)
    rc, out, err = _run(_fork_script(method, threads), tmp_path)
    assert rc is not None, "the %s child hung:\n%s\n%s" % (method, out, err[-2000:])
    assert rc == 0, err[-2000:]
    res = {line.split(" ", 1)[0]: eval(line.split(" ", 1)[1]) for line in out.splitlines()
           if line.startswith(("RESULT", "PARENT"))}
    for who in ("RESULT", "PARENT"):
        ok, same_as_one_thread, nt, tasks = res[who]
        assert ok, "%s: matmul differs from numpy's" % who
        assert same_as_one_thread, "%s: the threaded result differs from one thread's" % who
        # a spawned child is a fresh interpreter: it starts at the default (the usable cores)
        inherits = who == "PARENT" or method == "fork"
        want = threads if threads is not None and inherits else len(os.sched_getaffinity(0))
        assert nt == want, who
        if nt > 1:
            assert tasks > 1, "%s ran its parallel op on one thread" % who


def test_fork_while_another_thread_runs_ops(tmp_path):
    """A thread keeps running parallel ops (and drawing random numbers) while the main thread
    forks: every child still runs parallel ops to the right answer, none hangs."""
    code = CHILD_FN + textwrap.dedent("""
        import threading

        if __name__ == "__main__":
            ut.set_num_threads(max(2, ut.get_num_threads()))
            a = ut.randn((300, 300))
            ut.matmul(a, a)  # the forking thread has run parallel ops too
            stop = threading.Event()

            def busy():
                a = ut.randn((300, 300))
                while not stop.is_set():
                    ut.matmul(a, a)
                    ut.randn((1000,))
                    ut.relu(ut.randn((200, 300)))

            th = threading.Thread(target=busy)
            th.start()
            bad = 0
            for i in range(12):
                r, w = os.pipe()
                pid = os.fork()
                if pid == 0:
                    os.close(r)
                    try:
                        ok, same, nt, tasks = child_work(i)
                        good = ok and same and tasks > 1
                    except BaseException:
                        good = False
                    os.write(w, b"1" if good else b"0")
                    os._exit(0)
                os.close(w)
                with os.fdopen(r, "rb") as f:
                    got = f.read()
                os.waitpid(pid, 0)
                bad += got != b"1"
            stop.set()
            th.join()
            print("BAD", bad, flush=True)
    """)
    rc, out, err = _run(code, tmp_path, timeout=TIMEOUT)
    assert rc is not None, "a forked child hung:\n%s\n%s" % (out, err[-2000:])
    assert rc == 0, err[-2000:]
    assert "BAD 0" in out, out + err[-2000:]
