"""The one owner of when C memory may be freed while other threads use it.

Python threads call into C concurrently (cffi releases the GIL during every call), and any of
them may close a Tensor or a layer that another one is using. Three rules keep every C call on
memory that stays valid until it returns; this module holds all of their state and code, and
tensor.py, functional.py and the layers of nn/ follow them through the names below:

1. Tensors (``_hold`` / ``_let_go``, ``_hold_group`` / ``_let_go_group``, ``_close``): a C call
   lists each pointer it reads for its duration; close() frees a pointer nobody lists and leaves
   any other to the last ``_let_go``, which frees it (``_DEFERRED``, ``_free_deferred``).
2. What a layer's forward keeps for its backward (``_State``, one ``_Stack`` per thread): each
   thread's forwards push their caches, its backward walks them in reverse; the entries are
   scoped to one outer Module call (``_in_pass``: the pass id in ``_PASS``), so a new call drops
   the earlier one's and memory stays bounded. Entries freed while calls are in flight wait for
   the last of them (``retire``, ``leave``).
3. A layer's C side (``_Handle``: its struct and caches): calls enter and leave it; ``free()``
   (the layer's close or its finalizer) makes new calls fail, waits for those in flight, then
   frees; ``wlock`` serializes the calls that write the layer's own tensors.

And at interpreter exit (``_EXITING``) nothing is freed any more: the process's memory goes
anyway, and the CUDA runtime may already be unloading.

Reading the code: tests/test_close_race.py (closes landing inside C calls) and
tests/test_threads.py (layers used from several threads) exercise it.
"""

import atexit
import itertools
import numbers
import threading
import weakref

from ._errors import ArgumentError, ArgumentTypeError, ClosedError
from ._lib import ffi, lib


# At interpreter exit the process's memory goes anyway (and the CUDA runtime may be gone before
# the last Tensor is collected), so __del__ frees nothing once atexit has run.
_EXITING = [False]
atexit.register(_EXITING.__setitem__, 0, True)
_CLOSE_LOCK = threading.Lock()  # close() from two threads at once frees one reference once


# -- 1. tensors -----------------------------------------------------------------------------------
# Closing a Tensor while another thread's C call uses it must not free the memory under that
# call. A call lists each pointer it uses in _IN_USE for its duration (_hold ... _let_go);
# close() frees only a pointer nobody lists, and otherwise defers the free to the _let_go that
# drops the last listing. One list for all threads: append and remove are each atomic, and
# cheaper than finding a per-thread list, which matters on every op's path. _hold re-reads _ptr
# after listing, so either close() sees the listing or _hold sees the close.
_IN_USE = []  # pointers C calls are using now, one entry per use (a multiset)
_DEFERRED = []  # pointers close() left for the last _let_go to free


def _hold(t, _list=_IN_USE.append, _unlist=_IN_USE.remove):
    """t's pointer, listed as in use (pair with _let_go); ClosedError if t is closed.

    Every C call on a Tensor another thread may close goes through it: functional's ops, the
    Tensor methods, the layers."""
    p = t._ptr
    if p is not None:
        _list(p)
        if t._ptr is p:
            return p
        # closed between the two reads: that close() saw the listing and deferred the free,
        # so this unlisting may be the last one, which frees
        _let_go(p)
    raise ClosedError("operation on a closed Tensor")


def _let_go(p, _unlist=_IN_USE.remove):
    _unlist(p)
    if _DEFERRED:
        _free_deferred()


# A call over many tensors (an optimizer step over a network, zero_grad, pack) lists their
# pointers as one entry instead: one append and one remove whatever the count, where a listing
# per tensor costs two Python calls each. The entries compare by identity, so the remove finds
# its own at once.
class _Group:
    __slots__ = ("ptrs",)

    def __init__(self, ptrs):
        self.ptrs = ptrs


_IN_USE_GROUPS = []  # _Group entries of the calls over many tensors running now


def _in_use(p):
    return p in _IN_USE or any(p in g.ptrs for g in _IN_USE_GROUPS)


def _hold_group(tensors):
    """The tensors' pointers, listed as in use as one _Group (pair with _let_go_group);
    ClosedError if one is closed. The same protocol as _hold: list, then re-read each _ptr."""
    ptrs = [t._ptr for t in tensors]
    for p in ptrs:
        if p is None:
            raise ClosedError("operation on a closed Tensor")
    g = _Group(ptrs)
    _IN_USE_GROUPS.append(g)
    for t, p in zip(tensors, ptrs):
        if t._ptr is not p:
            _let_go_group(g)
            raise ClosedError("operation on a closed Tensor")
    return g


def _let_go_group(g):
    _IN_USE_GROUPS.remove(g)
    if _DEFERRED:
        _free_deferred()


def _free_deferred():
    with _CLOSE_LOCK:
        free = [p for p in _DEFERRED if not _in_use(p)]
        for p in free:
            _DEFERRED.remove(p)
    for p in free:
        lib.ut_free(p)


def _close(t):
    """Tensor.close(): drop ``t``'s reference now (idempotent); a pointer another thread's call
    has listed is freed by the _let_go that ends that call."""
    with _CLOSE_LOCK:
        p = getattr(t, "_ptr", None)
        t._ptr = None
        if p is None:
            return
        deferred = _in_use(p)
        if deferred:
            _DEFERRED.append(p)  # another thread's call is using it: freed as it ends
    if not deferred:
        lib.ut_free(p)
    else:
        _free_deferred()  # in case that call ended before the append: its _let_go missed it


# The fast paths of functional (_unary, _binary) write _hold and _let_go out with these two,
# bound once: on a small op the two calls per tensor cost more than the rest of the protocol.
_list = _IN_USE.append
_unlist = _IN_USE.remove


# -- 2. what forward keeps, per thread and outer call ---------------------------------------------
# The outermost Module call running in each thread: layers tag what forward keeps with it.
_PASS = threading.local()
_pass_ids = itertools.count(1)


def _in_pass(fn, args):
    """fn(*args) as one outer call (unless one is running in this thread already)."""
    if getattr(_PASS, "id", None) is not None:
        return fn(*args)
    _PASS.id = next(_pass_ids)
    try:
        return fn(*args)
    finally:
        _PASS.id = None


# Whether what forward keeps stays after backward has used it (set_retain_forward): True, the
# entries stay until the next outer call replaces them, so a backward can be repeated; False,
# each layer frees its entries once its backward has walked them all (PyTorch's default), so
# a training step's activations are gone by the end of its backward instead of staying
# allocated until the next forward (a whole network's activations, between steps).
_RETAIN = [True]


def set_retain_forward(retain):
    """Keep (True, the default) or free (False) what each layer's forward keeps once its
    backward has used it; returns the previous setting. The gradients are the same either way;
    with False a second backward after one forward raises, as the first found nothing kept."""
    # a flag as _args.to_bool takes one (that module is this one's neighbour, not below it)
    if not (isinstance(retain, (bool, numbers.Integral)) and retain in (0, 1)
            or type(retain).__module__ == "numpy"  # numpy's bool, without importing numpy
            and type(retain).__name__ in ("bool", "bool_")):
        raise ArgumentTypeError("set_retain_forward: retain must be True or False, got %r"
                                % (retain,))
    retain = bool(retain)
    old = _RETAIN[0]
    _RETAIN[0] = retain
    return old


def get_retain_forward():
    return _RETAIN[0]


class _Stack:
    """One thread's forward caches on one layer: entries [(pass id, cache, versions...)], the
    first ``pos`` not yet differentiated; ``spent``: the last take() walked the first entry
    while forward entries are not retained (leave() frees them all). Freed with its thread
    (threading.local drops it)."""

    __slots__ = ("owner", "entries", "pos", "spent", "__weakref__")

    def __init__(self, owner):
        self.owner = owner
        self.entries = []
        self.pos = 0
        self.spent = False

    def __del__(self):
        if self.entries and not _EXITING[0]:
            self.owner.retire(self.entries)


class _State:
    """What a layer shares between threads: its forward caches (a _Stack per thread) and the
    count of C calls in flight, which close() waits for. ``lock`` guards both and is held only
    briefly; ``wlock`` serializes the calls that write the layer's tensors (backward's gradient
    accumulation, BatchNorm2d's running statistics)."""

    __slots__ = ("lock", "wlock", "busy", "idle", "tls", "stacks", "pending", "drop")

    def __init__(self, drop):
        self.lock = threading.Lock()
        self.wlock = threading.Lock()
        self.busy = 0
        self.idle = None  # an Event while close() waits
        self.tls = threading.local()
        self.stacks = weakref.WeakSet()
        self.pending = []  # entries to free once no call is in flight
        self.drop = drop  # frees one entry

    def push(self, entry):
        """Keep ``entry`` for this thread's backward, dropping those of an earlier outer call."""
        st = getattr(self.tls, "st", None)
        if st is None:
            st = self.tls.st = _Stack(self)
            with self.lock:
                self.stacks.add(st)
        pid = entry[0]
        with self.lock:
            old = st.entries
            if old and (pid is None or old[-1][0] != pid):
                st.entries = [entry]
            else:
                old = ()
                st.entries.append(entry)
            st.pos = len(st.entries)
        if old:
            self.retire(old)

    def take(self):
        """This thread's next entry to differentiate (the last forward's first), counted as in
        flight (call leave() after); None if there is none. Once all were used the walk starts
        over, so a backward can be repeated."""
        st = getattr(self.tls, "st", None)
        with self.lock:
            if st is None or not st.entries:
                return None
            if st.pos == 0:
                st.pos = len(st.entries)
            st.pos -= 1
            st.spent = st.pos == 0 and not _RETAIN[0]
            self.busy += 1
            return st.entries[st.pos]

    def local(self):
        """This thread's _Stack (its entries and walk position), None before its first push."""
        return getattr(self.tls, "st", None)

    def take_for(self, who):
        """take(), or the ArgumentError a backward without its forward raises (``who``: the
        layer's name)."""
        e = self.take()
        if e is None:
            raise ArgumentError("%s.backward: no forward pass to differentiate; call forward() "
                                "in training mode (layer.train()) first" % who)
        return e

    def untake(self):
        """Undo this thread's last take(): a backward refused before it computed anything
        leaves the walk where it was (a layer used twice would else pair the next backward with
        the other use's forward)."""
        st = getattr(self.tls, "st", None)
        with self.lock:
            if st is not None and st.pos < len(st.entries):
                st.pos += 1
                st.spent = False

    def leave(self):
        st = getattr(self.tls, "st", None)
        with self.lock:
            if st is not None and st.spent:  # this thread's backward used its last entry
                st.spent = False
                self.pending.extend(st.entries)
                st.entries = []
                st.pos = 0
            self.busy -= 1
            if self.busy:
                return
            old, self.pending = self.pending, []
            idle = self.idle
        if idle is not None:
            idle.set()
        for e in old:
            self.drop(e)

    def retire(self, entries):
        """Free ``entries`` now, or once the calls in flight (which may use them) end."""
        with self.lock:
            if self.busy:
                self.pending.extend(entries)
                return
        for e in entries:
            self.drop(e)

    def clear(self):
        """Drop every thread's entries."""
        with self.lock:
            old = []
            for st in list(self.stacks):
                old += st.entries
                st.entries = []
                st.pos = 0
        if old:
            self.retire(old)

    def wait_idle(self):
        """Block until no call is in flight (the caller has made new calls impossible)."""
        with self.lock:
            if not self.busy:
                return
            if self.idle is None:
                self.idle = threading.Event()
            idle = self.idle
        idle.wait()


# -- 3. a layer's C side --------------------------------------------------------------------------
class _Handle:
    """The C side of one layer: its struct and its forward caches, freed together.

    Kept apart from the layer object so a finalizer can free it without keeping the layer alive.
    Each forward that keeps a cache fills a fresh cache struct (the layer class's ``_c_cache``)
    of its own, so concurrent forwards share nothing mutable.
    """

    __slots__ = ("s", "state", "_ctype", "_cache_free", "_free")

    def __init__(self, cls, s):
        self.s = s
        self._ctype = cls._c_cache
        self._cache_free = cls._c_cache_free
        self._free = cls._c_free
        self.state = _State(self._drop)

    def new_cache(self):
        return ffi.new(self._ctype)

    def _drop(self, entry):
        self._cache_free(entry[1])

    def enter(self):
        """The struct, counted as in flight (call state.leave() after); ClosedError if closed."""
        st = self.state
        with st.lock:
            s = self.s
            if s is not None:
                st.busy += 1
                return s
        return None

    def clear_cache(self):
        self.state.clear()

    def free(self):
        """Make the layer unusable, wait for the calls in flight, then free its C side."""
        with self.state.lock:
            s, self.s = self.s, None
        self.state.wait_idle()
        self.state.clear()
        if s is not None:
            self._free(s)
