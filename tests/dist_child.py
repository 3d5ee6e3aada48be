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
    pg.barrier()
open("ok%d" % r, "w").write("ok")
