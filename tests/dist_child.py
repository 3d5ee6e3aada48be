"""One rank of tests/test_distributed.py's NCCL check, started by utensil_ffi.launch: collective
results against the values every rank can compute by hand. Argument: "env" (NCCL_COMM_ID
bootstrap) or a rendezvous file path. Writes ok<rank> when every check passed."""

import sys

import numpy as np

import utensil_ffi as ut
from utensil_ffi import distributed as D

env = D.env_from_environ()
W, r = env.world_size, env.rank
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
    pg.barrier()
open("ok%d" % r, "w").write("ok")
