"""utensil_ffi.loader.Loader: the order of utensil-train's in-memory batches, bitwise the same
batches for any number of workers and either hand-over (copies or views of the workers' shared
memory), errors from workers, and no process or shared-memory segment left behind however an
epoch ends. Worker tests use 2 spawned workers (about a second to start) and tiny data."""

import gc
import multiprocessing as mp
import os
import signal
import threading
import time

import numpy as np
import pytest

from utensil_ffi import data, images
from utensil_ffi import transforms as T
from utensil_ffi.data import DataError
from utensil_ffi.loader import Loader, LoaderError, load_batch


class Samples:
    """n samples [2, 3, 3]: value i plus noise from the sample's rng; label i % 3. ``fail_at``
    raises a DataError naming a file, ``die_at`` ends the worker process, ``sleep`` slows each."""

    def __init__(self, n, fail_at=None, die_at=None, kill_at=None, sleep=0.0):
        self.n, self.fail_at, self.die_at, self.kill_at = n, fail_at, die_at, kill_at
        self.sleep = sleep

    def __len__(self):
        return self.n

    def load(self, i, rng):
        if i == self.fail_at:
            raise DataError("/data/broken-%d.png: cannot decode this image" % i)
        if i == self.die_at:
            os._exit(7)
        if i == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.sleep:
            time.sleep(self.sleep)
        return np.full((2, 3, 3), i, np.float32) + rng.random((2, 3, 3), np.float32), i % 3


class FailIn(Samples):
    """Samples whose sample ``index`` fails (``how``: "raise" a DataError, "die") in epoch
    ``epoch`` only: the sample's rng tells the epoch (it is seeded with (seed, epoch, index))."""

    def __init__(self, n, seed, epoch, index, how="raise"):
        super().__init__(n)
        self.state = np.random.default_rng((seed, epoch, index)).bit_generator.state
        self.index, self.how = index, how

    def load(self, i, rng):
        if i == self.index and rng.bit_generator.state == self.state:
            if self.how == "die":
                os._exit(7)
            raise DataError("/data/broken-%d.png: cannot decode this image" % i)
        return super().load(i, rng)


class Fixed(Samples):
    """Samples that draw nothing (``random`` false): in order, every epoch has the same batches."""

    random = False

    def load(self, i, rng):
        assert rng is None
        return np.full((2, 3, 3), i, np.float32), i % 3


class Env:
    """What a worker sees: its CUDA_VISIBLE_DEVICES as the label (1: hidden)."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return np.zeros((1, 1, 1), np.float32), int(os.environ.get("CUDA_VISIBLE_DEVICES") == "")


def _segments(pid=None):
    """The shared-memory segments of the loaders of process ``pid`` (this one) in /dev/shm:
    shm_ring names them utensil_<pid in hex>_..."""
    if not os.path.isdir("/dev/shm"):
        return []
    prefix = "utensil_%x_" % (os.getpid() if pid is None else pid)
    return [f for f in os.listdir("/dev/shm") if f.startswith(prefix)]


def _gone(pids):
    assert pids, "the test meant to start workers"
    alive = [p.pid for p in mp.active_children() if p.pid in pids]
    assert not alive, "worker processes still running: %s" % alive
    for pid in pids:
        with pytest.raises(ProcessLookupError):  # reaped too, not a zombie
            os.kill(pid, 0)
    assert not _segments(), "shared memory left behind"


def _same(a, b):
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert xa.dtype == np.float32 and ya.dtype == np.int64
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)


# -- order (no workers) --------------------------------------------------------------------------
@pytest.mark.parametrize("n,bs", [(10, 3), (9, 4), (7, 7), (1, 4)])
def test_order_is_data_batches(n, bs):
    ds = Samples(n)
    loader = Loader(ds, bs, seed=5)
    for epoch in (0, 3):
        want = data.batches(n, bs, 5, epoch)
        got = list(loader.epoch(epoch))
        assert len(got) == len(want) == len(loader)
        for (x, y), idx in zip(got, want):
            assert x.shape == (len(idx), 2, 3, 3) and x.flags.c_contiguous
            np.testing.assert_array_equal(np.floor(x[:, 0, 0, 0]), idx)
            np.testing.assert_array_equal(y, idx % 3)
            ref = load_batch(ds, idx, 5, epoch)[0]
            np.testing.assert_array_equal(x, ref)
    loader.set_epoch(3)
    _same(list(loader), list(loader.epoch(3)))


def test_indices_drop_last_and_sequential():
    ds = Samples(20)
    sub = np.array([3, 9, 4, 15, 11, 0, 7])
    loader = Loader(ds, 3, seed=1, indices=sub)
    assert [b.tolist() for b in loader.batch_indices(2)] == [
        sub[b].tolist() for b in data.batches(7, 3, 1, 2)]
    for (x, _), idx in zip(loader.epoch(2), loader.batch_indices(2)):
        np.testing.assert_array_equal(np.floor(x[:, 0, 0, 0]), idx)
    assert [len(b) for b in Loader(ds, 6, drop_last=True).batch_indices(0)] == [6, 6, 6]
    seq = Loader(ds, 6, shuffle=False)  # evaluation: every sample, in order, short last batch
    assert [b.tolist() for b in seq.batch_indices(4)] == [
        list(range(0, 6)), list(range(6, 12)), list(range(12, 18)), [18, 19]]
    assert len(seq) == 4 and [len(y) for _, y in seq] == [6, 6, 6, 2]
    assert len(Loader(Samples(7), 3, shuffle=False)) == 3  # a single last sample is kept
    halves = Loader(ds, 4, share=lambda b: b[::2])
    for (x, _), idx in zip(halves.epoch(1), halves.batch_indices(1)):
        np.testing.assert_array_equal(np.floor(x[:, 0, 0, 0]), idx[::2])
    second_halves = Loader(Samples(5), 4, shuffle=False, share=lambda b: b[2:])
    with pytest.raises(ValueError, match="batch 1 of epoch 0 \\(1 samples\\) empty"):
        list(second_halves.epoch(0))


def test_arguments_are_checked():
    ds = Samples(5)
    for kw, match in ((dict(batch_size=0), "batch_size"), (dict(workers=-1), "workers"),
                      (dict(prefetch=0), "prefetch"), (dict(seed=-1), "seed"),
                      (dict(timeout=0), "timeout"), (dict(start_method="fork"), "fork"),
                      (dict(indices=[[1]]), "1-D")):
        args = dict(batch_size=2)
        args.update(kw)
        with pytest.raises(ValueError, match=match):
            Loader(ds, **args)
    with pytest.raises(IndexError, match=r"\[0, 5\)"):
        Loader(ds, 2, indices=[0, 5])
    with pytest.raises(DataError, match="no samples"):
        Loader(ds, 2, indices=[])
    with pytest.raises(TypeError, match="len"):
        Loader(object(), 2)


def test_batch_of_mixed_shapes_names_both_samples(tmp_path):
    from PIL import Image

    for c, size in (("a", (6, 6)), ("b", (6, 8))):
        os.makedirs(tmp_path / c)
        Image.new("RGB", size).save(str(tmp_path / c / "x.png"))
    ds = images.ImageFolder(tmp_path)
    with pytest.raises(DataError, match="differ in shape") as e:
        list(Loader(ds, 2, shuffle=False))
    assert "a/x.png" in str(e.value) and "b/x.png" in str(e.value) and "CenterCrop" in str(e.value)


def test_abandoned_epoch_iterator_raises():
    loader = Loader(Samples(8), 2)
    first = loader.epoch(0)
    next(first)
    second = loader.epoch(1)
    next(second)
    with pytest.raises(RuntimeError, match="abandoned"):
        next(first)
    assert len(list(second)) == 3
    third = loader.epoch(2)
    next(third)
    loader.close()
    with pytest.raises(ValueError, match="close"):
        loader.epoch(0)
    with pytest.raises(ValueError, match="close"):
        next(third)


# -- workers -------------------------------------------------------------------------------------
def test_workers_give_bitwise_the_same_batches(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in ("a", "b", "c"):
        os.makedirs(tmp_path / c)
        for i in range(7):
            Image.fromarray(rng.integers(0, 256, (14, 12, 3), dtype=np.uint8)).save(
                str(tmp_path / c / ("%d.png" % i)))
    aug = T.Compose([T.RandomResizedCrop(8), T.RandomHorizontalFlip(), T.ToArray(),
                     T.Normalize((0.5, 0.5, 0.5), (0.2, 0.2, 0.2))])
    ds = images.ImageFolder(tmp_path, transform=aug)
    train, _ = images.stratified_split(ds.targets, 0.2, seed=0)
    ref = Loader(ds, 4, seed=3, indices=train)
    want = [list(ref.epoch(e)) for e in (0, 1)]
    assert not np.array_equal(want[0][0][0], want[1][0][0])  # epochs differ (order and crops)
    with Loader(ds, 4, seed=3, indices=train, workers=2, prefetch=1) as loader:
        for e in (0, 1):  # the same workers serve both epochs
            _same(list(loader.epoch(e)), want[e])
        pids = loader.worker_pids()
        assert len(pids) == 2
        loader.set_epoch(1)
        _same(list(loader), want[1])
        assert loader.worker_pids() == pids
    _gone(pids)
    with Loader(Env(), 2, workers=2) as loader:  # workers hide the GPUs from themselves
        assert [y.tolist() for _, y in loader.epoch(0)] == [[1, 1], [1, 1]]


def test_worker_error_is_reraised_naming_the_file():
    loader = Loader(Samples(12, fail_at=9), 3, workers=2, shuffle=False)
    it = loader.epoch(0)
    got = [next(it) for _ in range(3)]
    pids = loader.worker_pids()
    with pytest.raises(DataError, match="/data/broken-9.png: cannot decode") as e:
        next(it)
    assert "in the loader worker" in str(e.value.__cause__)
    assert "raise DataError" in str(e.value.__cause__)  # the worker's traceback
    assert len(got) == 3
    _gone(pids)  # an epoch ended by an error stops its workers
    loader.close()


@pytest.mark.parametrize("kw,match", [(dict(die_at=5), "exited with status 7"),
                                      (dict(kill_at=5), "killed by SIGKILL")])
def test_dead_worker_is_an_error_not_a_hang(kw, match):
    # prefetch=1: worker 0 gets batch 2 (samples 4, 5) only after it has sent batch 0, and with
    # a slot of the shared memory made when batch 0 came
    loader = Loader(Samples(12, **kw), 2, workers=2, shuffle=False, prefetch=1)
    it = loader.epoch(0)
    next(it)
    pids = loader.worker_pids()
    assert _segments() or not os.path.isdir("/dev/shm")
    with pytest.raises(LoaderError, match=match) as e:
        list(it)
    assert "worker 0 (pid %d)" % pids[0] in str(e.value)
    assert "before sending batch 2 of epoch 0" in str(e.value)
    _gone(pids)


def test_timeout():
    loader = Loader(Samples(4, sleep=3.0), 2, workers=2, timeout=0.3)
    it = loader.epoch(0)
    with pytest.raises(LoaderError, match="sent nothing for 0.3 s"):
        next(it)
    assert loader.worker_pids() == []


def test_unpicklable_data_set():
    ds = images.ImageFolder.__new__(images.ImageFolder)  # no scan needed: it never gets there
    ds.samples, ds.transform = [("x.png", 0)] * 4, T.Lambda(lambda img: img)
    with pytest.raises(TypeError, match="picklable"):
        list(Loader(ds, 2, workers=1))
    assert not mp.active_children()


# -- the hand-over through shared memory ---------------------------------------------------------
def _own(batches):
    """Copies of a copy=False epoch's views, each taken before the next batch is asked for."""
    return [(x.copy(), y.copy()) for x, y in batches]


@pytest.mark.parametrize("copy", [True, False])
@pytest.mark.parametrize("n,bs,workers,prefetch,shuffle", [
    (23, 4, 2, 2, True),  # a short last batch of 3
    (21, 4, 3, 1, False),  # a single last sample
    (16, 4, 1, 3, True),
])
def test_shared_memory_batches_are_bitwise_those_of_workers_0(n, bs, workers, prefetch,
                                                              shuffle, copy):
    ds = Samples(n)
    ref = Loader(ds, bs, seed=2, shuffle=shuffle)
    want = [list(ref.epoch(e)) for e in (0, 1)]
    with Loader(ds, bs, seed=2, shuffle=shuffle, workers=workers, prefetch=prefetch,
                copy=copy) as loader:
        for e in (0, 1):
            got = loader.epoch(e)
            _same(list(got) if copy else _own(got), want[e])
            if e == 0:  # only the batches sent before the first came back used the pipe
                assert loader._pool.piped <= workers * prefetch
        assert loader._pool.piped <= workers * prefetch  # epoch 1: none
        assert len(_segments()) == 1 or not os.path.isdir("/dev/shm")
        halves = loader.batch_indices(1)
    with Loader(ds, bs, seed=2, shuffle=shuffle, workers=workers, prefetch=prefetch, copy=copy,
                share=lambda b: b[::2]) as loader:  # a rank's share: fewer rows than a slot
        got = loader.epoch(1)
        for (x, y), idx in zip(list(got) if copy else _own(got), halves):
            ref_x, ref_y = load_batch(ds, idx[::2], 2, 1)
            np.testing.assert_array_equal(x, ref_x)
            np.testing.assert_array_equal(y, ref_y)
    assert not _segments()


def test_held_copies_survive_slot_reuse_and_views_do_not_copy():
    # one worker, prefetch 1: a ring of one slot, which every batch after the first reuses
    ds = Samples(12)
    want = list(Loader(ds, 2, seed=1).epoch(0))
    with Loader(ds, 2, seed=1, workers=1, prefetch=1) as loader:
        held = list(loader.epoch(0))  # the safe default: each batch the consumer's own
        _same(held, want)
        assert loader._pool.piped == 1
    with Loader(ds, 2, seed=1, workers=1, prefetch=1, copy=False) as loader:
        it = loader.epoch(0)
        for k in range(2):
            x, y = next(it)
            _same([(x, y)], [want[k]])  # valid until the next batch is asked for
        x2, _ = next(it)
        x3, _ = next(it)
        assert np.shares_memory(x2, x3)  # batches 2 and 3 lie in the one slot: no copy
        np.testing.assert_array_equal(x2, want[3][0])  # so the older view shows the newer


def test_a_view_outlives_close_and_its_segment():
    ds = Samples(12)
    want = list(Loader(ds, 4, seed=0).epoch(0))
    loader = Loader(ds, 4, seed=0, workers=2, copy=False)
    it = loader.epoch(0)
    next(it)
    x, y = next(it)
    assert len(_segments()) == 1 or not os.path.isdir("/dev/shm")
    pids = loader.worker_pids()
    loader.close()
    _gone(pids)  # the name is gone at once...
    _same([(x, y)], [want[1]])  # ...the memory only with the last view over it
    del x, y, it
    gc.collect()


class Sizes:
    """Samples 0-3 are [1, 2, 2], the rest [1, 3, 3]: batches of two shapes (no resize)."""

    def __len__(self):
        return 10

    def __getitem__(self, i):
        side = 2 if i < 4 else 3
        return np.full((1, side, side), i, np.float32), i


def test_batches_that_do_not_fit_the_slots_come_through_the_pipe():
    want = list(Loader(Sizes(), 2, shuffle=False).epoch(0))
    with Loader(Sizes(), 2, shuffle=False, workers=2, prefetch=1, copy=False) as loader:
        _same(_own(loader.epoch(0)), want)
        # the ring is sized by batch 0 ([1, 2, 2]); batches 2-4 ([1, 3, 3]) do not fit it
        assert loader._pool.piped == 2 + 3


def test_no_room_in_shared_memory_falls_back_to_pipes(monkeypatch):
    from utensil_ffi import loader as loader_module

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(loader_module, "Ring", full)
    ds = Samples(10)
    want = list(Loader(ds, 2, seed=4).epoch(0))
    with Loader(ds, 2, seed=4, workers=2) as loader:
        with pytest.warns(RuntimeWarning, match="No space left"):
            _same(list(loader.epoch(0)), want)
        assert loader._pool.piped == 5 and not _segments()


def test_the_trainers_folder_feed_keeps_its_workers_and_equals_workers_0(tmp_path):
    from PIL import Image

    from utensil_ffi.train_data import open_data

    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        os.makedirs(tmp_path / c)
        for i in range(12):
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(
                str(tmp_path / c / ("%d.png" % i)))
    ref, feed = open_data(str(tmp_path)), open_data(str(tmp_path), workers=2)
    try:
        pids = None
        for e in (0, 1):
            want = [(w, x.copy(), y.copy()) for w, x, y in ref.train_batches(5, 3, e)]
            got = [(w, x.copy(), y.copy()) for w, x, y in feed.train_batches(5, 3, e)]
            assert [w for w, _, _ in got] == [w for w, _, _ in want]
            _same([b[1:] for b in got], [b[1:] for b in want])
            loader = feed._loaders[("train", 5, 3)]
            assert loader.copy is False  # the trainer uploads each batch at once
            if pids is None:
                pids = loader.worker_pids()
            assert loader.worker_pids() == pids and len(pids) == 2  # not restarted per epoch
        for _ in range(2):  # the second evaluation finds its first batches loaded ahead
            _same([(x.copy(), y.copy()) for x, y in feed.test_batches(4)],
                  list(ref.test_batches(4)))
            assert feed._loaders[("test", 4, 0)]._ahead.sent > 0
    finally:
        ref.close()
        feed.close()
    _gone(pids)


# -- the next epoch's first batches, loaded ahead -----------------------------------------------
def _free_slots(loader):
    return len(loader._pool.ring._free)


@pytest.mark.parametrize("copy", [True, False])
@pytest.mark.parametrize("n,bs,workers,prefetch,shuffle", [
    (23, 4, 2, 2, True),  # 6 batches, 4 in flight: most of the next epoch's come ahead
    (9, 4, 3, 2, True),  # 3 batches, 6 in flight: all of the next epoch's come ahead
    (21, 4, 2, 1, False),
])
def test_consecutive_epochs_are_bitwise_those_of_workers_0(n, bs, workers, prefetch, shuffle,
                                                           copy):
    ds = Samples(n)
    ref = Loader(ds, bs, seed=2, shuffle=shuffle)
    epochs = range(4)
    want = [list(ref.epoch(e)) for e in epochs]
    depth = workers * prefetch
    with Loader(ds, bs, seed=2, shuffle=shuffle, workers=workers, prefetch=prefetch,
                copy=copy) as loader:
        for e in epochs:
            got = loader.epoch(e)
            _same(list(got) if copy else _own(got), want[e])
            # the window runs on into epoch e + 1: its first batches are in flight
            ahead = loader._ahead
            assert ahead is not None and ahead.epoch == e + 1
            assert ahead.sent == min(depth, len(loader))
            assert [(ep, k) for _, ep, k, _ in loader._pool.pending] == [
                (e + 1, k) for k in range(ahead.sent)]
            # every slot free but those of the batches in flight (epoch 0's first batches go
            # through the pipes, without one: the ring is made when the first comes back)
            in_slots = [slot for _, _, _, slot in loader._pool.pending if slot is not None]
            assert len(in_slots) == (ahead.sent if e > 0 else len(in_slots))
            assert _free_slots(loader) == depth - len(in_slots)
        pids = loader.worker_pids()
    _gone(pids)


def test_the_next_epochs_first_batch_is_ready_when_asked_for():
    # each batch takes a worker 0.6 s: without loading ahead, epoch 1's first batch would too
    ds = Samples(8, sleep=0.3)
    want = list(Loader(ds, 2, seed=1).epoch(1))
    with Loader(ds, 2, seed=1, workers=2, prefetch=1) as loader:
        list(loader.epoch(0))
        time.sleep(1.5)  # the consumer's work between epochs (evaluation, say)
        t0 = time.monotonic()
        it = loader.epoch(1)
        first = next(it)
        waited = time.monotonic() - t0
        _same([first] + list(it), want)
    assert waited < 0.3, waited


def test_an_epoch_other_than_the_next_discards_the_batches_loaded_ahead():
    ds = Samples(23)
    ref = Loader(ds, 4, seed=2)
    with Loader(ds, 4, seed=2, workers=2, prefetch=2) as loader:
        list(loader.epoch(0))
        assert loader._ahead.epoch == 1 and loader._ahead.sent == 4
        pids = loader.worker_pids()
        for e in (2, 3, 0, 0):  # a jump, the next (loaded ahead), back, the same again
            _same(list(loader.epoch(e)), list(ref.epoch(e)))
            assert loader._ahead.epoch == e + 1 and _free_slots(loader) == 0
        assert loader.worker_pids() == pids  # dropped, not restarted
        assert loader._pool.piped <= 4  # epoch 0's first batches only: no slot was lost
        loader.set_epoch(7)
        _same(list(loader), list(ref.epoch(7)))


def test_break_after_the_next_epoch_was_started_stops_the_workers():
    ds = Samples(23)
    ref = Loader(ds, 4, seed=2)
    loader = Loader(ds, 4, seed=2, workers=2, prefetch=2)
    list(loader.epoch(0))
    it = loader.epoch(1)
    for k, _ in enumerate(it):
        if k == 4:  # the last batch but one: epoch 2's first batches are in flight
            assert loader._ahead.epoch == 2 and loader._ahead.sent > 0
            break
    pids = loader.worker_pids()
    del it
    gc.collect()
    _gone(pids)  # an interrupted epoch stops the workers, with what they held ahead
    assert loader._ahead is None
    _same(list(loader.epoch(2)), list(ref.epoch(2)))  # new workers, the right batches
    loader.close()


def test_close_while_the_next_epoch_is_loading_leaves_nothing_behind():
    loader = Loader(Samples(12, sleep=0.2), 2, workers=2, prefetch=2)
    list(loader.epoch(0))
    assert loader._ahead.sent == 4  # the workers are busy with epoch 1 now
    pids = loader.worker_pids()
    t0 = time.monotonic()
    loader.close()
    assert time.monotonic() - t0 < 3.0
    _gone(pids)  # no process, no zombie, no /dev/shm segment
    with pytest.raises(ValueError, match="close"):
        loader.epoch(1)


def test_same_batches_every_epoch_are_loaded_ahead_for_any_epoch():
    # in order, drawing nothing (an evaluation): the batches ahead serve whichever epoch comes
    ds = Fixed(10)
    want = list(Loader(ds, 3, shuffle=False).epoch(0))
    with Loader(ds, 3, shuffle=False, workers=2, prefetch=1) as loader:
        for e in (0, 0, 5, 0):
            _same(list(loader.epoch(e)), want)
            assert loader._ahead.epoch == 0 and loader._ahead.sent == 2
        assert loader._pool.piped <= 2


def test_an_error_in_a_batch_loaded_ahead_is_raised_only_if_its_epoch_is_asked_for():
    seed, bs = 4, 3
    first = data.batches(15, bs, seed, 1)[0]  # epoch 1's first batch: loaded ahead
    ds = FailIn(15, seed, 1, int(first[1]))
    ref = Loader(ds, bs, seed=seed)
    with pytest.raises(DataError, match="broken-%d.png" % first[1]):
        list(ref.epoch(1))
    with Loader(ds, bs, seed=seed, workers=2, prefetch=2) as loader:
        _same(list(loader.epoch(0)), list(ref.epoch(0)))  # not raised here...
        assert loader._ahead.epoch == 1 and loader._ahead.sent == 4
        pids = loader.worker_pids()
        _same(list(loader.epoch(2)), list(ref.epoch(2)))  # ...nor here: epoch 1 was skipped
        assert loader.worker_pids() == pids
        list(loader.epoch(0))  # epoch 1 loaded ahead again
        with pytest.raises(DataError, match="broken-%d.png: cannot decode" % first[1]) as e:
            next(loader.epoch(1))  # asked for: raised as itself, at its batch
        assert "raise DataError" in str(e.value.__cause__)  # with the worker's traceback
    _gone(pids)


def test_a_worker_that_dies_loading_ahead_fails_only_the_epoch_it_was_loading():
    seed, bs = 4, 3
    first = data.batches(15, bs, seed, 1)[0]
    ds = FailIn(15, seed, 1, int(first[0]), how="die")
    ref = Loader(ds, bs, seed=seed)
    with Loader(ds, bs, seed=seed, workers=2, prefetch=2) as loader:
        list(loader.epoch(0))
        pids = loader.worker_pids()
        _same(list(loader.epoch(2)), list(ref.epoch(2)))  # dropping epoch 1 meets the death
        assert set(loader.worker_pids()).isdisjoint(pids)  # and starts new workers
        assert not [p.pid for p in mp.active_children() if p.pid in pids]
        assert len(_segments()) == 1 or not os.path.isdir("/dev/shm")  # the new workers' only
        list(loader.epoch(0))
        pids = loader.worker_pids()
        with pytest.raises(LoaderError, match="exited with status 7 .* before sending batch 0 "
                                              "of epoch 1"):
            list(loader.epoch(1))
    _gone(pids)


# -- shutdown ------------------------------------------------------------------------------------
def _started(loader):
    it = loader.epoch(0)
    next(it)
    pids = loader.worker_pids()
    assert len(pids) == 2
    assert len(_segments()) == 1 or not os.path.isdir("/dev/shm")  # made with the first batch
    return it, pids


def test_close_with_and_collection_stop_workers():
    loader = Loader(Samples(40), 2, workers=2)
    it, pids = _started(loader)
    loader.close()
    loader.close()  # idempotent
    _gone(pids)
    with pytest.raises(ValueError, match="close"):
        next(it)

    with Loader(Samples(40), 2, workers=2) as loader:
        it, pids = _started(loader)
    _gone(pids)

    loader = Loader(Samples(40), 2, workers=2)
    for _ in loader.epoch(0):
        break  # an unfinished epoch stops its workers as soon as its iterator goes
    assert loader.worker_pids() == []
    list(loader.epoch(1))  # a finished epoch keeps them for the next...
    pids = loader.worker_pids()
    del loader
    gc.collect()  # ...until the loader is collected
    _gone(pids)


@pytest.mark.parametrize("exc", [ValueError, KeyboardInterrupt])
def test_exception_in_the_consumer_loop_stops_workers(exc):
    loader = Loader(Samples(40), 2, workers=2)
    pids = []
    with pytest.raises(exc):
        for i, (x, y) in enumerate(loader):
            pids = loader.worker_pids()
            if i == 2:
                raise exc("stop")
    _gone(pids)
    assert len(list(loader.epoch(0))) == 20  # the loader still works afterwards
    loader.close()


def test_ctrl_c_while_waiting_for_a_worker():
    loader = Loader(Samples(8, sleep=0.4), 2, workers=2)
    it, pids = _started(loader)
    timer = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            list(it)
    finally:
        timer.cancel()
    assert time.monotonic() - t0 < 5.0
    _gone(pids)
    loader.close()


# -- a real terminal's Ctrl-C, and a parent killed outright ---------------------------------------
SCRIPT = """
import sys, time
import numpy as np
from utensil_ffi.loader import Loader

class Slow:
    def __len__(self):
        return 100000

    def load(self, i, rng):
        time.sleep(0.005)
        return np.zeros((1, 2, 2), np.float32), 0

if __name__ == "__main__":
    loader = Loader(Slow(), 4, workers=2)
    for k, (x, y) in enumerate(loader):
        if k == 0:
            print("PIDS", *loader.worker_pids(), flush=True)
"""


def _running(pid):
    """Alive and not a zombie (an orphan's zombie waits for a reaper this test does not own)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
@pytest.mark.parametrize("how", ["ctrl-c", "sigkill"])
def test_no_worker_outlives_its_parent(tmp_path, how):
    import subprocess
    import sys

    path = tmp_path / "loop.py"
    path.write_text(SCRIPT)
    # a session of its own: the group's Ctrl-C reaches the parent and its workers, as a terminal's
    proc = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("PIDS"), (line, proc.stderr.read() if proc.poll() else "")
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 2 and all(_running(p) for p in pids)
        assert _segments(proc.pid) or not os.path.isdir("/dev/shm")
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.kill()
        _, err = proc.communicate(timeout=20)
        deadline = time.monotonic() + 10
        while any(_running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in pids if _running(p)], err
        # the shared memory goes too: unlinked by the parent on Ctrl-C, by multiprocessing's
        # resource tracker (when the workers have gone) after SIGKILL
        while _segments(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _segments(proc.pid), err
        if how == "ctrl-c":  # the parent's KeyboardInterrupt, none from the workers
            assert err.count("KeyboardInterrupt") == 1, err
            assert "leaked" not in err, err  # it unlinked the segment itself
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
