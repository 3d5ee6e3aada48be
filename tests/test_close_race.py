"""A Tensor closed by one thread while another thread's functional op or Tensor method is using it:
the call either finishes on memory that stays valid until it ends, or raises ClosedError; never a
crash, a wrong result or a leak.

The cases run in child processes (with a timeout). The big tensors are allocated with mmap, so a
free during the C call unmaps the memory under it: on the code before every op held its
arguments (functional's fast paths read ``x._ptr`` unprotected) that was a SIGSEGV. The closing
thread also allocates right after each close, so a freed small tensor is soon reused.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import utensil_ffi as ut

PKG_ROOT = str(Path(ut.__file__).resolve().parent.parent)


def run_child(code, timeout=300):
    # a fixed mmap threshold: glibc would otherwise raise it after the first big free and serve
    # the next big tensors from the heap, where a use after free reads stale values quietly
    # keep the caller's path (cffi may come from it, as on the lent GPU machines)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072",
               PYTHONPATH=os.pathsep.join(filter(None, [PKG_ROOT, os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, timeout=timeout,
                       capture_output=True, text=True)
    assert r.returncode == 0, "child exited with %d\n%s" % (r.returncode, r.stderr[-3000:])
    return r.stdout


def test_close_during_a_long_op_does_not_crash():
    # each op runs long enough (tens of ms on big tensors) for the close to land inside the C call
    out = run_child("""
        import threading, time
        import numpy as np
        import utensil_ffi as ut
        from utensil_ffi import ClosedError
        F = ut.functional
        BIG = (2048, 2048)
        OPS = {
            "relu": (lambda x, y: ut.relu(x), 1.0),
            "relu6_backward": (lambda x, y: ut.relu6_backward(y, x), 2.0),
            "matmul": (lambda x, y: ut.matmul(x, y), 4096.0),
            "mse_loss": (lambda x, y: ut.mse_loss(x, y), 1.0),
            "add_": (lambda x, y: F.add_(y, x), 3.0),
            "copy_from": (lambda x, y: y.copy_from(x), 1.0),
            "copy_into_closed": (lambda x, y: x.copy_from(y), None),
            "clone": (lambda x, y: x.clone(), 1.0),
            "reshape": (lambda x, y: x.reshape(-1), 1.0),
            "transpose": (lambda x, y: x.transpose(0, 1), 1.0),
            "numpy": (lambda x, y: x.numpy(), 1.0),
            "to": (lambda x, y: x.to("cpu"), None),
            "global_avg_pool2d": (lambda x, y: ut.global_avg_pool2d(x.reshape(4, 8, 256, 512)), 1.0),
        }
        outcomes = {}
        for rnd in range(4):
            for name, (op, want) in OPS.items():
                x, y = ut.ones(BIG), ut.full(BIG, 2.0)
                got = []
                def run():
                    try:
                        got.append(op(x, y))
                    except ClosedError:
                        got.append(ClosedError)
                t = threading.Thread(target=run)
                t.start()
                time.sleep(0.0005 * (rnd % 3))
                x.close()
                z = ut.full(BIG, 7.0)  # reuses x's memory if it was freed under the call
                t.join()
                z.close()
                r = got[0]
                outcomes.setdefault(name, set()).add("closed" if r is ClosedError else "ran")
                if r is not ClosedError and want is not None:  # (None: the result is x, closed)
                    a = np.asarray(r)
                    # the values computed from x are right: its memory stayed valid for the call
                    assert a.flat[0] == want and a.flat[-1] == want, (name, a.flat[0], a.flat[-1])
                    assert np.all(a.reshape(-1)[::4099] == want), name
                    del a
                    if r is not y and isinstance(r, ut.Tensor):
                        r.close()
                    del r
                y.close()
        import gc; gc.collect()
        assert ut.live_tensors() == 0, ut.live_tensors()
        print(sorted((k, sorted(v)) for k, v in outcomes.items()))
    """)
    assert "relu" in out


def test_threads_closing_tensors_others_use_never_crash():
    # many short rounds: workers run matmul/relu/copy_from/shape and the calls over many tensors
    # (fill_many, sgd_step_many: their pointers held as one group) on shared tensors while
    # another thread closes them; every call succeeds or raises ClosedError
    run_child("""
        import random, sys, threading
        import numpy as np
        import utensil_ffi as ut
        import utensil_ffi.functional as F
        from utensil_ffi import ClosedError
        sys.setswitchinterval(1e-6)
        rng = random.Random(0)
        bad = []
        counts = {"ran": 0, "closed": 0}
        lock = threading.Lock()
        def work(ts, stop):
            k = 0
            while not stop.is_set() or k < 4:
                k += 1
                a, b = ts[k % 3], ts[(k + 1) % 3]
                try:
                    kind = k % 7
                    if kind == 0:
                        r = ut.matmul(a, b)
                        ok = r.shape == (64, 64) and float(r.numpy()[0, 0]) == 64.0
                    elif kind == 1:
                        r = ut.relu(a)
                        ok = float(r.numpy()[3, 5]) == 1.0
                    elif kind == 2:
                        r = None
                        a.copy_from(b)
                        ok = True
                    elif kind == 3:
                        r = a.reshape(-1)
                        ok = r.shape == (4096,)
                    elif kind == 4:
                        r = None
                        ok = a.shape == (64, 64) and a.numpy()[1, 1] == 1.0
                    elif kind == 5:
                        r = None
                        F.fill_many([a, b], 1.0)
                        ok = True
                    else:  # lr 0: the values stay ones
                        r = None
                        F.sgd_step_many([a], [b], [ts[(k + 2) % 3]], lr=0.0, momentum=0.0)
                        ok = True
                    if r is not None:
                        r.close()
                    with lock:
                        counts["ran"] += 1
                    if not ok:
                        bad.append(kind)
                except ClosedError:
                    with lock:
                        counts["closed"] += 1
                except Exception as e:
                    bad.append(repr(e))
        for rnd in range(300):
            ts = [ut.ones((64, 64)) for _ in range(3)]
            stop = threading.Event()
            ws = [threading.Thread(target=work, args=(ts, stop)) for _ in range(3)]
            for w in ws: w.start()
            order = list(ts)
            rng.shuffle(order)
            for t in order:
                for _ in range(rng.randrange(50)):
                    pass
                t.close()
                ut.full((64, 64), 7.0).close()  # a freed tensor's memory, reused and overwritten
            stop.set()
            for w in ws: w.join()
        assert not bad, bad[:10]
        assert counts["ran"] and counts["closed"], counts
        import gc; gc.collect()
        assert ut.live_tensors() == 0, ut.live_tensors()
        print(counts)
    """)
