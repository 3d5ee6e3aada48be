"""utensil-train's architectures (--arch), its evaluation (top-1, top-5, confusion matrix) and
what a checkpoint records for utensil-export and utensil-predict."""

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi import train as tr


class _FixedLogits:
    """A stand-in network: hands out given logits in order, batch by batch."""

    def __init__(self, logits):
        self.logits, self.pos = logits, 0

    def eval(self):
        pass

    def train(self, mode=True):
        pass

    def __call__(self, xb):
        n = xb.shape[0]
        out = ut.tensor(self.logits[self.pos:self.pos + n])
        self.pos += n
        return out


def test_top1_top5_and_confusion_against_hand_counts():
    # 7 classes, 4 images: label ranks 0, 1, 5 (beaten by 5 logits), and 6 (beaten by 6)
    z = np.array([[9, 1, 2, 3, 4, 5, 6],
                  [1, 2, 9, 3, 4, 5, 6],
                  [1, 2, 3, 4, 5, 6, 7],
                  [7, 6, 5, 4, 3, 2, 1]], np.float32)
    y = np.array([0, 6, 1, 6])
    r = tr.evaluate_full(_FixedLogits(z), np.zeros((4, 1, 1, 1), np.float32), y, 3, "cpu")
    assert r["top1"] == 0.25
    assert r["top5"] == 0.5  # label 0 first; label 6 second in row 1; rows 2, 3: beaten by 5, 6
    want = np.zeros((7, 7), np.int64)
    for t, p in zip(y, z.argmax(axis=1)):
        want[t, p] += 1
    np.testing.assert_array_equal(r["confusion"], want)
    logp = z - np.log(np.exp(z.astype(np.float64)).sum(axis=1, keepdims=True))
    assert r["loss"] == pytest.approx(-logp[np.arange(4), y].mean(), rel=1e-5)


@pytest.fixture
def npz(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "tiny.npz"
    y = np.arange(60) % 6
    x = rng.normal(0, 1, (60, 3, 12, 12)).astype(np.float32) + y[:, None, None, None] * 0.5
    np.savez(path, x_train=x[:48], y_train=y[:48], x_test=x[48:], y_test=y[48:])
    return str(path)


@pytest.mark.parametrize("arch", ["mobilenet_v1", "mobilenet_v2"])
def test_archs_train_save_and_resume(npz, tmp_path, arch, capsys):
    ck = str(tmp_path / "ck.npz")
    common = ["--data", npz, "--arch", arch, "--width-mult", "0.25", "--batch-size", "16",
              "--no-progress", "--device", "cpu", "--checkpoint", ck]
    assert tr.main(common + ["--epochs", "1"]) == 0
    out = capsys.readouterr().out
    assert arch in out and "top-5" in out
    meta, model, _ = tr.load_checkpoint(ck)
    assert meta["run"]["arch"] == arch and meta["run"]["width_mult"] == 0.25
    assert meta["data_info"]["mean"] is not None and len(meta["data_info"]["std"]) == 3
    net = tr.build_network(meta["run"], meta["data_info"]["image_shape"], 6, "cpu")
    assert list(net.state_dict()) == list(model)  # the checkpoint fits what predict builds
    net.close()
    assert tr.main(["--resume", ck, "--epochs", "2", "--no-progress", "--device", "cpu"]) == 0
    # a resumed run keeps its architecture
    assert tr.main(["--resume", ck, "--epochs", "3", "--arch", "digits", "--no-progress"]) == 2
    assert "--arch digits differs from the checkpoint's" in capsys.readouterr().err


def test_old_checkpoints_read_as_digits(npz, tmp_path):
    # a checkpoint from before --arch: its run has no arch or width_mult
    ck = str(tmp_path / "old.npz")
    assert tr.main(["--data", npz, "--epochs", "1", "--width", "4", "--no-progress",
                    "--device", "cpu", "--checkpoint", ck, "-q"]) == 0
    meta, model, optim = tr.load_checkpoint(ck)
    for k in ("arch", "width_mult"):
        del meta["run"][k]
    net = tr.build_network(dict(meta["run"], arch="digits"), (3, 12, 12), 6, "cpu")
    opt = ut.Adam(net.parameters())
    net.load_state_dict(model)
    opt.load_state_dict(optim)
    tr.save_checkpoint(ck, net, opt, meta)
    net.close()
    opt.close()
    assert tr.main(["--resume", ck, "--epochs", "2", "--no-progress", "--device", "cpu",
                    "-q"]) == 0
