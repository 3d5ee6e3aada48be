"""utensil-train on several processes, the parts a CPU can check: the flags, the environment,
and one epoch of ranks (threads, tests/thread_group.py) that must train exactly as one process
on the whole batch, shares of unequal size included. The NCCL run itself: .ci/gpu on two GPUs
(tests/test_distributed.py's two-GPU checks) and the closing notes' commands."""

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi.nn import models
from utensil_ffi import train as tr
from utensil_ffi import train_dist as td
from utensil_ffi.optim import SGD

from thread_group import run_ranks


def test_flag_is_stripped_for_the_copies():
    argv = ["--epochs", "3", "--nproc-per-node", "2", "--lr", "0.1", "--nproc-per-node=4"]
    assert td.strip_nproc_flag(argv) == ["--epochs", "3", "--lr", "0.1"]



@pytest.mark.parametrize("spelling", [["--nproc", "2"], ["--npr=2"], ["--nproc-per", "2"]])
def test_every_spelling_argparse_accepts_is_stripped(spelling):
    """argparse takes '--nproc 2' for --nproc-per-node; each copy got it unstripped and refused
    ("started by a launcher already")."""
    from utensil_ffi.train import build_parser

    argv = ["--epochs", "3"] + spelling + ["--lr", "0.1"]
    assert build_parser().parse_args(argv).nproc_per_node == 2  # argparse does accept it
    stripped = td.strip_nproc_flag(argv)
    assert stripped == ["--epochs", "3", "--lr", "0.1"]
    assert build_parser().parse_args(stripped).nproc_per_node is None


def test_launched_world_size_reads_the_launchers_variables():
    assert td.launched_world_size({}) == 0
    assert td.launched_world_size({"WORLD_SIZE": "2"}) == 0  # no RANK: not a launched copy
    assert td.launched_world_size({"WORLD_SIZE": "2", "RANK": "1"}) == 2


@pytest.mark.parametrize("visible, local, want", [
    (None, 1, "1"), ("3,5,7", 1, "5"), ("6", 0, "6"), ("GPU-a,GPU-b", 1, "GPU-b")])
def test_each_copy_sees_its_own_gpu(visible, local, want):
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    td.bind_local_gpu(local, env)
    assert env["CUDA_VISIBLE_DEVICES"] == want


@pytest.mark.parametrize("argv, pattern", [
    (["--nproc-per-node", "2", "--device", "cpu"], "several processes train on GPUs"),
    (["--nproc-per-node", "0"], "expected a positive integer"),
])
def test_bad_nproc_flags(argv, pattern, capsys):
    with pytest.raises(SystemExit) as e:
        tr.main(argv + ["--no-checkpoint"])
    assert e.value.code == 2
    assert pattern in capsys.readouterr().err


def test_without_a_gpu_the_flag_is_refused_once_up_front(monkeypatch, capsys):
    """It printed a raw C-level error from each rank and exited 1."""
    monkeypatch.setattr(tr, "cuda_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        tr.main(["--nproc-per-node", "2", "--no-checkpoint"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("no CUDA GPU is available") == 1 and "--nproc-per-node 2" in err


def test_under_a_launcher_the_flag_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit):
        tr.main(["--nproc-per-node", "2", "--no-checkpoint"])
    assert "started by a launcher already" in capsys.readouterr().err


def test_a_batch_too_small_to_share_is_refused_up_front():
    d = td.Dist(None, 0, 4)
    assert d.check_batches(100, 10) is None  # last batch: 0 left over
    assert "--batch-size holds 3 images" in d.check_batches(100, 3)
    assert "the last batch of an epoch holds 2" in d.check_batches(102, 10)



def test_a_last_batch_that_batches_drops_is_not_refused():
    """65 images, batch 64, 2 ranks: the last batch of one image is dropped by data.batches, so
    no rank gets an empty share; check_batches refused it."""
    from utensil_ffi.data import batches

    d = td.Dist(None, 0, 2)
    assert [len(b) for b in batches(65, 64, 0, 0)] == [64]
    assert d.check_batches(65, 64) is None
    assert "the last batch of an epoch holds 1" not in (d.check_batches(66, 65) or "")
    assert [len(b) for b in batches(67, 64, 0, 0)] == [64, 3]
    assert d.check_batches(67, 64) is None
    assert "the last batch of an epoch holds 2" in td.Dist(None, 0, 4).check_batches(66, 64)


def test_ranks_train_one_epoch_as_one_process(tmp_path):
    # 3 ranks, batch 10 (shares 4/3/3) and a last batch of 7 (3/2/2), SyncBatchNorm: the
    # weights, the mean loss and the evaluation of one process on the whole batch
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (47, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 4, 47)
    xt, yt = x[:13], y[:13]

    def make():
        ut.seed(3)
        net = models.mobilenet(1, 4, 4, device="cpu")
        return net, SGD(net.parameters(), lr=0.1, momentum=0.9)

    net, opt = make()
    want_loss, want_n, _ = tr.train_epoch(net, opt, x, y, 10, 5, 0, "cpu")
    want_eval = tr.evaluate(net, xt, yt, 5, "cpu")
    want = [p.numpy().copy() for p in net.parameters()]

    made = [make() for _ in range(3)]  # here: the library's RNG is one for all threads

    def rank_main(r, group):
        net, opt = made[r]
        dist = td.Dist(group, r, 3)
        with dist.wrap(net) as model:
            loss, n, _ = tr.train_epoch(model, opt, x, y, 10, 5, 0, "cpu", dist=dist)
            ev = tr.evaluate(model, xt, yt, 5, "cpu", dist)
        return loss, n, ev, [p.numpy().copy() for p in net.parameters()]

    got = run_ranks(3, rank_main, timeout=120)
    for r in range(3):
        loss, n, ev, params = got[r]
        assert n == want_n == 47
        assert loss == pytest.approx(want_loss, rel=1e-4)
        assert ev[0] == pytest.approx(want_eval[0], rel=1e-4)
        assert ev[1] == pytest.approx(want_eval[1])
        for a, w in zip(params, want):
            np.testing.assert_allclose(a, w, rtol=1e-3, atol=1e-4)
