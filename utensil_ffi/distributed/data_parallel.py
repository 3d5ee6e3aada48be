"""Data-parallel training over several processes: who is who, meeting up, and splitting the data.

One process per GPU, started by ``torchrun``, ``mpirun`` or
``python -m utensil_ffi.distributed.launch``.
This module holds the parts that need no GPU library:

- :func:`env_from_environ` reads the launcher's environment (torchrun's names: ``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and refuses an inconsistent
  one with a message naming the variable; :func:`env_from_mpi` asks MPI (mpi4py) instead.
- :class:`FileRendezvous` lets the ranks meet through one file on a shared file system: rank 0
  publishes a payload (the communicator's id) atomically, the others wait for it; two processes
  claiming one rank, ranks that disagree on the world size, or a rank 0 that never comes are
  errors, not hangs.
- :class:`ProcessGroup` joins the processes into one NCCL group (loaded at run time: the
  ``nvidia-nccl-cu13`` wheel, ``$UTENSIL_NCCL_LIB`` or the system's ``libnccl.so.2``) for
  all-reduce and broadcast of GPU tensors.
- :class:`DistributedDataParallel` wraps a model so that every rank starts from rank 0's
  weights and steps with the gradients averaged over all ranks.
- :class:`GradientBuffer` lays a model's gradients end to end in one tensor, so that one
  all-reduce after backward serves all of them.
- :class:`DistributedSampler` splits a data set into disjoint, equally long shards per rank in one
  global order that every rank computes alike from the seed and the epoch (PyTorch's
  ``DistributedSampler`` rule).
"""

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import _args
from .. import cuda as _cuda
from .. import functional as F
from .._errors import ArgumentError, ArgumentTypeError, ClosedError, DistributedError
from .._errors import check, check_status
from .._lib import ffi, lib
from ..nn.module import _backward_params_only, _takes_input_grad
from ..tensor import Tensor, zeros

__all__ = ["DistEnv", "env_from_environ", "env_from_mpi", "FileRendezvous", "ProcessGroup",
           "DistributedDataParallel", "GradientBuffer", "DistributedSampler", "nccl_info"]

_LAUNCHERS = "torchrun, python -m utensil_ffi.distributed.launch or mpirun"


@dataclass(frozen=True)
class DistEnv:
    """One process's place in a run: ``rank`` in [0, world_size), ``local_rank`` its GPU on
    this machine, and where rank 0 listens (``master_addr``, ``master_port``; None under MPI)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str = None
    master_port: int = None
    run_id: str = None

    @property
    def is_main(self):
        """True on rank 0: the rank that prints, writes checkpoints and plots."""
        return self.rank == 0


def _int_var(environ, name, lo, hi):
    text = environ[name]
    try:
        v = int(text.strip())
    except ValueError:
        raise DistributedError("%s=%r is not an integer (set by %s)" % (name, text, _LAUNCHERS)) \
            from None
    if not lo <= v <= hi:
        raise DistributedError("%s=%d is out of range: it must be in [%d, %d]" % (name, v, lo, hi))
    return v


def env_from_environ(environ=None):
    """The :class:`DistEnv` of this process from torchrun's variables (``environ`` defaults to
    ``os.environ``). Every missing variable is named in one error; ``MASTER_PORT`` leaves room
    for NCCL's bootstrap on the port after it (torchrun itself listens on ``MASTER_PORT``)."""
    environ = os.environ if environ is None else environ
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    missing = [n for n in names if not str(environ.get(n, "")).strip()]
    if missing:
        raise DistributedError(
            "missing %s in the environment: start the processes with %s (or give them these "
            "variables)" % (", ".join(missing), _LAUNCHERS))
    world = _int_var(environ, "WORLD_SIZE", 1, 1 << 20)
    rank = _int_var(environ, "RANK", 0, world - 1)
    local = _int_var(environ, "LOCAL_RANK", 0, world - 1)
    port = _int_var(environ, "MASTER_PORT", 1, 65534)
    if "LOCAL_WORLD_SIZE" in environ:
        lw = _int_var(environ, "LOCAL_WORLD_SIZE", 1, world)
        if local >= lw:
            raise DistributedError("LOCAL_RANK=%d is not below LOCAL_WORLD_SIZE=%d" % (local, lw))
    run_id = environ.get("UTENSIL_RUN_ID") or environ.get("TORCHELASTIC_RUN_ID") or None
    return DistEnv(rank, world, local, environ["MASTER_ADDR"].strip(), port, run_id)


def env_from_mpi(comm=None):
    """The :class:`DistEnv` from MPI (mpi4py's ``COMM_WORLD`` unless ``comm`` is given); the
    local rank is the rank among the processes sharing this machine's memory."""
    if comm is None:
        try:
            from mpi4py import MPI
        except ImportError:
            raise DistributedError("env_from_mpi needs mpi4py (pip install mpi4py)") from None
        comm = MPI.COMM_WORLD
        local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    else:
        local = comm.Get_rank()
    return DistEnv(comm.Get_rank(), comm.Get_size(), local)


class FileRendezvous:
    """Ranks meeting through ``path`` on a file system all of them see.

    ``exchange(payload)`` on rank 0 publishes ``payload`` (bytes) with the world size and the run
    id: written to a temporary file, flushed to disk, then renamed over ``path``, so a reader
    sees all of it or nothing. Every other rank waits (up to ``timeout`` seconds) for a file of
    this run and returns the payload. Before that each rank claims ``path.rank<r>``: a second
    process with the same rank in the same run fails. ``run_id`` (default: the launcher's
    ``UTENSIL_RUN_ID`` or torchrun's ``TORCHELASTIC_RUN_ID``) tells this run's files from a
    crashed earlier run's; without one, use a fresh path per run.
    """

    def __init__(self, path, rank, world_size, timeout=300.0, run_id=None, poll=0.02):
        self.path = os.fspath(path)
        self.world_size = _args.to_int(world_size, "world_size", 1)
        self.rank = _args.to_int(rank, "rank", 0, self.world_size - 1)
        self.timeout = float(timeout)
        if not self.timeout > 0:
            raise ArgumentError("FileRendezvous: timeout must be positive, got %r" % (timeout,))
        self.run_id = run_id or os.environ.get("UTENSIL_RUN_ID") or \
            os.environ.get("TORCHELASTIC_RUN_ID") or ""
        self.poll = poll
        self._claim = "%s.rank%d" % (self.path, self.rank)

    def _claim_rank(self):
        while True:
            try:
                fd = os.open(self._claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    with open(self._claim) as f:
                        owner = f.read()
                except FileNotFoundError:
                    continue  # its owner just cleaned up: try again
                if owner == self.run_id + "\n":
                    raise DistributedError(
                        "rank %d of run %r is claimed twice (%s exists): two processes were "
                        "given the same RANK" % (self.rank, self.run_id, self._claim)) from None
                os.unlink(self._claim)  # left by another run
                continue
            with os.fdopen(fd, "w") as f:
                f.write(self.run_id + "\n")
            return

    def exchange(self, payload=None):
        """Rank 0: publish ``payload`` (bytes) and return it; other ranks: wait for it."""
        self._claim_rank()
        if self.rank == 0:
            if not isinstance(payload, (bytes, bytearray)):
                raise ArgumentError("FileRendezvous.exchange: rank 0 must pass the payload as "
                                    "bytes, got %s" % type(payload).__name__)
            doc = {"world_size": self.world_size, "run_id": self.run_id,
                   "payload": bytes(payload).hex()}
            tmp = "%s.tmp%d" % (self.path, os.getpid())
            with open(tmp, "w") as f:
                json.dump(doc, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            return bytes(payload)
        deadline = time.monotonic() + self.timeout
        while True:
            doc = self._read()
            if doc is not None and doc.get("run_id") == self.run_id:
                if doc.get("world_size") != self.world_size:
                    raise DistributedError(
                        "rank %d has WORLD_SIZE=%d but rank 0 published %r: the processes "
                        "disagree on the world size" % (self.rank, self.world_size,
                                                         doc.get("world_size")))
                return bytes.fromhex(doc["payload"])
            if time.monotonic() > deadline:
                raise DistributedError(
                    "rank %d waited %.0f s for rank 0 to publish %s: rank 0 did not start, "
                    "failed, or uses another path or run id" % (self.rank, self.timeout,
                                                                self.path))
            time.sleep(self.poll)

    def _read(self):
        try:
            with open(self.path) as f:
                return json.load(f)
        except (FileNotFoundError, ValueError):
            return None

    def cleanup(self):
        """Remove this rank's claim (and, on rank 0, the published file)."""
        for p in (self._claim,) + ((self.path,) if self.rank == 0 else ()):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass


def _wheel_nccl():
    """The nvidia-nccl-cu13 wheel's libnccl, or None (found under each sys.path entry)."""
    for entry in sys.path:
        p = Path(entry or ".") / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
        if p.is_file():
            return str(p.resolve())
    return None


WHEEL_NCCL = _wheel_nccl()
if WHEEL_NCCL:
    check_status(lib.ut_nccl_hint(WHEEL_NCCL.encode()), "nccl hint")


def nccl_info():
    """Which NCCL the library loaded, or why none ("NCCL 2.28.9 (path)")."""
    return ffi.string(lib.ut_nccl_info()).decode("utf-8", "replace")


class ProcessGroup:
    """This process's membership in the run's NCCL group (one process per GPU).

    ``env`` defaults to :func:`env_from_environ`. The group's id reaches every rank by
    ``rendezvous``: None (torchrun or ``utensil_ffi.distributed.launch``: NCCL's own bootstrap on
    ``MASTER_ADDR`` and the port after ``MASTER_PORT``, through ``NCCL_COMM_ID``), a
    :class:`FileRendezvous` or a path for one, or ``"mpi"`` (mpi4py's broadcast). Joining blocks
    until every rank has joined. ``close()`` leaves after the queued work, ``abort()`` at once.

    ``timeout`` (seconds; PyTorch's default, 10 minutes) bounds every wait on the group's work
    (:meth:`wait`, :meth:`barrier`, :class:`DistributedDataParallel`'s step): a rank that died
    or hangs makes the others raise :class:`DistributedError` within it, the group aborted,
    instead of hanging. ``$UTENSIL_DIST_TIMEOUT`` overrides the default.
    """

    def __init__(self, env=None, rendezvous=None, timeout=None):
        if timeout is None:
            timeout = os.environ.get("UTENSIL_DIST_TIMEOUT", "600")
        try:
            self.timeout = float(timeout)
        except (TypeError, ValueError):
            raise ArgumentError("ProcessGroup: timeout must be a number of seconds, got %r"
                                % (timeout,)) from None
        if not 0 < self.timeout <= 1e9:
            raise ArgumentError("ProcessGroup: timeout must be in (0, 1e9] seconds, got %r"
                                % (timeout,))
        self._p = None
        self.env = env = env if env is not None else env_from_environ()
        id_ = ffi.new("unsigned char[]", lib.UT_DIST_ID_BYTES)
        if rendezvous is None:
            if env.master_addr is None:
                raise ArgumentError("ProcessGroup: this environment has no MASTER_ADDR; give a "
                                    "rendezvous (a file path or 'mpi')")
            os.environ.setdefault("NCCL_COMM_ID", "%s:%d" % (env.master_addr,
                                                              env.master_port + 1))
            check_status(lib.ut_dist_unique_id(id_), "ProcessGroup")
        elif rendezvous == "mpi":
            from mpi4py import MPI

            if env.rank == 0:
                check_status(lib.ut_dist_unique_id(id_), "ProcessGroup")
            got = MPI.COMM_WORLD.bcast(bytes(ffi.buffer(id_)), root=0)
            ffi.memmove(id_, got, len(got))
        else:
            rv = rendezvous if isinstance(rendezvous, FileRendezvous) else \
                FileRendezvous(rendezvous, env.rank, env.world_size, run_id=env.run_id)
            if env.rank == 0:
                check_status(lib.ut_dist_unique_id(id_), "ProcessGroup")
                rv.exchange(bytes(ffi.buffer(id_)))
            else:
                got = rv.exchange()
                ffi.memmove(id_, got, len(got))
        p = lib.ut_dist_init(env.world_size, env.rank, id_)
        if p == ffi.NULL:
            check("ProcessGroup")
        self._p = p

    @property
    def rank(self):
        return self.env.rank

    @property
    def world_size(self):
        return self.env.world_size

    def _ptr(self, what):
        if self._p is None:
            raise ClosedError("ProcessGroup.%s: the group is closed" % what)
        return self._p

    @staticmethod
    def _tensor(t, what):
        if not isinstance(t, Tensor):
            raise ArgumentTypeError("%s: expected a Tensor, got %s" % (what, type(t).__name__))
        return t.ptr

    def all_reduce(self, tensor, op="avg"):
        """In place: ``tensor`` (on the GPU) becomes the mean (``op="avg"``) or the sum
        (``"sum"``) of every rank's."""
        if op not in ("avg", "sum"):
            raise ArgumentError("all_reduce: op must be 'avg' or 'sum', got %r" % (op,))
        check_status(lib.ut_dist_all_reduce(self._ptr("all_reduce"),
                                            self._tensor(tensor, "all_reduce"), op == "avg"),
                     "all_reduce")
        return tensor

    def broadcast(self, tensor, src=0):
        """In place: every rank's ``tensor`` becomes rank ``src``'s."""
        src = _args.to_int(src, "src", 0, self.world_size - 1)
        check_status(lib.ut_dist_broadcast(self._ptr("broadcast"),
                                           self._tensor(tensor, "broadcast"), src), "broadcast")
        return tensor

    def barrier(self):
        """Return when every rank has reached its barrier (a one-element all-reduce, waited for
        while polling NCCL's errors)."""
        with zeros((1,), "cuda") as t:
            self.all_reduce(t, "sum")
            self.wait()

    def wait(self, timeout=None):
        """Wait for the GPU work queued so far (collectives included), at most ``timeout``
        seconds (default: the group's). A dead or hung peer, or the timeout, aborts the group
        and raises DistributedError; the group is then unusable (every rank should exit)."""
        t = self.timeout if timeout is None else timeout
        st = lib.ut_dist_wait(self._ptr("wait"), float(t))
        if st < 0:
            msg = ffi.string(lib.ut_last_error()).decode("utf-8", "replace")
            lib.ut_dist_free(self._p)  # NCCL's side is already aborted
            self._p = None
            raise DistributedError("rank %d: %s" % (self.rank, msg))

    def all_reduce_floats(self, values, op="sum"):
        """Host numbers (a list or array) summed (or averaged) over the ranks: metrics such as
        the correct count and the loss sum of an evaluation. Waits for the result."""
        a = np.asarray(values, dtype=np.float32).ravel()
        if a.size == 0:
            return a
        with Tensor(a, "cuda") as t:
            self.all_reduce(t, op)
            self.wait()
            return t.numpy().copy()

    def check(self):
        """Raise DeviceError when NCCL reported an error in the background (a peer died)."""
        check_status(lib.ut_dist_check(self._ptr("check")), "ProcessGroup")

    def close(self):
        if getattr(self, "_p", None) is not None:
            lib.ut_dist_free(self._p)
            self._p = None

    def abort(self):
        if getattr(self, "_p", None) is not None:
            lib.ut_dist_abort(self._p)
            self._p = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.close()
        else:
            self.abort()


class GradientBuffer:
    """The gradients of ``parameters`` laid end to end in ``flat`` (one tensor on their device):
    ``pack()`` copies every ``p.grad`` in, ``unpack()`` copies ``flat`` back out, in the order of
    ``parameters``. Between the two, one all-reduce of ``flat`` averages every gradient.
    ``close()`` (or ``with``) frees ``flat``."""

    def __init__(self, parameters):
        self.parameters = list(parameters)
        if not self.parameters:
            raise ArgumentError("GradientBuffer: no parameters")
        for i, p in enumerate(self.parameters):
            if not isinstance(p, Tensor) or not isinstance(getattr(p, "grad", None), Tensor):
                raise ArgumentTypeError("GradientBuffer: parameters[%d] is not a Parameter with "
                                        "a gradient" % i)
        devices = {p.device for p in self.parameters}
        if len(devices) != 1:
            raise ArgumentError("GradientBuffer: the parameters are on several devices (%s)"
                                % ", ".join(sorted(devices)))
        self.numel = sum(int(np.prod(p.shape)) for p in self.parameters)
        self.flat = zeros((self.numel,), devices.pop())

    def pack(self):
        F.pack(self.flat, [p.grad for p in self.parameters])
        return self.flat

    def unpack(self):
        F.unpack(self.flat, [p.grad for p in self.parameters])

    def close(self):
        self.flat.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class DistributedDataParallel:
    """``module`` trained by every rank of ``group`` as one model (PyTorch's
    ``DistributedDataParallel``; utensil's backward is explicit, so there are no hooks).

    At construction each parameter and buffer is broadcast from rank 0: every rank starts
    alike. ``backward(grad_out)`` runs the module's backward, then averages the gradients over
    the ranks with one all-reduce of one contiguous buffer (:class:`GradientBuffer`; at
    MobileNet's size one all-reduce after backward is faster than overlapping per-layer ones),
    so identical optimizer steps keep the ranks identical. With ``broadcast_buffers`` (the
    default, as PyTorch) the buffers (BatchNorm's running statistics) are broadcast from rank 0
    before each training forward. ``group`` is a :class:`ProcessGroup` or anything with its
    ``all_reduce`` and ``broadcast``.
    """

    def __init__(self, module, group, broadcast_buffers=True):
        self.module = module
        self.group = group
        self.broadcast_buffers = _args.to_bool(broadcast_buffers, "broadcast_buffers")
        for _, t in list(module.named_parameters()) + list(module.named_buffers()):
            group.broadcast(t, 0)
        self._grads = GradientBuffer(module.parameters())

    def __call__(self, x):
        return self.forward(x)

    def forward(self, x):
        if self.broadcast_buffers and self.module.training:
            for _, t in self.module.named_buffers():
                self.group.broadcast(t, 0)
        return self.module(x)

    @_takes_input_grad
    def backward(self, grad_out, *, input_grad=True):
        """The module's backward, then the gradients averaged over the ranks; returns dx, or
        with ``input_grad=False`` None (the module is asked for its parameter gradients only:
        see Module.backward)."""
        if _args.to_bool(input_grad, "input_grad"):
            dx = self.module.backward(grad_out)
        else:
            dx = _backward_params_only(self.module, grad_out)
        self.sync_gradients()
        return dx

    def sync_gradients(self):
        """Average every parameter's gradient over the ranks (one all-reduce); then, outside
        a CUDA graph recording, wait for it within the group's timeout (a dead peer becomes
        an error here, not a hang at the next read of the GPU)."""
        self.group.all_reduce(self._grads.pack(), "avg")
        self._grads.unpack()
        wait = getattr(self.group, "wait", None)
        if wait is not None and not _cuda.is_current_stream_capturing():
            wait()

    def parameters(self):
        return self.module.parameters()

    def named_parameters(self, *a, **k):
        return self.module.named_parameters(*a, **k)

    def state_dict(self):
        return self.module.state_dict()

    def load_state_dict(self, state_dict, strict=True):
        return self.module.load_state_dict(state_dict, strict)

    def train(self, mode=True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def zero_grad(self, set_to_none=False):
        self.module.zero_grad(set_to_none)

    def close(self):
        """Free the gradient buffer (the module stays the caller's)."""
        self._grads.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class DistributedSampler:
    """Indices of rank ``rank``'s share of a data set of ``n`` items (PyTorch's rule).

    Each epoch the ``n`` indices are put in one global order (a permutation drawn from
    ``seed + epoch`` when ``shuffle``, else 0..n-1) that every rank computes alike; rank r takes
    every ``world_size``-th index from position r. Without ``drop_last`` the order is padded
    with its own first indices to a multiple of ``world_size`` (every rank gets
    ``ceil(n / world_size)``); with it the tail is dropped (``floor``). Call ``set_epoch`` before
    each epoch for a new order.
    """

    def __init__(self, n, world_size, rank, shuffle=True, seed=0, drop_last=False):
        self.n = _args.to_int(n, "n", 0)
        self.world_size = _args.to_int(world_size, "world_size", 1)
        self.rank = _args.to_int(rank, "rank", 0, self.world_size - 1)
        self.shuffle = _args.to_bool(shuffle, "shuffle")
        self.seed = _args.to_int(seed, "seed", 0, 2**63 - 1)
        self.drop_last = _args.to_bool(drop_last, "drop_last")
        self.epoch = 0
        if self.drop_last:
            self.num_samples = self.n // self.world_size
        else:
            self.num_samples = -(-self.n // self.world_size)
        self.total_size = self.num_samples * self.world_size

    def set_epoch(self, epoch):
        self.epoch = _args.to_int(epoch, "epoch", 0)

    def global_order(self):
        """The epoch's order of all indices, before padding or dropping (the same on every
        rank)."""
        if self.shuffle:
            return np.random.default_rng([self.seed, self.epoch]).permutation(self.n)
        return np.arange(self.n)

    def indices(self):
        order = self.global_order()
        if self.total_size > len(order) and len(order):
            reps = -(-self.total_size // len(order))
            order = np.tile(order, reps)
        order = order[:self.total_size]
        return order[self.rank:self.total_size:self.world_size]

    def __iter__(self):
        return iter(self.indices().tolist())

    def __len__(self):
        return self.num_samples
