"""The parts of data-parallel training that need no GPU: the launcher, the environment, the file
rendezvous, the sampler. References: hand-built environments, real processes and files, and
PyTorch's DistributedSampler where torch is installed.
"""

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from utensil_ffi import distributed as D
from utensil_ffi._errors import ArgumentError, DistributedError

from thread_group import run_ranks

GOOD = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.5",
        "MASTER_PORT": "29500"}


# -- the environment --------------------------------------------------------------------------------
def test_env_from_torchrun_variables():
    e = D.env_from_environ(dict(GOOD, TORCHELASTIC_RUN_ID="abc"))
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.master_port, e.run_id) == \
        (1, 4, 1, "10.0.0.5", 29500, "abc")
    assert not e.is_main and D.env_from_environ(dict(GOOD, RANK="0")).is_main


@pytest.mark.parametrize("change, pattern", [
    ({"RANK": None, "MASTER_PORT": None}, "missing RANK, MASTER_PORT"),
    ({"WORLD_SIZE": ""}, "missing WORLD_SIZE"),
    ({"RANK": "4"}, r"RANK=4 is out of range: it must be in \[0, 3\]"),
    ({"RANK": "-1"}, "RANK=-1 is out of range"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 is out of range"),
    ({"LOCAL_RANK": "x"}, "LOCAL_RANK='x' is not an integer"),
    ({"MASTER_PORT": "65535"}, "MASTER_PORT=65535 is out of range"),
    ({"LOCAL_WORLD_SIZE": "1"}, "LOCAL_RANK=1 is not below LOCAL_WORLD_SIZE=1"),
])
def test_inconsistent_environments_are_named(change, pattern):
    env = dict(GOOD)
    for k, v in change.items():
        if v is None:
            env.pop(k)
        else:
            env[k] = v
    with pytest.raises(DistributedError, match=pattern):
        D.env_from_environ(env)


def test_env_from_mpi_takes_a_communicator():
    class Comm:
        def Get_rank(self):
            return 2

        def Get_size(self):
            return 3

    e = D.env_from_mpi(Comm())
    assert (e.rank, e.world_size, e.local_rank) == (2, 3, 2)


# -- the file rendezvous ------------------------------------------------------------------------------
def _meet(path, world, payload=b"\x01id\xff" * 32, run_id="r1", timeout=10.0, ranks=None):
    out, errs = {}, {}

    def one(rank):
        rv = D.FileRendezvous(path, rank, world, timeout=timeout, run_id=run_id)
        try:
            out[rank] = rv.exchange(payload if rank == 0 else None)
        except Exception as e:  # noqa: BLE001 - collected for the assertions
            errs[rank] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in (ranks or range(world))]
    for t in threads[::-1]:  # the waiters first: they must wait, not read a missing file
        t.start()
        time.sleep(0.01)
    for t in threads:
        t.join(30)
    return out, errs


def test_rendezvous_gives_every_rank_rank0s_payload(tmp_path):
    payload = bytes(range(128))
    out, errs = _meet(str(tmp_path / "rv"), 4, payload)
    assert not errs and out == {r: payload for r in range(4)}
    doc = json.loads((tmp_path / "rv").read_text())
    assert doc["world_size"] == 4 and bytes.fromhex(doc["payload"]) == payload
    assert not list(tmp_path.glob("rv.tmp*"))  # written whole, then renamed


def test_rendezvous_ignores_an_earlier_runs_files(tmp_path):
    path = str(tmp_path / "rv")
    _meet(path, 2, b"old", run_id="run-a")
    out, errs = _meet(path, 2, b"new", run_id="run-b", ranks=[1, 0])
    assert not errs and out == {0: b"new", 1: b"new"}


def test_rendezvous_refuses_a_duplicate_rank(tmp_path):
    path = str(tmp_path / "rv")
    D.FileRendezvous(path, 1, 2, run_id="r")._claim_rank()
    with pytest.raises(DistributedError, match="rank 1 of run 'r' is claimed twice"):
        D.FileRendezvous(path, 1, 2, run_id="r").exchange()


def test_rendezvous_refuses_a_world_size_mismatch(tmp_path):
    path = str(tmp_path / "rv")
    D.FileRendezvous(path, 0, 2, run_id="r").exchange(b"x")
    with pytest.raises(DistributedError, match="WORLD_SIZE=3 but rank 0 published 2"):
        D.FileRendezvous(path, 1, 3, run_id="r").exchange()


def test_rendezvous_times_out_with_a_reason(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(DistributedError, match="waited 0 s for rank 0"):
        D.FileRendezvous(str(tmp_path / "rv"), 1, 2, timeout=0.2, run_id="r").exchange()
    assert time.monotonic() - t0 < 5


def test_rendezvous_argument_checks(tmp_path):
    with pytest.raises(ArgumentError, match="rank must be in"):
        D.FileRendezvous(str(tmp_path / "rv"), 2, 2)
    with pytest.raises(ArgumentError, match="payload as bytes"):
        D.FileRendezvous(str(tmp_path / "rv"), 0, 1, run_id="r").exchange("text")
    with pytest.raises(ArgumentError, match="timeout must be positive"):
        D.FileRendezvous(str(tmp_path / "rv"), 0, 1, timeout=0)


# -- the sampler ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, world", [(10, 3), (12, 4), (3, 5), (1, 2), (0, 2), (17, 1)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_shards_are_disjoint_and_cover(n, world, drop_last):
    for epoch in (0, 1):
        shards = []
        for r in range(world):
            s = D.DistributedSampler(n, world, r, shuffle=True, seed=7, drop_last=drop_last)
            s.set_epoch(epoch)
            shards.append(list(s))
            assert len(shards[-1]) == len(s)
        lens = {len(x) for x in shards}
        assert len(lens) == 1  # equal length on every rank: no rank waits at the end
        flat = [i for sh in shards for i in sh]
        if drop_last:
            assert len(flat) == len(set(flat)) == (n // world) * world
        else:
            assert set(flat) == set(range(n))
            assert len(flat) == -(-n // world) * world if n else len(flat) == 0


def test_sampler_order_is_the_same_on_every_rank_and_moves_with_the_epoch():
    a = D.DistributedSampler(100, 4, 0, seed=3)
    b = D.DistributedSampler(100, 4, 3, seed=3)
    assert np.array_equal(a.global_order(), b.global_order())
    first = a.global_order().copy()
    a.set_epoch(1)
    assert not np.array_equal(a.global_order(), first)
    assert sorted(a.global_order().tolist()) == list(range(100))
    c = D.DistributedSampler(100, 4, 0, seed=4)
    assert not np.array_equal(c.global_order(), first)


@pytest.mark.parametrize("n, world, drop_last", [(10, 3, False), (10, 3, True), (2, 4, False),
                                                 (9, 3, False)])
def test_sampler_matches_pytorch_without_shuffle(n, world, drop_last):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DistributedSampler as TorchSampler

    for r in range(world):
        ours = list(D.DistributedSampler(n, world, r, shuffle=False, drop_last=drop_last))
        theirs = list(TorchSampler(range(n), num_replicas=world, rank=r, shuffle=False,
                                   drop_last=drop_last))
        assert ours == theirs, (r, ours, theirs)
    del torch


# -- the launcher -------------------------------------------------------------------------------------
def _launch(tmp_path, body, n=2, extra=(), timeout=60):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    cmd = [sys.executable, "-m", "utensil_ffi.launch", "--nproc-per-node", str(n), "--grace", "2",
           *extra, str(script)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)


def test_launcher_gives_each_process_its_rank(tmp_path):
    r = _launch(tmp_path, """
        import json, os
        from utensil_ffi.distributed import env_from_environ
        e = env_from_environ()
        json.dump(dict(os.environ, PID=os.getpid()), open("env%d.json" % e.rank, "w"))
    """, n=3)
    assert r.returncode == 0, r.stderr
    envs = [json.loads((tmp_path / ("env%d.json" % i)).read_text()) for i in range(3)]
    assert [e["RANK"] for e in envs] == ["0", "1", "2"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2"]
    assert {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert len({e["MASTER_PORT"] for e in envs}) == 1
    assert len({e["UTENSIL_RUN_ID"] for e in envs}) == 1
    assert len({e["PID"] for e in envs}) == 3
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    want = [visible[i % len(visible)] if visible else str(i) for i in range(3)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == want  # one GPU per process


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open("/proc/%d/stat" % pid) as f:  # a zombie is dead too
        return f.read().split()[2] != "Z"


def test_a_failing_rank_stops_the_others(tmp_path):
    t0 = time.monotonic()
    r = _launch(tmp_path, """
        import os, subprocess, sys, time
        rank = int(os.environ["RANK"])
        if rank == 1:  # fails once rank 0 and its child are up
            for _ in range(600):
                if os.path.exists("pids"):
                    break
                time.sleep(0.05)
            sys.exit(3)
        # rank 0 hangs, with a child of its own: both must be stopped
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        open("pids.tmp", "w").write("%d %d" % (os.getpid(), child.pid))
        os.replace("pids.tmp", "pids")
        time.sleep(120)
    """)
    assert r.returncode == 3
    assert "rank 1 exited with code 3; stopping the 1 still running" in r.stderr
    assert time.monotonic() - t0 < 30
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), "orphans left behind"


def test_launcher_refuses_bad_arguments(tmp_path):
    (tmp_path / "ok.py").write_text("")
    r = _launch(tmp_path, "", n=0)
    assert r.returncode == 2 and "--nproc-per-node must be at least 1" in r.stderr
    r = subprocess.run([sys.executable, "-m", "utensil_ffi.launch", "--nproc-per-node", "1",
                        str(tmp_path / "missing.py")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no such script" in r.stderr


def test_free_port_leaves_its_successor_free():
    import socket

    from utensil_ffi.launch import free_port

    p = free_port()
    for q in (p, p + 1):
        with socket.socket() as s:
            s.bind(("127.0.0.1", q))


def _start_sleepers(tmp_path):
    """The launcher over 2 ranks that write their pids and sleep; returns it once both run."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os, time
        open("pid%s" % os.environ["RANK"], "w").write(str(os.getpid()))
        time.sleep(120)
    """))
    p = subprocess.Popen([sys.executable, "-m", "utensil_ffi.launch", "--nproc-per-node", "2",
                          "--grace", "2", str(script)], cwd=tmp_path, stderr=subprocess.PIPE,
                         text=True)
    deadline = time.monotonic() + 30
    while not all((tmp_path / ("pid%d" % r)).exists() for r in (0, 1)):
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.05)
    time.sleep(0.1)
    return p, [int((tmp_path / ("pid%d" % r)).read_text()) for r in (0, 1)]


def _all_gone(pids, within=5.0):
    deadline = time.monotonic() + within
    while any(_alive(q) for q in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(_alive(q) for q in pids)


@pytest.mark.parametrize("signame", ["SIGHUP", "SIGQUIT"])
def test_a_closed_terminal_stops_every_rank(tmp_path, signame):
    """SIGHUP (terminal closed, ssh dropped) and SIGQUIT killed the launcher alone and left the
    ranks running under PID 1, holding GPUs and ports."""
    import signal

    sig = getattr(signal, signame)
    p, pids = _start_sleepers(tmp_path)
    p.send_signal(sig)
    assert p.wait(timeout=30) == 128 + sig
    assert "interrupted; stopping 2 processes" in p.stderr.read()
    assert _all_gone(pids)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_ranks_end_when_the_launcher_is_killed_outright(tmp_path):
    """SIGKILL cannot be handled: the parent-death signal ends each rank."""
    import signal

    p, pids = _start_sleepers(tmp_path)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    p.stderr.close()
    assert _all_gone(pids)


def test_interrupting_the_launcher_stops_every_rank(tmp_path):
    import signal

    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os, time
        open("pid%s" % os.environ["RANK"], "w").write(str(os.getpid()))
        time.sleep(120)
    """))
    p = subprocess.Popen([sys.executable, "-m", "utensil_ffi.launch", "--nproc-per-node", "2",
                          "--grace", "2", str(script)], cwd=tmp_path, stderr=subprocess.PIPE,
                         text=True)
    deadline = time.monotonic() + 30
    while not all((tmp_path / ("pid%d" % r)).exists() for r in (0, 1)):
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.05)
    time.sleep(0.1)
    p.send_signal(signal.SIGINT)
    assert p.wait(timeout=30) == 128 + signal.SIGINT
    assert "interrupted; stopping 2 processes" in p.stderr.read()
    pids = [int((tmp_path / ("pid%d" % r)).read_text()) for r in (0, 1)]
    deadline = time.monotonic() + 5
    while any(_alive(q) for q in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(q) for q in pids)


# -- the gradient buffer ---------------------------------------------------------------------------------
def test_gradient_buffer_packs_and_unpacks_in_parameter_order(device):
    import utensil_ffi as ut

    net = ut.Sequential(ut.Conv2d(2, 3, 3, device=device), ut.BatchNorm2d(3, device=device),
                        ut.Linear(4, 5, device=device))
    params = list(net.parameters())
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal(p.shape).astype(np.float32) for p in params]
    for p, g in zip(params, grads):
        p.grad.copy_from(g)
    with D.GradientBuffer(params) as buf:
        assert buf.numel == sum(g.size for g in grads)
        flat = buf.pack().numpy()
        np.testing.assert_array_equal(flat, np.concatenate([g.ravel() for g in grads]))
        new = rng.standard_normal(buf.numel).astype(np.float32)
        buf.flat.copy_from(new)
        buf.unpack()
        off = 0
        for p, g in zip(params, grads):
            np.testing.assert_array_equal(p.grad.numpy().ravel(), new[off:off + g.size])
            off += g.size
    net.close()


def test_pack_refuses_mismatched_sizes_and_devices():
    import utensil_ffi as ut
    from utensil_ffi import functional as F

    a, b = ut.zeros((3,)), ut.zeros((2, 2))
    with pytest.raises(ut.ShapeError, match="the 2 tensors hold 7 elements, flat holds 6"):
        F.pack(ut.zeros((6,)), [a, b])
    with pytest.raises(ut.ArgumentError, match="must be different tensors"):
        F.unpack(a, [a])
    with pytest.raises(ut.ArgumentTypeError, match=r"tensors\[1\] must be a Tensor"):
        F.pack(ut.zeros((3,)), [a, np.zeros(2)])
    with pytest.raises(ut.ArgumentError, match="no parameters"):
        D.GradientBuffer([])


# -- NCCL on several GPUs (UTENSIL_TEST_NCCL=1 where there are two or more; .ci/gpu sets it) ---------
needs_gpus = pytest.mark.skipif(os.environ.get("UTENSIL_TEST_NCCL") != "1",
                                reason="needs 2 GPUs and NCCL (UTENSIL_TEST_NCCL=1)")


@needs_gpus
@pytest.mark.parametrize("how", ["env", "file"])
def test_nccl_collectives_on_two_gpus(tmp_path, how):
    child = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_child.py")
    arg = "env" if how == "env" else str(tmp_path / "rendezvous")
    n = int(os.environ.get("UTENSIL_TEST_NCCL_PROCS", "2"))  # 1: a one-GPU smoke test
    r = subprocess.run([sys.executable, "-m", "utensil_ffi.launch", "--nproc-per-node", str(n),
                        child, arg], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert all((tmp_path / ("ok%d" % i)).exists() for i in range(n))


@needs_gpus
@pytest.mark.parametrize("how", ["hang", "exit"])
def test_a_hung_or_dead_peer_is_an_error_within_the_timeout(tmp_path, how):
    child = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_child.py")
    r = subprocess.run([sys.executable, "-m", "utensil_ffi.launch", "--nproc-per-node", "2",
                        child, how], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    said = (tmp_path / "ok0").read_text()
    assert "rank 0" in said, said
    print(said)


def test_without_nccl_the_group_says_why(tmp_path):
    # UTENSIL_NCCL_LIB set and empty: no NCCL; on a CPU-only machine there is no GPU either
    code = ("import os; os.environ['UTENSIL_NCCL_LIB'] = ''\n"
            "from utensil_ffi import distributed as D\n"
            "env = D.DistEnv(0, 1, 0, '127.0.0.1', 29500)\n"
            "try:\n    D.ProcessGroup(env)\nexcept Exception as e:\n"
            "    print(type(e).__name__, e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("DeviceError"), r.stdout
    assert "no CUDA device" in r.stdout or "NCCL not loaded" in r.stdout, r.stdout


# -- data-parallel training, on a group of threads ---------------------------------------------------------
def _small_net(seed):
    import utensil_ffi as ut

    ut.seed(seed)
    return ut.Sequential(ut.Conv2d(1, 4, 3, padding=1), ut.ReLU(), ut.DWConv2d(4, 3, padding=1),
                         ut.GlobalAvgPool2d(), ut.Linear(4, 3))


def test_ddp_ranks_start_alike_and_match_one_process_on_the_whole_batch():
    import utensil_ffi as ut

    world, steps, b = 2, 3, 4
    rng = np.random.default_rng(5)
    data = [(rng.standard_normal((world * b, 1, 6, 6)).astype(np.float32),
             rng.integers(0, 3, world * b)) for _ in range(steps)]
    # the reference: one process, rank 0's initial weights, the whole batch, mean loss
    ref = _small_net(10)
    opt = ut.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        logits = ref(ut.tensor(x))
        opt.zero_grad()
        ref.backward(ut.cross_entropy_backward(logits, y))
        opt.step()
    want = [p.numpy().copy() for p in ref.parameters()]

    nets = [_small_net(10 + r) for r in range(world)]  # different weights: the broadcast aligns

    def rank_main(r, group):
        with D.DistributedDataParallel(nets[r], group) as ddp:
            opt = ut.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
            sampler = D.DistributedSampler(world * b, world, r, shuffle=False)
            for x, y in data:
                idx = sampler.indices()
                logits = ddp(ut.tensor(x[idx]))
                opt.zero_grad()
                ddp.backward(ut.cross_entropy_backward(logits, y[idx]))
                opt.step()
            return [p.numpy().copy() for p in ddp.parameters()]

    got = run_ranks(world, rank_main)
    for r in range(world):
        for a, w in zip(got[r], want):
            np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("broadcast", [True, False])
def test_ddp_broadcasts_buffers_in_training(broadcast):
    # first forward: each rank's own batch moves its running statistics; second forward: the
    # same batch on both. Broadcast first, both end equal; without it they keep differing.
    import utensil_ffi as ut

    nets = []
    for r in range(2):
        ut.seed(r)
        nets.append(ut.Sequential(ut.Conv2d(1, 2, 1), ut.BatchNorm2d(2)))

    def rank_main(r, group):
        with D.DistributedDataParallel(nets[r], group, broadcast) as ddp:
            own = np.arange(18, dtype=np.float32).reshape(2, 1, 3, 3) * (r + 1)
            ddp(ut.tensor(own))
            ddp(ut.tensor(np.linspace(-1, 1, 18, dtype=np.float32).reshape(2, 1, 3, 3)))
            return np.concatenate([b.numpy().ravel() for b in nets[r].buffers()])

    seen = run_ranks(2, rank_main)
    assert set(seen) == {0, 1}
    assert np.allclose(seen[0], seen[1], rtol=1e-6) == broadcast
