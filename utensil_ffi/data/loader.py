"""Batches of a data set, epoch by epoch, in utensil-train's order, optionally decoded in the
background by worker processes.

    from utensil_ffi.data.loader import Loader
    with Loader(folder, batch_size=64, seed=0, workers=2) as loader:
        for epoch in range(epochs):
            for x, y in loader.epoch(epoch):      # x float32 [B, C, H, W], y int64 [B]
                ...

Order: epoch e visits ``data.batches(n, batch_size, seed, e)`` (over ``indices`` when given), the
order utensil-train uses for in-memory arrays, so an image folder and the same images in an .npz
train in the same order. ``shuffle=False`` visits every sample in order (for evaluation; the last
batch may be short, even a single sample). Sample i of epoch e is ``dataset.load(i, rng)`` with
``rng = np.random.default_rng((seed, epoch, i))`` (None when ``dataset.random`` is false;
``dataset[i]`` for data sets without ``load``), so batches are bitwise the same for any number
of workers.

Workers: ``workers=W > 0`` starts W processes on the first epoch and keeps them for later ones.
The workers take batches in turn; up to W * ``prefetch`` batches are in flight ahead of the
consumer; batches come back in order. Workers are started with multiprocessing's "spawn"
method: a fresh interpreter inherits no threads, locks or GPU state from the parent (fork
would copy a CUDA context and the library's thread pool, neither of which survives in a child)
and behaves the same on Linux, macOS and Windows; forkserver would save part of the start-up,
but its server and preload list are process-wide state shared with whatever else uses
multiprocessing. The price, a new interpreter per worker (about a second), is paid once per
Loader. So the data set and its transforms must be picklable, and a script that makes a Loader
needs the usual ``if __name__ == "__main__":`` guard. Workers import utensil_ffi (the library
initializes no GPU until a GPU op runs), never call into it, and hide the GPUs from themselves
(CUDA_VISIBLE_DEVICES="") before loading anything; they ignore SIGINT (blocked from their start
until then): Ctrl-C is the parent's.

Hand-over: the parent is the process that trains, so its cost per batch is what limits a fast
GPU (40k images/s of 3x32x32 leaves 3 ms per batch of 128 for everything). Receiving a 1.5 MB
batch through a pipe costs it a read and an unpickling copy, over a millisecond; so workers
write each batch into a slot of one shared-memory segment (utensil_ffi.data.shm_ring: W * prefetch
slots of ``batch_size`` samples, sized by the first batch, which still comes through the pipe)
and send only (batch, rows). Each submitted batch takes a free slot and keeps it until the
parent has received the batch and its consumer is done with it: at once with ``copy=True`` (the
default: the consumer gets a copy), or when it asks for the next batch with ``copy=False`` (the
consumer gets views of the slot: no copy at all; utensil-train uploads each batch into a tensor
at once). A batch whose samples differ in shape from the first one's (images not resized to one
size), and every batch where /dev/shm has no room (a warning says so), comes through the pipe.
The segment (``/dev/shm/utensil_<pid>_...``) is unlinked when the workers stop, however they
stop; views still held keep their memory mapped until they go.

The next epoch's first batches: a window of W * ``prefetch`` batches that stopped at the end of
each epoch would leave the workers idle while the consumer takes an epoch's last batches, and
make it wait for a whole batch's decoding (tens of ms) when it asks for the next epoch: with a
fast GPU and a small data set (31 batches an epoch), enough to cost a tenth of the epoch. So the
window runs on past the end of an epoch into the first batches of the epoch expected next, e + 1
(or the same batches again when every epoch has them: ``shuffle=False`` and a data set that draws
nothing, as an evaluation), and ``epoch(e + 1)`` finds them ready. They are what that epoch
would load anyway (the order is known beforehand, the rng is (seed, epoch, i)), so nothing
depends on the guess but time. When the consumer then asks for another epoch, the batches sent
ahead are received and dropped first (at once when the workers have finished them; at worst
their decoding is waited for), a worker's exception among them with them: it is raised only in
the epoch that asks for that batch, as itself. The last epoch's guess is work wasted, W *
``prefetch`` batches.

Shutdown: ``close()``, leaving a ``with`` block, or garbage collection stops the workers and
unlinks their shared memory. An epoch that does not run to its end (the consumer raised or broke
out of the loop, Ctrl-C, a worker error, a dead worker) stops them too, with the batches they
held for it and for the epoch after, so no process or segment outlives an interrupted loop; the
next epoch starts new ones. (Keeping them would save a restart after a ``break``, but a loop left
by an exception usually ends the program, whose workers should go with it, and the loader
cannot tell the two apart.)
A worker's exception is re-raised in the parent as itself (a DataError naming the file), with the
worker's traceback as its cause; a worker that dies, or sends nothing within ``timeout`` seconds,
is a LoaderError that says which and how. Workers read their end of a pipe from the parent and
exit when it closes, so they also go when the parent is killed (and multiprocessing's resource
tracker then unlinks the segment).
"""

import multiprocessing
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections import deque
from multiprocessing import connection

import numpy as np

from .._errors import UtensilError
from .datasets import DataError
from .datasets import batches as _batches
from .shm_ring import Ring, attach

__all__ = ["Loader", "LoaderError", "load_batch"]

START_METHODS = ("spawn", "forkserver")
_GRACE_S = 0.25  # how long stopping waits for idle workers to leave before it terminates them


class LoaderError(UtensilError, RuntimeError):
    """A loader worker died, sent nothing within the timeout, or failed in a way that cannot be
    re-raised as itself."""


class _RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker (the re-raised exception's cause)."""

    def __init__(self, tb):
        super().__init__(tb)
        self.tb = tb

    def __str__(self):
        return "\n\n(in the loader worker)\n" + self.tb


def _where(dataset, index):
    samples = getattr(dataset, "samples", None)
    try:
        return "sample %d (%s)" % (index, samples[index][0])
    except (TypeError, IndexError, KeyError):
        return "sample %d" % index


def load_batch(dataset, indices, seed, epoch):
    """(x float32 [B, C, H, W], y int64 [B]): ``dataset``'s samples ``indices`` for ``epoch``,
    each loaded with ``np.random.default_rng((seed, epoch, index))`` (None when the data set says
    its transform draws nothing: ``dataset.random`` false). What a worker computes."""
    x, y, _ = _load(dataset, indices, seed, epoch)
    return x, y


def _load(dataset, indices, seed, epoch, out=None):
    """load_batch, written into the first B rows of ``out`` ((x, y) arrays of a shared-memory
    slot) when its sample shape is the batch's: (x, y, whether they are ``out``'s rows)."""
    if len(indices) == 0:
        raise ValueError("load_batch: an empty batch")
    load = getattr(dataset, "load", None)
    random = getattr(dataset, "random", True)
    xs, ys = [], []
    for i in indices:
        i = int(i)
        if load is not None:
            x, y = load(i, np.random.default_rng((seed, epoch, i)) if random else None)
        else:
            x, y = dataset[i]
        xs.append(np.asarray(x))
        ys.append(y)
    first = xs[0].shape
    if len(first) != 3:
        raise DataError("%s is an array of shape %s; a sample must be one [C, H, W] image"
                        % (_where(dataset, int(indices[0])), first))
    for i, x in zip(indices, xs):
        if x.shape != first:
            raise DataError("images of one batch differ in shape: %s is %s but %s is %s; give "
                            "the data set a transform that makes every image one size (e.g. "
                            "Resize(S) then CenterCrop(S))" % (_where(dataset, int(indices[0])),
                                                               first, _where(dataset, int(i)),
                                                               x.shape))
    b = len(xs)
    y = np.asarray(ys, dtype=np.int64)
    into = out is not None and out[0].shape[1:] == first and b <= len(out[0])
    x = out[0][:b] if into else np.empty((b,) + first, np.float32)
    for j, xj in enumerate(xs):
        x[j] = xj
    if into:
        out[1][:b] = y
        y = out[1][:b]
    return x, y, into


# -- the worker process ---------------------------------------------------------------------------
def _pack_error(e):
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    try:
        blob = pickle.dumps(e)
        pickle.loads(blob)  # some exceptions pickle but cannot be rebuilt; find out here
    except Exception:
        blob = None
    return blob, "%s: %s" % (type(e).__name__, e), tb


def _worker_main(dataset, tasks, results):
    """Serve (k, seed, epoch, indices, slot) tasks until the parent closes ``tasks``; answer
    each with (k, rows, batch, error): rows > 0 when the batch was written into ``slot`` (a ring
    spec and a slot index), else the batch (x, y) itself or the packed error."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # blocked by the parent until now: see _start
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    out = queue.Queue()

    # A separate sender: a batch sent through the pipe (one that does not fit the ring) blocks
    # send() until the parent reads it, and the worker should meanwhile decode the next one.
    def send():
        stopped = False
        while True:
            item = out.get()
            if not stopped:
                try:
                    results.send(item)
                except (OSError, ValueError):  # the parent closed its end: it is stopping us
                    stopped = True
            out.task_done()

    sender = threading.Thread(target=send, name="utensil-loader-send", daemon=True)
    sender.start()
    rings = {}  # name -> the attached ring; one per pool, attached on its first slot
    last = None
    while True:
        try:
            task = tasks.recv()
        except (EOFError, OSError):
            break
        k, seed, epoch, idx, slot = task
        if epoch != last:
            # a batch of the next epoch (loaded ahead) starts once every batch of the running
            # one has been sent: a worker that dies on it then takes none of them along
            out.join()
            last = epoch
        idx = np.frombuffer(idx, np.int64)
        try:
            into = None
            if slot is not None:
                spec, s = slot
                if spec[0] not in rings:
                    rings[spec[0]] = attach(spec)
                into = rings[spec[0]].x[s], rings[spec[0]].y[s]
            x, y, written = _load(dataset, idx, seed, epoch, into)
            out.put((k, len(y), None, None) if written else (k, 0, (x, y), None))
        except Exception as e:
            out.put((k, 0, None, _pack_error(e)))
    # The parent has gone or is stopping us: leave now, without the interpreter's tear-down
    # (a tenth of a second per worker; there is nothing to flush but the standard streams).
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:
            pass
    os._exit(0)


# -- the parent's side of the workers ------------------------------------------------------------
def _stop(procs, conns, rings):
    """Close the pipes (idle workers see EOF and leave), then terminate, then kill what stays;
    then unlink the shared memory (only now: see Ring.unlink)."""
    try:
        for c in conns:
            try:
                c.close()
            except OSError:
                pass
        deadline = time.monotonic() + _GRACE_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.exitcode is None:
                p.terminate()
        for p in procs:
            p.join(1.0)
            if p.exitcode is None:
                p.kill()
                p.join()
            p.close()
        procs.clear()
        conns.clear()
    finally:  # a second Ctrl-C while stopping must not leave a segment in /dev/shm
        for r in rings:
            r.unlink()
        rings.clear()


def _start(process):
    """``process.start()`` with SIGINT blocked, a mask the new process inherits: a Ctrl-C that
    reaches the process group while the worker is still importing (before it can ignore SIGINT)
    then waits in the worker until it is ignored, instead of printing its traceback. The parent
    gets its KeyboardInterrupt as soon as the mask is restored."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not \
            threading.main_thread():
        return process.start()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _exit_text(code):
    if code is None:
        return "is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "signal %d" % -code
        hint = " (out of memory?)" if -code == getattr(signal, "SIGKILL", None) else ""
        return "was killed by %s%s" % (name, hint)
    return "exited with status %d (its error output above says why; a script that starts " \
           "workers needs an `if __name__ == \"__main__\":` guard)" % code


class _Workers:
    """W processes, each with a task pipe (parent -> worker) and a result pipe (worker ->
    parent), and the ring of ``slots`` shared-memory slots of ``capacity`` samples that their
    batches come back in (made when the first batch shows the sample shape)."""

    def __init__(self, dataset, n, method, slots, capacity):
        ctx = multiprocessing.get_context(method)
        self.procs, self.tasks, self.results = [], [], []
        # the batches sent and not yet received, oldest first: (worker, epoch, batch, slot).
        # Each worker answers its tasks in order, so the oldest's answer is its worker's next.
        self.pending = deque()
        self._turn = 0  # the workers take batches in turn, across epochs
        self._conns = []
        self.ring, self._rings = None, []  # _rings: for the finalizer to unlink
        self._slots, self._capacity, self._no_ring = slots, capacity, False
        self.piped = 0  # batches that came through a pipe (before the ring, or not fitting it)
        # stops the processes when this object is collected, or at exit, whichever comes first
        self._finalizer = weakref.finalize(self, _stop, self.procs, self._conns, self._rings)
        try:
            for w in range(n):
                task_r, task_w = ctx.Pipe(duplex=False)
                res_r, res_w = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_worker_main, args=(dataset, task_r, res_w), daemon=True,
                                name="utensil-loader-%d" % w)
                self._conns += [task_w, res_r]
                try:
                    _start(p)
                except BaseException as e:
                    task_r.close()
                    res_w.close()
                    if not isinstance(e, (pickle.PicklingError, TypeError, AttributeError)):
                        raise
                    raise TypeError("Loader(workers=%d): the data set cannot be sent to a worker "
                                    "process (%s); its class and transforms must be picklable "
                                    "(defined at module level, no lambdas), or use workers=0"
                                    % (n, e)) from None
                # the child holds its own copies; closing ours lets each side see EOF when the
                # other goes
                task_r.close()
                res_w.close()
                self.procs.append(p)
                self.tasks.append(task_w)
                self.results.append(res_r)
        except BaseException:
            self.close()
            raise

    def pids(self):
        return [p.pid for p in self.procs]

    def _died(self, w, epoch, k):
        p = self.procs[w]
        p.join(1.0)  # a worker whose pipe closed is exiting: let its exit status arrive
        owed = [(e, b) for v, e, b, _ in self.pending if v == w]
        epoch, k = owed[0] if owed else (epoch, k)  # the oldest batch it owed us
        return LoaderError("loader worker %d (pid %d) %s before sending batch %d of epoch %d"
                           % (w, p.pid, _exit_text(p.exitcode), k, epoch))

    def _make_ring(self, sample_shape):
        try:
            self.ring = Ring(self._slots, self._capacity, sample_shape)
        except OSError as e:
            self._no_ring = True
            warnings.warn("Loader: no room for the batches in shared memory (%s); the workers "
                          "send them through pipes, which costs this process more time per "
                          "batch" % e, RuntimeWarning, stacklevel=4)
        else:
            self._rings.append(self.ring)

    def submit(self, epoch, k, seed, indices):
        """Send batch k of ``epoch`` to the next worker in turn, with a free slot of the ring
        when there is one."""
        w = self._turn % len(self.procs)
        slot = self.ring.acquire() if self.ring is not None else None
        try:
            # the indices as bytes: pickling a numpy array costs the parent tens of us
            self.tasks[w].send((k, seed, epoch, np.asarray(indices, np.int64).tobytes(),
                                None if slot is None else (self.ring.spec, slot)))
        except OSError:
            if slot is not None:
                self.ring.release(slot)
            raise self._died(w, epoch, k) from None
        self._turn += 1
        self.pending.append((w, epoch, k, slot))

    def release(self, slot):
        """The consumer is done with ``slot``: the next batch may be written into it."""
        if self.ring is not None:
            self.ring.release(slot)

    def receive(self, epoch, k, timeout):
        """Batch k of ``epoch``, the oldest one in flight: (x, y, slot), x and y arrays over the
        ring's ``slot`` (which the caller releases when its consumer is done) or, with slot
        None, the worker's own. A worker's exception is raised here as itself."""
        (w, e, b, _), x, y, slot, err = self._take(timeout)
        if (e, b) != (epoch, k):
            raise LoaderError("loader: received batch %d of epoch %d, expected batch %d of "
                              "epoch %d" % (b, e, k, epoch))
        if err is not None:
            blob, text, tb = err
            exc = None
            if blob is not None:
                try:
                    exc = pickle.loads(blob)
                except Exception:
                    exc = None
            if not isinstance(exc, BaseException):
                exc = LoaderError("loader worker %d raised %s" % (w, text))
            raise exc from _RemoteTraceback(tb)
        return x, y, slot

    def discard(self, timeout):
        """Receive every batch in flight and drop it, a worker's exception with it (a batch
        nobody asked for). A LoaderError when a worker died or hung: then stop the pool."""
        while self.pending:
            _, _, _, slot, _ = self._take(timeout)
            if slot is not None:
                self.ring.release(slot)

    def _take(self, timeout):
        """The oldest batch in flight: ((worker, epoch, batch, slot), x, y, slot or None, packed
        error or None); LoaderError when its worker died or sent nothing within ``timeout``."""
        w, epoch, k, _ = self.pending[0]
        conn, p = self.results[w], self.procs[w]
        # a batch that is already there needs no selector (tens of us per batch)
        ready = [conn] if conn.poll() else connection.wait([conn, p.sentinel], timeout)
        if not ready:
            raise LoaderError("loader worker %d (pid %d) sent nothing for %g s while loading "
                              "batch %d of epoch %d (Loader timeout=%g); it may be stuck reading "
                              "a file" % (w, p.pid, timeout, k, epoch, timeout))
        try:
            # data sent before a worker died is still in the pipe: read it first
            msg = conn.recv() if conn in ready or conn.poll() else None
        except (EOFError, OSError):
            msg = None
        if msg is None:
            raise self._died(w, epoch, k)
        got, rows, batch, err = msg
        task = self.pending.popleft()
        slot = task[3]
        if got != k:
            raise LoaderError("loader worker %d sent batch %d, expected %d" % (w, got, k))
        if rows:  # the worker wrote it into our slot
            x, y = self.ring.rows(slot, rows)
            return task, x, y, slot, None
        if slot is not None:  # unused: the batch did not fit, or it failed
            self.ring.release(slot)
        if err is not None:
            return task, None, None, None, err
        x, y = batch
        self.piped += 1
        if self.ring is None and not self._no_ring:
            self._make_ring(x.shape[1:])
        return task, x, y, None, None

    def close(self):
        self.ring = None
        self._finalizer()


# -- the loader -----------------------------------------------------------------------------------
class _Ahead:
    """The epoch expected next, its plan, and how many of its first batches are in flight."""

    __slots__ = ("epoch", "plan", "sent")

    def __init__(self, epoch, plan):
        self.epoch, self.plan, self.sent = epoch, plan, 0


def _count(v, what, low):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
        raise ValueError("Loader: %s must be an integer >= %d, got %r" % (what, low, v))
    return int(v)


class Loader:
    """``Loader(dataset, batch_size, shuffle=True, seed=0, workers=0, prefetch=2,
    drop_last=False, indices=None, share=None, timeout=None, start_method="spawn", copy=True)``

    ``dataset``: ``len()`` and ``load(i, rng)`` or ``[i]`` -> (float32 [C, H, W], int label)
    (an ImageFolder). ``indices``: the samples to use (the epoch's order is over their positions).
    ``drop_last``: leave out a last batch shorter than ``batch_size``. ``share``: a function from
    each batch's index array to the part this process loads (data-parallel training:
    train_dist's ``Dist.share``); ``batch_indices(e)`` still gives the whole batches. ``timeout``:
    seconds to wait for one batch from a worker before a LoaderError (None: no limit; the first
    batches of new workers wait for their start-up too, a second or more). ``copy``: True, the
    default, yields arrays of the consumer's own; False yields, from workers, views of the
    shared memory they wrote the batch into, valid until the next batch of the loader is
    requested, the request that ends the epoch included (then the memory is reused, soon by
    the next epoch's first batches: copy what must be kept). Views save a copy per batch
    and suit a consumer that uploads each batch at once (utensil-train).

    ``for x, y in loader`` runs the epoch set by ``set_epoch(e)`` (0 at first); ``loader.epoch(e)``
    runs epoch e. One epoch at a time per loader: starting another abandons an unfinished one (its
    iterator then raises) and stops the workers. With workers, a finished epoch e leaves the
    first batches of epoch e + 1 loading (see the module's doc): ask for the epochs in order.
    ``share`` must give the same result for the same batch every time. Not thread-safe.
    """

    def __init__(self, dataset, batch_size, shuffle=True, seed=0, workers=0, prefetch=2,
                 drop_last=False, indices=None, share=None, timeout=None, start_method="spawn",
                 copy=True):
        self.batch_size = _count(batch_size, "batch_size", 1)
        self.workers = _count(workers, "workers", 0)
        self.prefetch = _count(prefetch, "prefetch", 1)
        self.seed = _count(seed, "seed", 0)
        if start_method not in START_METHODS:
            raise ValueError("Loader: start_method must be one of %s, got %r (fork is unsafe once "
                             "the parent runs threads or a GPU)" % (", ".join(START_METHODS),
                                                                    start_method))
        if timeout is not None and not timeout > 0:
            raise ValueError("Loader: timeout must be None or > 0 seconds, got %r" % (timeout,))
        if share is not None and not callable(share):
            raise TypeError("Loader: share must be a function of a batch's indices, got %r"
                            % (share,))
        try:
            n = len(dataset)
        except TypeError:
            raise TypeError("Loader: the data set needs len() and load(i, rng) or [i], got %s"
                            % type(dataset).__name__) from None
        if indices is not None:
            indices = np.asarray(indices)
            if indices.ndim != 1 or (indices.size and indices.dtype.kind not in "iu"):
                raise ValueError("Loader: indices must be a 1-D array of integer sample indices")
            indices = indices.astype(np.int64)
            if indices.size and (indices.min() < 0 or indices.max() >= n):
                raise IndexError("Loader: indices must lie in [0, %d) (the data set's length), "
                                 "got values from %d to %d" % (n, indices.min(), indices.max()))
            n = len(indices)
        if n == 0:
            raise DataError("Loader: no samples to load (an empty data set or indices)")
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.indices = indices
        self.share = share
        self.timeout = timeout
        self.start_method = start_method
        self.copy = bool(copy)
        self._n = n
        self._epoch = 0
        self._pool = None
        self._ahead = None  # an _Ahead: the batches sent ahead for the expected next epoch
        self._active = None  # the token of the epoch being iterated
        self._closed = False

    # -- the order ----------------------------------------------------------------------------
    def batch_indices(self, epoch):
        """The data set's index arrays of ``epoch``'s batches, in order (whole batches)."""
        n, bs = self._n, self.batch_size
        if self.shuffle:
            out = _batches(n, bs, self.seed, int(epoch))
        else:
            out = [np.arange(i, min(i + bs, n)) for i in range(0, n, bs)]
        if self.drop_last and out and len(out[-1]) < bs:
            out.pop()
        if self.indices is not None:
            out = [self.indices[b] for b in out]
        return out

    def __len__(self):
        """Batches per epoch (the same for every epoch)."""
        return len(self.batch_indices(0))

    def set_epoch(self, epoch):
        """The epoch that ``iter(loader)`` runs next (as a DistributedSampler's set_epoch)."""
        self._epoch = int(epoch)

    def __iter__(self):
        return self.epoch(self._epoch)

    def epoch(self, epoch):
        """An iterator over epoch ``epoch``'s (x, y) batches."""
        if self._closed:
            raise ValueError("Loader: used after close()")
        return self._run(int(epoch))

    def worker_pids(self):
        """The worker processes' ids (empty while none run)."""
        return self._pool.pids() if self._pool is not None else []

    # -- running an epoch ---------------------------------------------------------------------
    def _plan(self, epoch):
        """The index arrays this process loads for ``epoch``'s batches."""
        plan = self.batch_indices(epoch)
        if self.share is not None:
            plan = [np.asarray(self.share(b)) for b in plan]
            for k, b in enumerate(plan):
                if len(b) == 0:
                    raise ValueError(
                        "Loader: share() leaves batch %d of epoch %d (%d samples) empty for "
                        "this process; to spread an evaluation over processes, give each its "
                        "part of the samples (indices=share(all)) instead"
                        % (k, epoch, len(self.batch_indices(epoch)[k])))
        return plan

    def _same_every_epoch(self):
        """Whether every epoch has the same batches: in order, and nothing drawn per epoch."""
        return not self.shuffle and not (hasattr(self.dataset, "load")
                                         and getattr(self.dataset, "random", True))

    def _run(self, epoch):
        if self._active is not None:  # an earlier epoch's iterator was left unfinished
            self._stop_workers()
        token = self._active = object()
        finished, held = False, None  # held: the slot under the views the consumer has
        try:
            if self.workers == 0:
                for b in self._plan(epoch):
                    self._check(token)
                    yield load_batch(self.dataset, b, self.seed, epoch)
            else:
                ahead, self._ahead = self._ahead, None
                if ahead is not None and (ahead.epoch == epoch or self._same_every_epoch()):
                    epoch, plan, sent = ahead.epoch, ahead.plan, ahead.sent  # the guess was right
                else:
                    if ahead is not None:  # the guess was wrong: drop the batches in flight
                        self._discard()
                    plan, sent = self._plan(epoch), 0
                if self._pool is None:
                    # a slot per batch in flight: the consumer's one is released before the
                    # next is submitted, so there is always a free slot
                    self._pool = _Workers(self.dataset, self.workers, self.start_method,
                                          self.workers * self.prefetch, self.batch_size)
                pool = self._pool
                for k in range(len(plan)):
                    self._check(token)
                    if held is not None:  # the consumer asked for the next batch
                        pool.release(held)
                        held = None
                    sent = self._submit(epoch, plan, sent, k)
                    x, y, slot = pool.receive(epoch, k, self.timeout)
                    if slot is not None:
                        if self.copy:
                            x, y = x.copy(), y.copy()
                            pool.release(slot)
                        else:
                            held = slot
                    yield x, y
                if held is not None:
                    pool.release(held)
                    held = None
                self._submit(epoch, plan, sent, len(plan))  # the window's last place: next epoch
            finished = True
        finally:
            if self._active is token:
                self._active = None
                if not finished:  # the outstanding batches go with the workers
                    self._stop_workers()

    def _submit(self, epoch, plan, sent, k):
        """Keep ``workers * prefetch`` batches in flight ahead of the consumer, who is at batch
        k of ``epoch``: this epoch's from ``sent`` on, then the next epoch's first ones.
        Returns how many of this epoch's have been sent."""
        depth = self.workers * self.prefetch
        while sent < len(plan) and sent < k + depth:
            self._pool.submit(epoch, sent, self.seed, plan[sent])
            sent += 1
        if k + depth > len(plan):
            self._submit_ahead(epoch, k + depth - len(plan))
        return sent

    def _submit_ahead(self, epoch, count):
        """Send the first ``count`` batches of the epoch expected after ``epoch`` (the next one,
        or this one again when every epoch has the same batches), those not sent yet. Nothing
        here may fail the epoch being run: an error in making that epoch's plan, or a dead
        worker, is left for that epoch to meet when it is asked for."""
        ahead = self._ahead
        if ahead is None:
            nxt = epoch if self._same_every_epoch() else epoch + 1
            try:
                ahead = _Ahead(nxt, self._plan(nxt))
            except Exception:
                return
            self._ahead = ahead
        try:
            while ahead.sent < min(count, len(ahead.plan)):
                self._pool.submit(ahead.epoch, ahead.sent, self.seed, ahead.plan[ahead.sent])
                ahead.sent += 1
        except LoaderError:
            pass

    def _discard(self):
        """Drop the batches sent ahead for an epoch that was not asked for next; stop the
        workers if one of them died or hung meanwhile (the next epoch starts new ones)."""
        try:
            self._pool.discard(self.timeout)
        except LoaderError:
            self._stop_workers()

    def _check(self, token):
        if self._closed:
            raise ValueError("Loader: used after close()")
        if self._active is not token:
            raise RuntimeError("Loader: this epoch's iterator was abandoned (another epoch "
                               "started on the same Loader before it finished)")

    def _stop_workers(self):
        pool, self._pool = self._pool, None
        self._ahead = None  # the batches sent ahead go with the workers
        if pool is not None:
            pool.close()

    def close(self):
        """Stop the workers now (idempotent); the loader cannot be used afterwards."""
        self._closed = True
        self._active = None
        self._stop_workers()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return "Loader(%d samples, batch_size=%d, shuffle=%s, seed=%d, workers=%d%s)" % (
            self._n, self.batch_size, self.shuffle, self.seed, self.workers,
            ", closed" if self._closed else "")
