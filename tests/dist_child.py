"""One rank of tests/test_distributed.py's NCCL check, started by utensil_ffi.launch: collective
results against the values every rank can compute by hand, SyncBatchNorm and 20 data-parallel
training steps against one GPU on the whole batch (which every rank also computes). Argument:
"env" (NCCL_COMM_ID bootstrap) or a rendezvous file path; or "hang"/"exit": rank 1 stops
taking part (sleeps, or leaves) and rank 0 must get DistributedError within the group's
timeout. Writes ok<rank> when every check passed."""

import os
import sys
import time

import numpy as np

import utensil_ffi as ut
from utensil_ffi import distributed as D

env = D.env_from_environ()
W, r = env.world_size, env.rank

if sys.argv[1] in ("hang", "exit"):
    pg = D.ProcessGroup(env, timeout=5)
    pg.barrier()
    if r == 1:
        if sys.argv[1] == "exit":
            os._exit(0)
        time.sleep(25)
        sys.exit(0)
    t = ut.ones((1 << 20,), "cuda")
    t0 = time.monotonic()
    try:
        for _ in range(3):
            pg.all_reduce(t)
            pg.wait()
        raise SystemExit("no error without the peer")
    except D.DistributedError as e:
        took = time.monotonic() - t0
        assert took < 5 + 3, took
        open("ok0", "w").write("%.1f s: %s" % (took, e))
    sys.exit(0)


def whole_batch_reference(data, make):
    """One process, one GPU, the whole batch: the losses of plain SGD steps."""
    model = make()
    opt = ut.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, y in data:
        logits = model(ut.tensor(x, "cuda"))
        losses.append(float(ut.cross_entropy(logits, y).numpy()[0]))
        opt.zero_grad()
        model.backward(ut.cross_entropy_backward(logits, y))
        opt.step()
    return losses


how = None if sys.argv[1] == "env" else sys.argv[1]
with D.ProcessGroup(env, rendezvous=how) as pg:
    t = ut.tensor(np.full(1000, r + 1, np.float32), "cuda")
    pg.all_reduce(t)  # the mean of 1..W
    np.testing.assert_allclose(t.numpy(), (W + 1) / 2)
    s = ut.tensor(np.arange(10, dtype=np.float32) * (r + 1), "cuda")
    pg.all_reduce(s, "sum")
    np.testing.assert_allclose(s.numpy(), np.arange(10) * W * (W + 1) / 2)
    src = W - 1
    b = ut.tensor(np.full(5, 10.0 * r, np.float32), "cuda")
    pg.broadcast(b, src=src)
    np.testing.assert_array_equal(b.numpy(), 10.0 * src)
    # gradients of differently seeded models, packed, averaged once, unpacked
    ut.seed(r)
    net = ut.Linear(3, 4, device="cuda")
    for p in net.parameters():
        p.grad.copy_from(np.full(p.shape, float(r), np.float32))
    with D.GradientBuffer(net.parameters()) as buf:
        pg.all_reduce(buf.pack())
        buf.unpack()
    for p in net.parameters():
        np.testing.assert_allclose(p.grad.numpy(), (W - 1) / 2)
    # data-parallel steps: ranks start from rank 0's weights and stay identical
    ut.seed(100 + r)
    model = ut.Sequential(ut.Conv2d(1, 4, 3, padding=1, device="cuda"),
                          ut.BatchNorm2d(4, activation="relu6", device="cuda"),
                          ut.GlobalAvgPool2d(), ut.Linear(4, 3, device="cuda"))
    with D.DistributedDataParallel(model, pg) as ddp:
        opt = ut.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        rng = np.random.default_rng(r)  # each rank its own data
        for _ in range(3):
            x = ut.tensor(rng.standard_normal((4, 1, 6, 6)).astype(np.float32), "cuda")
            logits = ddp(x)
            opt.zero_grad()
            ddp.backward(ut.cross_entropy_backward(logits, rng.integers(0, 3, 4)))
            opt.step()
        for p in ddp.parameters():
            mine = p.numpy().copy()
            avg = pg.all_reduce(ut.tensor(mine, "cuda")).numpy()
            np.testing.assert_allclose(avg, mine, rtol=1e-6, atol=1e-7)
    # SyncBatchNorm + DDP, 20 steps on a global batch split over the ranks: the losses of one
    # GPU on the whole batch (ranks start from rank 0's weights: the reference seeds alike)
    def make():
        ut.seed(7)
        return ut.Sequential(ut.Conv2d(3, 8, 3, stride=2, padding=1, bias=False, device="cuda"),
                             ut.BatchNorm2d(8, activation="relu6", device="cuda"),
                             ut.DWConv2d(8, 3, padding=1, bias=False, device="cuda"),
                             ut.BatchNorm2d(8, device="cuda"), ut.ReLU6(),
                             ut.GlobalAvgPool2d(), ut.Linear(8, 5, device="cuda"))

    b = 4
    rng = np.random.default_rng(0)  # the same data on every rank
    data = [(rng.standard_normal((W * b, 3, 10, 10)).astype(np.float32),
             rng.integers(0, 5, W * b)) for _ in range(20)]
    want = whole_batch_reference(data, make)
    model = ut.SyncBatchNorm.convert_sync_batchnorm(make(), pg)
    got = []
    with D.DistributedDataParallel(model, pg) as ddp:
        opt = ut.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        for x, y in data:
            part = slice(r * b, (r + 1) * b)
            logits = ddp(ut.tensor(x[part], "cuda"))
            loss = float(ut.cross_entropy(logits, y[part]).numpy()[0])
            got.append(float(pg.all_reduce_floats([loss], "avg")[0]))
            opt.zero_grad()
            ddp.backward(ut.cross_entropy_backward(logits, y[part]))
            opt.step()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    pg.barrier()
open("ok%d" % r, "w").write("ok")
