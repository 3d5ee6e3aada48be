"""Data-parallel scaling on the GPUs of one machine: utensil's DistributedDataParallel against
one GPU and against PyTorch's DistributedDataParallel, same network, batch and precision.

    python bench/bench_ddp.py [--gpus 2] [--size 224] [--batch 128] [--steps 20]
        [--sync-bn] [--torch fp32,bf16]

MobileNet v1 (1000 classes, width 1.0, fused BatchNorm+ReLU6), SGD with momentum, random images
made on each GPU (the loader is not measured), ``--batch`` images per GPU. Each configuration
runs as its own job under ``python -m utensil_ffi.distributed.launch`` (one process per GPU,
NCCL; PyTorch joins through the same torchrun environment with ``init_process_group("nccl")``);
rank 0 reports the global images/s of the timed steps after a warm-up. Prints utensil on 1 and
N GPUs, the scaling (N GPUs / 1 GPU), and utensil / PyTorch DDP in each PyTorch mode:
  fp32  NCHW, TF32 off: the same arithmetic as utensil at "highest"
  bf16  channels_last, bf16 autocast: what a PyTorch user picks for speed (less precise)
Needs NCCL (the nvidia-nccl-cu13 wheel or the system's) and ``--gpus`` GPUs.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__" and __package__ in (None, ""):
    sys.path.insert(0, ROOT)


def _utensil_rank(a):
    import utensil_ffi as ut
    from utensil_ffi import distributed as D
    from utensil_ffi.nn import models

    from bench.bench_networks import utensil_step

    env = D.env_from_environ()
    pg = D.ProcessGroup(env)
    ut.seed(0)
    net = models.mobilenet_v1(device="cuda", fused=True)
    if a.sync_bn:
        ut.SyncBatchNorm.convert_sync_batchnorm(net, pg)
    rng = np.random.default_rng(env.rank)
    x = ut.tensor(rng.standard_normal((a.batch, 3, a.size, a.size)).astype(np.float32), "cuda")
    y = ut.tensor(rng.integers(0, 1000, a.batch).astype(np.float32), "cuda")
    with D.DistributedDataParallel(net, pg, broadcast_buffers=not a.sync_bn) as ddp:
        opt = ut.SGD(ddp.parameters(), lr=0.01, momentum=0.9)

        for _ in range(a.warmup):
            utensil_step(ddp, opt, x, y)
        pg.barrier()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            utensil_step(ddp, opt, x, y)
        pg.wait()
        secs = time.perf_counter() - t0
    pg.barrier()
    pg.close()
    return env.rank, env.world_size, secs


def _torch_rank(a, mode):
    import torch
    import torch.distributed as dist

    from bench.compare_mobilenet import to_torch
    from utensil_ffi.nn import models

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(0)  # the launcher shows each process its own GPU
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    net = to_torch(models.mobilenet_v1(device="cpu")).cuda()
    fmt = torch.channels_last if mode == "bf16" else torch.contiguous_format
    net = net.to(memory_format=fmt)
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randn(a.batch, 3, a.size, a.size, device="cuda", generator=g)
    x = x.contiguous(memory_format=fmt)
    y = torch.randint(0, 1000, (a.batch,), device="cuda", generator=g)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "bf16"):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    dist.barrier()
    dist.destroy_process_group()
    return rank, world, secs


def _child(a):
    rank, world, secs = _utensil_rank(a) if a.child == "utensil" else _torch_rank(a, a.child)
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"img_s": world * a.batch * a.steps / secs, "world": world}, f)


def _job(a, side, gpus):
    """Global images/s of one configuration, run under the launcher (None if it failed)."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        cmd = [sys.executable, "-m", "utensil_ffi.distributed.launch",
               "--nproc-per-node", str(gpus), os.path.abspath(__file__), "--child", side,
               "--out", out, "--size", str(a.size), "--batch", str(a.batch),
               "--steps", str(a.steps), "--warmup", str(a.warmup)]
        if a.sync_bn:
            cmd.append("--sync-bn")
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.setdefault("NCCL_NVLS_ENABLE", "0")
        r = subprocess.run(cmd, env=env, cwd=ROOT)
        if r.returncode != 0 or not os.path.exists(out):
            print("  %s on %d GPU(s) failed (exit %d)" % (side, gpus, r.returncode))
            return None
        with open(out) as f:
            return json.load(f)["img_s"]


def main(argv=None):
    p = argparse.ArgumentParser(prog="python bench/bench_ddp.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch", type=int, default=128, help="images per GPU")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--sync-bn", action="store_true", help="utensil with SyncBatchNorm")
    p.add_argument("--torch", default="fp32", help="PyTorch DDP modes: fp32,bf16 or none")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        return _child(a)
    print("MobileNet v1 %d^2, batch %d per GPU, SGD momentum, fp32 (utensil at highest)%s"
          % (a.size, a.batch, ", SyncBatchNorm" if a.sync_bn else ""))
    one = _job(a, "utensil", 1)
    many = _job(a, "utensil", a.gpus) if a.gpus > 1 else one
    print("utensil  1 GPU  %9.1f img/s" % (one or float("nan")))
    print("utensil  %d GPUs %9.1f img/s   scaling %.2fx" % (
        a.gpus, many or float("nan"), (many / one) if one and many else float("nan")))
    for mode in [m for m in a.torch.split(",") if m and m != "none"]:
        t = _job(a, mode, a.gpus)
        print("torch DDP %-5s %d GPUs %9.1f img/s   utensil/torch %.2fx" % (
            mode, a.gpus, t or float("nan"), (many / t) if t and many else float("nan")))


if __name__ == "__main__":
    sys.exit(main())
