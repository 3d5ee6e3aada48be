"""utensil-train with torchvision's networks (utensil_ffi.models): every --arch trains one epoch
on tiny 32x32 images, its checkpoint exports (utensil-export's own onnxruntime check) and
predicts; --width-mult where the family has one; grey images and the 8x8 digits; old
checkpoints of the flat mobilenet_v2 still resume, export and predict; --init-from."""

import sys

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi import models as zoo
from utensil_ffi import train as tr
from utensil_ffi.cli import export as ex
from utensil_ffi.cli import predict as pr
from utensil_ffi.nn import models as flat

NEW_ARCHS = zoo.list_models()
FAST = ["--batch-size", "16", "--no-progress", "--device", "cpu", "--epochs", "1"]


def _images(path, channels, size, n=24, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    y = np.arange(n) % classes
    x = rng.normal(0, 1, (n, channels, size, size)).astype(np.float32)
    x += y[:, None, None, None] * 0.5
    k = n * 2 // 3
    np.savez(path, x_train=x[:k], y_train=y[:k], x_test=x[k:], y_test=y[k:])
    return str(path)


@pytest.fixture(scope="module")
def rgb32(tmp_path_factory):
    return _images(tmp_path_factory.mktemp("rgb") / "rgb32.npz", 3, 32)


@pytest.fixture(scope="module")
def trained(rgb32, tmp_path_factory):
    """arch -> the checkpoint of one epoch of it, trained once for the module's tests."""
    root, done = tmp_path_factory.mktemp("ck"), {}

    def get(arch):
        if arch not in done:
            ck = str(root / ("%s.npz" % arch))
            assert tr.main(["--data", rgb32, "--arch", arch, "--checkpoint", ck, "-q"]
                           + FAST) == 0
            done[arch] = ck
        return done[arch]
    return get


@pytest.fixture(scope="module")
def png(tmp_path_factory):
    Image = pytest.importorskip("PIL.Image")
    path = tmp_path_factory.mktemp("png") / "a.png"
    rgb = (np.random.default_rng(0).random((40, 36, 3)) * 255).astype(np.uint8)
    Image.fromarray(rgb).save(path)
    return str(path)


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_arch_trains_and_its_checkpoint_predicts(arch, trained, png, capsys):
    ck = trained(arch)
    meta, model, _ = tr.load_checkpoint(ck)
    assert meta["run"]["arch"] == arch and meta["run"]["arch_version"] == tr.ARCH_VERSION
    net = zoo.get_model(arch, num_classes=4)  # torchvision's keys, whatever the family
    assert list(net.state_dict()) == list(model)
    net.close()
    capsys.readouterr()
    assert pr.main([ck, png, "--top-k", "2"]) == 0
    line = capsys.readouterr().out.strip()
    probs = [float(w) for w in line.split()[2::2]]
    assert line.startswith(png) and len(probs) == 2 and probs[0] >= probs[1] > 0


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_arch_exports_and_onnxruntime_agrees(arch, trained, tmp_path, capsys):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    out = str(tmp_path / "m.onnx")
    status = ex.main([trained(arch), out])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "max abs difference" in captured.out


def test_resume_continues_a_torchvision_arch(trained, tmp_path, capsys):
    import shutil

    ck = str(tmp_path / "ck.npz")
    shutil.copy(trained("mnasnet0_5"), ck)
    assert tr.main(["--resume", ck, "--epochs", "2", "--no-progress", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "mnasnet0_5" in out and "resumed from" in out
    assert tr.load_checkpoint(ck)[0]["epoch"] == 2


def test_width_mult_sizes_the_mobilenets(rgb32, tmp_path, capsys):
    ck = str(tmp_path / "ck.npz")
    assert tr.main(["--data", rgb32, "--arch", "mobilenet_v3_small", "--width-mult", "0.5",
                    "--checkpoint", ck] + FAST) == 0
    out = capsys.readouterr().out
    assert "mobilenet_v3_small, width multiplier 0.5" in out
    _, model, _ = tr.load_checkpoint(ck)
    half = zoo.mobilenet_v3_small(num_classes=4, width_mult=0.5)
    full = zoo.mobilenet_v3_small(num_classes=4)
    assert {k: v.shape for k, v in half.state_dict().items()} == \
        {k: v.shape for k, v in model.items()}
    assert flat.count_parameters(half) < flat.count_parameters(full)
    half.close()
    full.close()


@pytest.mark.parametrize("arch", ["efficientnet_b0", "convnext_tiny", "mnasnet0_5", "digits"])
def test_width_mult_is_refused_where_the_family_has_none(rgb32, arch, capsys):
    assert tr.main(["--data", rgb32, "--arch", arch, "--width-mult", "0.5",
                    "--no-checkpoint"] + FAST) == 2
    err = capsys.readouterr().err
    assert "--width-mult: %s has no width multiplier" % arch in err and "Traceback" not in err


def test_width_is_the_digits_networks_alone(rgb32, capsys):
    assert tr.main(["--data", rgb32, "--arch", "efficientnet_b0", "--width", "8",
                    "--no-checkpoint"] + FAST) == 2
    assert "--width sizes the digits network" in capsys.readouterr().err


def test_an_unknown_arch_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        tr.main(["--arch", "resnet50"])
    assert e.value.code == 2
    assert "invalid choice: 'resnet50'" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["mobilenet_v3_small", "efficientnet_b0"])
def test_grey_images_train_with_one_input_channel(arch, tmp_path, capsys):
    grey = _images(tmp_path / "grey.npz", 1, 16)
    ck = str(tmp_path / "ck.npz")
    assert tr.main(["--data", grey, "--arch", arch, "--checkpoint", ck, "-q"] + FAST) == 0
    _, model, _ = tr.load_checkpoint(ck)
    stem = next(v for k, v in model.items() if v.ndim == 4)
    assert stem.shape[1] == 1


def test_the_digits_train_a_torchvision_network(capsys):
    # the built-in 1x8x8 digits: one input channel, padded strided convolutions down to 1x1
    pytest.importorskip("sklearn")
    assert tr.main(["--arch", "mnasnet0_5", "--no-checkpoint", "--batch-size", "128",
                    "--no-progress", "--device", "cpu", "--epochs", "1"]) == 0
    assert "mnasnet0_5" in capsys.readouterr().out


def test_images_too_small_for_convnext_are_a_usage_error(tmp_path, capsys):
    small = _images(tmp_path / "small.npz", 1, 8)  # the digits' size
    assert tr.main(["--data", small, "--arch", "convnext_tiny", "--no-checkpoint"] + FAST) == 2
    err = capsys.readouterr().err
    assert "needs images of at least 32 x 32" in err and "Traceback" not in err


# -- checkpoints of the flat mobilenet_v2 (before torchvision's layout) --------------------------

@pytest.fixture
def flat_v2_checkpoint(tmp_path):
    """A mobilenet_v2 checkpoint as utensil-train wrote it before the torchvision layouts: the
    flat nn.models.mobilenet_v2 (fused, stem stride 1 under 96 pixels), Adam after one step,
    the run settings of that time (no arch_version, none of the recipe's)."""
    data = _images(tmp_path / "d.npz", 3, 12)
    ut.seed(0)
    net = flat.mobilenet_v2(4, 0.25, 3, device="cpu", fused=True, stem_stride=1)
    opt = ut.Adam(net.parameters(), lr=0.01)
    x = np.load(data)["x_train"][:8]
    y = np.load(data)["y_train"][:8]
    tr.train_epoch(net, opt, x, y, 8, 0, 0, "cpu")
    run = {"data": data, "arch": "mobilenet_v2", "width": 32, "width_mult": 0.25,
           "image_size": None, "augment": True, "batch_size": 8, "lr": 0.01,
           "optimizer": "adam", "momentum": 0.9, "lr_schedule": "cosine", "seed": 0}
    hist = [{"epoch": 1, "train_loss": 1.0, "test_loss": 1.0, "test_acc": 0.25}]
    info = {"name": "d.npz", "image_shape": [3, 12, 12], "num_classes": 4, "n_train": 16,
            "n_test": 8, "mean": None, "std": None, "class_names": None,
            "eval_transform": None}
    ck = str(tmp_path / "old.npz")
    tr.save_checkpoint(ck, net, opt, {"epoch": 1, "run": run, "epochs": 1, "history": hist,
                                      "data_info": info})
    want = net.state_dict()
    net.close()
    opt.close()
    assert "0.weight" in want  # the flat keys
    return ck, want


def test_an_old_flat_mobilenet_v2_checkpoint_exports_and_predicts(flat_v2_checkpoint, tmp_path,
                                                                  png, capsys):
    ck, want = flat_v2_checkpoint
    net, meta = ex.load_network(ck)
    got = net.state_dict()
    assert list(got) == list(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    net.close()
    assert pr.main([ck, png]) == 0
    assert capsys.readouterr().out.startswith(png)
    if _importable("onnxruntime") and _importable("onnx"):  # the flat layout exports today
        assert ex.main([ck, str(tmp_path / "m.onnx")]) == 0
        assert "max abs difference" in capsys.readouterr().out


def test_an_old_flat_mobilenet_v2_checkpoint_resumes(flat_v2_checkpoint, capsys):
    ck, _ = flat_v2_checkpoint
    assert tr.main(["--resume", ck, "--epochs", "2", "--no-progress", "--device", "cpu"]) == 0
    assert "utensil's flat layout" in capsys.readouterr().out
    meta, model, _ = tr.load_checkpoint(ck)
    assert meta["epoch"] == 2 and meta["run"]["arch_version"] == 1 and "0.weight" in model


@pytest.mark.parametrize("arch", ["mobilenet_v2", "efficientnet_b0", "mnasnet0_5",
                                  "convnext_tiny"])
def test_small_images_get_a_stride_one_stem_since_arch_version_3(arch):
    """A 32 px run of arch_version 3 builds the zoo's stem with stride 1 (stride 2 left the last
    stages 1x1 and mobilenet_v2 diverged on a 32 px folder); a version-2 checkpoint keeps
    torchvision's stride 2; 96 px and up always has it; ConvNeXt's patchify stem is its own."""
    from utensil_ffi.cli import archs

    def stem_out(version, size):
        run = {"arch": arch, "width_mult": 1.0, "arch_version": version}
        net = archs.build_network(run, (3, size, size), 4, "cpu")
        try:
            y = net[0][0].eval()(np.zeros((1, 3, size, size), np.float32))
            out = y.shape[2]
            y.close()
            return out
        finally:
            net.close()

    assert archs.ARCH_VERSION == 3
    if arch.startswith("convnext"):
        assert stem_out(3, 32) == stem_out(2, 32) == 8
    else:
        assert (stem_out(3, 32), stem_out(2, 32), stem_out(3, 96)) == (32, 16, 48)


def _importable(name):
    try:
        __import__(name)
        return True
    except ImportError:
        return False


# -- --init-from ---------------------------------------------------------------------------------

def _npz_state(path, arch, **kw):
    ut.seed(7)
    net = zoo.get_model(arch, **kw)
    sd = net.state_dict()
    net.close()
    np.savez(path, **sd)
    return sd


def test_init_from_npz_reinitialises_a_classifier_of_another_class_count(rgb32, tmp_path,
                                                                           capsys):
    src = str(tmp_path / "w.npz")
    theirs = _npz_state(src, "mobilenet_v3_small", num_classes=10)
    ck = str(tmp_path / "ck.npz")
    # lr 0: Adam leaves the weights where they were loaded (BatchNorm's statistics still move)
    assert tr.main(["--data", rgb32, "--arch", "mobilenet_v3_small", "--init-from", src,
                    "--lr", "0", "--checkpoint", ck] + FAST) == 0
    out = capsys.readouterr().out
    assert "weights from %s" % src in out
    assert "classifier (classifier.3.weight, classifier.3.bias) is initialised afresh" in out
    meta, model, _ = tr.load_checkpoint(ck)
    assert meta["run"]["init_from"] == src
    assert model["classifier.3.weight"].shape == (4, 1024)
    for k, v in theirs.items():
        if k.startswith("classifier.3") or "running" in k or "num_batches" in k:
            continue
        np.testing.assert_array_equal(model[k], v, err_msg=k)
    # the resumed run keeps its weights: the file is not read again
    assert tr.main(["--resume", ck, "--epochs", "2", "-q", "--no-progress"]) == 0


def test_init_from_a_torchvision_state_dict(rgb32, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    tvm = pytest.importorskip("torchvision.models")
    torch.manual_seed(0)
    tv = tvm.mnasnet0_5(num_classes=1000)
    src = str(tmp_path / "mnasnet.pt")
    torch.save(tv.state_dict(), src)
    ck = str(tmp_path / "ck.npz")
    assert tr.main(["--data", rgb32, "--arch", "mnasnet0_5", "--init-from", src, "--lr", "0",
                    "--checkpoint", ck] + FAST) == 0
    assert "is initialised afresh" in capsys.readouterr().out
    _, model, _ = tr.load_checkpoint(ck)
    sd = tv.state_dict()
    assert model["classifier.1.weight"].shape == (4, 1280)
    for k, v in sd.items():
        if k.startswith("classifier") or "running" in k or "num_batches" in k:
            continue
        np.testing.assert_array_equal(model[k], v.numpy(), err_msg=k)


def test_init_from_a_pt_file_without_torch_is_a_clear_error(rgb32, tmp_path, monkeypatch,
                                                           capsys):
    src = tmp_path / "w.pt"
    src.write_bytes(b"whatever")
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    assert tr.main(["--data", rgb32, "--arch", "mnasnet0_5", "--init-from", str(src),
                    "--no-checkpoint"] + FAST) == 2
    err = capsys.readouterr().err
    assert "needs torch" in err and ".npz" in err and "Traceback" not in err


@pytest.mark.parametrize("case", ["other-arch", "grey", "suffix", "missing", "not-npz"])
def test_init_from_mismatches_are_usage_errors(case, rgb32, tmp_path, capsys):
    src = str(tmp_path / "w.npz")
    data, words = rgb32, None
    if case == "other-arch":
        _npz_state(src, "mnasnet0_5", num_classes=4)
        words = "missing keys"
    elif case == "grey":  # RGB weights, grey images: the stem's shape differs
        _npz_state(src, "mnasnet0_5", num_classes=4)
        data = _images(tmp_path / "grey.npz", 1, 16)
        words = "another channel count"
    elif case == "suffix":
        src = str(tmp_path / "w.txt")
        open(src, "w").close()
        words = "expected a state_dict saved with torch.save"
    elif case == "missing":
        src = str(tmp_path / "nothing.npz")
        words = "no such file"
    else:
        with open(src, "wb") as f:
            f.write(b"not a zip")
        words = "not a readable .npz"
    arch = "mnasnet0_5" if case == "grey" else "mobilenet_v3_small"
    assert tr.main(["--data", data, "--arch", arch, "--init-from", src, "--no-checkpoint"]
                   + FAST) == 2
    err = capsys.readouterr().err
    assert words in err and "--init-from" in err and "Traceback" not in err


def test_a_torchvision_arch_on_each_device(rgb32, tmp_path, device):
    ck = str(tmp_path / "ck.npz")
    assert tr.main(["--data", rgb32, "--arch", "mobilenet_v3_small", "--checkpoint", ck, "-q",
                    "--batch-size", "8", "--no-progress", "--device", device, "--epochs", "1",
                    "--optimizer", "adamw", "--ema", "--label-smoothing", "0.1"]) == 0
    meta = tr.load_checkpoint(ck)[0]
    assert meta["history"][-1]["device"] == device
    assert np.isfinite(meta["history"][-1]["test_loss"])


def test_a_grey_image_folder_trains_and_predicts(tmp_path, capsys):
    # a folder of grey PNGs: folders are read as RGB (grey replicated), what torchvision's
    # stems take, and predict prepares a grey file the same way
    Image = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(0)
    for k in range(2):
        d = tmp_path / "imgs" / ("c%d" % k)
        d.mkdir(parents=True)
        for i in range(6):
            img = np.clip(60 + 120 * k + rng.normal(0, 20, (20, 20)), 0, 255).astype(np.uint8)
            Image.fromarray(img, "L").save(d / ("%d.png" % i))
    ck = str(tmp_path / "ck.npz")
    assert tr.main(["--data", str(tmp_path / "imgs"), "--arch", "mobilenet_v3_small",
                    "--image-size", "16", "--workers", "0", "--checkpoint", ck, "-q"]
                   + FAST[:1] + ["4"] + FAST[2:]) == 0
    meta = tr.load_checkpoint(ck)[0]
    assert meta["data_info"]["image_shape"] == [3, 16, 16]
    capsys.readouterr()
    assert pr.main([ck, str(tmp_path / "imgs" / "c1" / "0.png")]) == 0
    assert capsys.readouterr().out.startswith(str(tmp_path))


# -- --dropout and --stochastic-depth-prob ------------------------------------------------------

def test_dropout_and_stochastic_depth_flags_reach_the_model_and_resume(rgb32, tmp_path, capsys):
    from utensil_ffi.cli import archs

    ck = str(tmp_path / "e.npz")
    assert tr.main(["--data", rgb32, "--arch", "efficientnet_b0", "--dropout", "0.1",
                    "--stochastic-depth-prob", "0.05", "--checkpoint", ck] + FAST) == 0
    assert "dropout 0.1, stochastic depth prob 0.05" in capsys.readouterr().out
    meta, _, _ = tr.load_checkpoint(ck)
    run = meta["run"]
    assert (run["dropout"], run["stochastic_depth_prob"]) == (0.1, 0.05)
    net = archs.build_network(run, (3, 32, 32), 4, "cpu")
    try:
        drops = [m.p for m in net.modules() if type(m).__name__ == "Dropout"]
        depths = [m.p for m in net.modules() if type(m).__name__ == "StochasticDepth"]
        # torchvision's rule: block i of n drops with 0.05 * i / n
        assert drops == [0.1] and len(depths) == 16
        np.testing.assert_allclose(depths, [0.05 * i / 16 for i in range(16)])
    finally:
        net.close()
    # a resumed run keeps them, and refuses another value
    assert tr.main(["--resume", ck, "--epochs", "2", "-q", "--no-progress",
                    "--device", "cpu"]) == 0
    assert tr.load_checkpoint(ck)[0]["run"]["dropout"] == 0.1
    assert tr.main(["--resume", ck, "--epochs", "3", "--dropout", "0.3", "--no-progress",
                    "--device", "cpu"]) == 2
    assert "--dropout 0.3 differs from the checkpoint's" in capsys.readouterr().err


@pytest.mark.parametrize("arch, flag", [("convnext_tiny", "--dropout"),
                                        ("mobilenet_v3_small", "--stochastic-depth-prob"),
                                        ("digits", "--dropout"),
                                        ("mobilenet_v1", "--stochastic-depth-prob")])
def test_regularisation_a_network_lacks_is_a_usage_error(rgb32, arch, flag, capsys):
    assert tr.main(["--data", rgb32, "--arch", arch, flag, "0.1"] + FAST) == 2
    err = capsys.readouterr().err
    assert "%s: %s has no" % (flag, arch) in err and "efficientnet" in err

