"""Recorded GPU work (ut.cuda.CUDAGraph): a replay computes what the eager calls compute, the
recording's rules fail loudly, and the graph's memory never lands under another tensor.

The references are the same steps run eagerly on a deep copy of the same model (same kernels,
same order), and numpy for the elementwise cases. On a machine without a GPU only the refusals
run; UTENSIL_EXPECT_CUDA=1 turns a missing GPU into a failure (tests/test_cuda.py).
"""

import copy
import os
import threading

import numpy as np
import pytest

import utensil_ffi as ut

EXPECT = os.environ.get("UTENSIL_EXPECT_CUDA") == "1"
HAVE = "cuda" in ut.devices()
needs_gpu = pytest.mark.skipif(not HAVE and not EXPECT, reason="no cuda device")


@pytest.mark.skipif(HAVE, reason="a GPU is present")
def test_recording_without_a_gpu_is_a_clear_error():
    g = ut.cuda.CUDAGraph()
    with pytest.raises(ut.DeviceError, match="no CUDA device"):
        g.capture_begin()
    with pytest.raises(ut.DeviceError, match="no CUDA device"):
        with ut.cuda.graph(ut.cuda.CUDAGraph()):
            pass


def test_misuse_is_refused_without_touching_the_device():
    g = ut.cuda.CUDAGraph()
    with pytest.raises(ut.ClosedError, match="nothing recorded"):
        g.replay()
    with pytest.raises(ut.ClosedError, match="no recording was begun"):
        g.capture_end()
    with pytest.raises(TypeError, match="CUDAGraph"):
        ut.cuda.graph(object())
    g.close()
    g.close()  # idempotent
    assert "empty" in repr(g)


def _net():
    ut.seed(3)
    return ut.Sequential(
        ut.Conv2d(2, 8, 3, padding=1, device="cuda"),
        ut.BatchNorm2d(8, activation="relu6", device="cuda"),
        ut.DWConv2d(8, 3, padding=1, device="cuda"),
        ut.ReLU6(),
        ut.Conv2d(8, 16, 1, device="cuda"),
        ut.BatchNorm2d(16, device="cuda"),
        ut.ReLU(),
        ut.GlobalAvgPool2d(),
        ut.Linear(16, 5, device="cuda"),
    )


def _step(net, opt, x, y):
    opt.zero_grad()
    logits = net(x)
    loss = ut.cross_entropy(logits, y)
    net.backward(ut.cross_entropy_backward(logits, y)).close()
    opt.step()
    return loss


def _batches(n, rng):
    return [(rng.standard_normal((4, 2, 6, 6)).astype(np.float32),
             rng.integers(0, 5, 4).astype(np.float32)) for _ in range(n)]


@needs_gpu
def test_replayed_training_step_matches_eager_steps():
    rng = np.random.default_rng(0)
    batches = _batches(5, rng)
    eager = _net()
    rec = copy.deepcopy(eager)
    opt_e = ut.SGD(eager.parameters(), lr=0.05, momentum=0.9)
    opt_r = ut.SGD(rec.parameters(), lr=0.05, momentum=0.9)
    want = []
    for x, y in batches:
        want.append(_step(eager, opt_e, ut.tensor(x, "cuda"), ut.tensor(y, "cuda")).item())

    sx, sy = ut.tensor(batches[0][0], "cuda"), ut.tensor(batches[0][1], "cuda")
    got = [_step(rec, opt_r, sx, sy).item()]  # the step once, eagerly, before recording
    g = ut.cuda.CUDAGraph()
    with ut.cuda.graph(g):
        loss = _step(rec, opt_r, sx, sy)
    assert g.recorded
    for x, y in batches[1:]:
        sx.copy_from(x)
        sy.copy_from(y)
        g.replay()
        got.append(loss.item())
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(rec.named_parameters(), eager.parameters()):
        np.testing.assert_allclose(p.numpy(), q.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
    for (name, b), c in zip(rec.named_buffers(), eager.buffers()):
        if b.dtype == np.float32:
            np.testing.assert_allclose(b, c, rtol=1e-5, atol=1e-6, err_msg=name)
    g.close()
    # after the graph is gone the model trains eagerly as before
    assert np.isfinite(_step(rec, opt_r, sx, sy).item())


@needs_gpu
def test_replay_reads_inputs_written_on_the_host_and_marks_outputs():
    x = ut.tensor(np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4), "cuda")
    ut.relu(x).close()
    with ut.cuda.CUDAGraph() as g:
        with ut.cuda.graph(g):
            y = ut.relu6(ut.relu(x))
        for scale in (3.0, -1.0, 10.0):
            new = (np.arange(12, dtype=np.float32).reshape(3, 4) - 5) * scale
            x.copy_from(new)
            g.replay()
            np.testing.assert_array_equal(y.numpy(), np.clip(new, 0, 6))


@needs_gpu
def test_recorded_temporaries_never_land_under_other_tensors():
    # temporaries born and freed inside the recording keep their device blocks for the graph: an
    # eager tensor allocated afterwards must not share one, or a replay would overwrite it
    x = ut.tensor(np.ones((64, 64), np.float32), "cuda")
    ut.relu(ut.relu6(x)).close()
    g = ut.cuda.CUDAGraph()
    with ut.cuda.graph(g):
        t1 = ut.relu(x)
        t2 = ut.relu6(t1)
        t1.close()
        y = ut.relu(t2)
        t2.close()
    keep = [ut.tensor(np.full((64, 64), 7.0, np.float32), "cuda") for _ in range(8)]
    live = ut.live_tensors()
    for _ in range(3):
        g.replay()
    for k in keep:
        np.testing.assert_array_equal(k.numpy(), 7.0)
    np.testing.assert_array_equal(y.numpy(), 1.0)
    g.close()
    assert ut.live_tensors() <= live  # the graph's own references are gone


@pytest.mark.skipif(HAVE, reason="a GPU is present")
def test_the_cache_calls_without_a_gpu():
    assert ut.cuda.cached_bytes() == 0
    assert ut.cuda.empty_cache() is None
    with pytest.raises(ut.DeviceError, match="no CUDA device"):
        ut.cuda.mem_get_info()


@needs_gpu
def test_empty_cache_hands_back_freed_blocks_while_graphs_live():
    # the shared cache holds no block a live graph uses, so it can be emptied while graphs live
    # (two recorded steps in one process used to keep every freed block cached until both died)
    x = ut.tensor(np.ones((64, 64), np.float32), "cuda")
    ut.relu(ut.relu6(x)).close()
    g = ut.cuda.CUDAGraph()
    with ut.cuda.graph(g):
        t1 = ut.relu6(x)   # a temporary the graph owns: freed, it stays with the graph
        y = ut.relu(t1)
        t1.close()
    big = ut.zeros((4, 1 << 20), "cuda")  # 16 MB, then cached on close
    big.close()
    assert ut.cuda.cached_bytes() >= 16 << 20
    free, total = ut.cuda.mem_get_info()
    assert 0 < free <= total
    ut.cuda.empty_cache()
    assert ut.cuda.cached_bytes() == 0
    keep = [ut.tensor(np.full((64, 64), 7.0, np.float32), "cuda") for _ in range(4)]
    for v in (3.0, 9.0, -2.0):
        x.copy_from(np.full((64, 64), v, np.float32))
        g.replay()
        np.testing.assert_array_equal(y.numpy(), np.clip(v, 0, 6))
    for k in keep:
        np.testing.assert_array_equal(k.numpy(), 7.0)
    g.close()
    ut.cuda.empty_cache()  # the graph's own blocks, back in the cache when it was freed
    assert ut.cuda.cached_bytes() == 0


@needs_gpu
def test_a_replay_after_its_tensors_left_the_gpu_is_refused():
    # moved to the CPU, a layer's weight gives its device block back (and the cache may give it
    # to the driver): replaying would write memory the graph no longer owns
    layer = ut.Linear(8, 4, device="cuda")
    x = ut.tensor(np.ones((2, 8), np.float32), "cuda")
    layer(x).close()
    with ut.cuda.CUDAGraph() as g:
        with ut.cuda.graph(g):
            y = layer(x)
        g.replay()
        want = x.numpy() @ layer.weight.numpy().T + layer.bias.numpy()
        np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-6)
        layer.to("cpu")
        ut.cuda.empty_cache()
        with pytest.raises(ut.ArgumentError, match="left its device memory"):
            g.replay()


@needs_gpu
def test_recording_refuses_host_reads_uploads_and_waits():
    x = ut.tensor(np.ones((4, 4), np.float32), "cuda")
    ut.relu(x).close()
    for body, pattern in (
        (lambda: ut.relu(x).numpy(), "reading a GPU tensor"),
        (lambda: ut.relu(ut.tensor(np.ones((2, 2), np.float32), "cuda")), "uploading"),
        (ut.synchronize, "while a CUDA graph is recorded"),
        (ut.cuda.empty_cache, "while a CUDA graph is recorded"),
    ):
        g = ut.cuda.CUDAGraph()
        with pytest.raises(ut.ArgumentError, match=pattern):
            with ut.cuda.graph(g):
                body()
        assert not g.recorded
        # the library works eagerly again
        np.testing.assert_array_equal(ut.relu(x).numpy(), 1.0)


@needs_gpu
def test_other_threads_are_refused_while_recording():
    x = ut.tensor(np.ones((4, 4), np.float32), "cuda")
    ut.relu(x).close()
    seen = []

    def other():
        try:
            ut.relu(x)
        except ut.ArgumentError as e:
            seen.append(str(e))

    g = ut.cuda.CUDAGraph()
    with ut.cuda.graph(g):
        y = ut.relu(x)
        th = threading.Thread(target=other)
        th.start()
        th.join()
    assert seen and "another thread is recording" in seen[0]
    g.replay()
    np.testing.assert_array_equal(y.numpy(), 1.0)
    g.close()


@needs_gpu
def test_one_recording_at_a_time_and_cpu_work_runs_at_once():
    x = ut.tensor(np.ones(4, np.float32), "cuda")
    ut.relu(x).close()
    g = ut.cuda.CUDAGraph()
    with ut.cuda.graph(g):
        with pytest.raises(ut.ArgumentError, match="one at a time"):
            ut.cuda.CUDAGraph().capture_begin()
        c = ut.relu(ut.tensor(np.array([-1.0, 2.0], np.float32)))  # CPU: computed now
        np.testing.assert_array_equal(c.numpy(), [0.0, 2.0])
        ut.relu(x).close()
    with pytest.raises(ut.ClosedError, match="holds a recording"):
        g.capture_begin()
    g.close()


@needs_gpu
def test_closing_a_graph_while_recording_another_waits_for_the_end():
    x = ut.tensor(np.arange(6, dtype=np.float32) - 3, "cuda")
    ut.relu(x).close()
    first = ut.cuda.CUDAGraph()
    with ut.cuda.graph(first):
        y1 = ut.relu(x)
    second = ut.cuda.CUDAGraph()
    with ut.cuda.graph(second):
        y2 = ut.relu6(x)
        first.close()  # freeing waits for the device, which a recording forbids: done at the end
    assert not first.recorded
    second.replay()
    np.testing.assert_array_equal(y2.numpy(), np.clip(np.arange(6) - 3, 0, 6))
    second.close()
    y1.close()


@needs_gpu
def test_fills_from_other_threads_are_refused_while_recording():
    # zero_grad (fill_many) and fill write without reading: they pass the same gate
    from utensil_ffi import functional as F

    x = ut.tensor(np.ones(8, np.float32), "cuda")
    ut.relu(x).close()
    seen = []

    def other():
        for call in (lambda: F.fill_many([x], 0.0), lambda: lib_fill(x)):
            try:
                call()
            except ut.ArgumentError as e:
                seen.append(str(e))

    def lib_fill(t):
        from utensil_ffi._errors import check_status
        from utensil_ffi._lib import lib

        check_status(lib.ut_fill(t.ptr, 0.0), "fill")

    g = ut.cuda.CUDAGraph()
    with ut.cuda.graph(g):
        y = ut.relu(x)
        th = threading.Thread(target=other)
        th.start()
        th.join()
    assert len(seen) == 2 and all("another thread is recording" in m for m in seen), seen
    g.replay()
    np.testing.assert_array_equal(x.numpy(), 1.0)  # nothing zeroed it
    np.testing.assert_array_equal(y.numpy(), 1.0)
    g.close()


@needs_gpu
def test_recorded_dropout_draws_a_new_mask_at_each_replay():
    """The mask is drawn on the device from a counter the draws advance there: replays continue
    the eager sequence of the same seed (a mask uploaded from the host would repeat)."""
    x = ut.tensor(np.ones((64, 100), np.float32), "cuda")
    ut.seed(7)
    d = ut.Dropout(0.5)
    want = []
    for _ in range(3):
        with d(x) as y:
            want.append(y.numpy().copy())
    assert not np.array_equal(want[0], want[1]) and not np.array_equal(want[1], want[2])
    for m in want:  # each a fresh Bernoulli(1/2) mask, scaled by 2
        assert set(np.unique(m)) <= {0.0, 2.0} and 0.4 < (m == 0).mean() < 0.6

    ut.seed(7)
    with d(x) as y:  # eagerly: the seed's first draw
        got = [y.numpy().copy()]
    with ut.cuda.CUDAGraph() as g:
        with ut.cuda.graph(g):
            y = d(x)
        for _ in range(2):
            g.replay()
            got.append(y.numpy().copy())
        y.close()
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    d.close()
    x.close()
