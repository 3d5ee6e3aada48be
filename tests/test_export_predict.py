"""utensil-export and utensil-predict on a checkpoint that utensil-train writes here: the ONNX
file against onnxruntime, the predictions against the network's own forward on images prepared
by numpy, and the bad-input cases."""

import numpy as np
import pytest

from utensil_ffi import export as ex
from utensil_ffi import predict as pr
from utensil_ffi import train as tr

Image = pytest.importorskip("PIL.Image")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck")
    rng = np.random.default_rng(0)
    y = np.arange(40) % 4
    x = rng.uniform(0, 1, (40, 3, 10, 10)).astype(np.float32)
    x[:, y % 3] += 0.5  # learnable: a bright channel per class
    np.savez(d / "data.npz", x_train=x[:32], y_train=y[:32], x_test=x[32:], y_test=y[32:])
    path = str(d / "ck.npz")
    assert tr.main(["--data", str(d / "data.npz"), "--arch", "mobilenet_v2", "--width-mult",
                    "0.25", "--epochs", "1", "--no-progress", "--device", "cpu", "-q",
                    "--checkpoint", path]) == 0
    return path


def test_export_matches_onnxruntime(ckpt, tmp_path, capsys):
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    out = str(tmp_path / "m.onnx")
    assert ex.main([ckpt, out]) == 0
    said = capsys.readouterr().out
    assert "mobilenet_v2" in said and "max abs difference" in said
    # independently: onnxruntime against the checkpoint's network on other inputs
    net, meta = ex.load_network(ckpt)
    x = np.random.default_rng(9).normal(0, 1, (3, 3, 10, 10)).astype(np.float32)
    got = ort.InferenceSession(out, providers=["CPUExecutionProvider"]).run(
        ["output"], {"input": x})[0]
    import utensil_ffi as ut

    want = net(ut.tensor(x)).numpy()
    net.close()
    assert np.max(np.abs(got - want)) <= 1e-4


def test_export_bad_checkpoint_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a checkpoint")
    assert ex.main([str(bad), str(tmp_path / "m.onnx")]) == 2
    assert "not a readable checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "m.onnx").exists()


def test_predict_against_the_network_on_numpy_prepared_images(ckpt, tmp_path, capsys):
    net, meta = ex.load_network(ckpt)
    info = meta["data_info"]
    mean, std = np.array(info["mean"]), np.array(info["std"])
    rng = np.random.default_rng(1)
    paths, arrays = [], []
    for i in range(3):  # already at the trained size: preparing is scaling and normalizing
        px = rng.integers(0, 256, (10, 10, 3), dtype=np.uint8)
        p = tmp_path / ("img%d.png" % i)
        Image.fromarray(px, "RGB").save(p)
        paths.append(str(p))
        arrays.append(((px.transpose(2, 0, 1) / 255.0 - mean[:, None, None])
                       / std[:, None, None]).astype(np.float32))
    want = pr.predict(net, np.stack(arrays))
    net.close()
    assert pr.main([ckpt] + paths + ["--top-k", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3
    for line, probs in zip(lines, want):
        top = np.argsort(-probs, kind="stable")[:2]
        fields = line.split(": ", 1)[1].split()
        assert [int(f) for f in fields[0::2]] == list(top)
        np.testing.assert_allclose([float(f) for f in fields[1::2]], probs[top], atol=1e-4)


def test_predict_resizes_and_converts_modes(ckpt, tmp_path, capsys):
    p = tmp_path / "big_gray.png"
    Image.fromarray(np.full((30, 50), 128, np.uint8), "L").save(p)
    assert pr.main([ckpt, str(p), "--top-k", "10"]) == 0
    fields = capsys.readouterr().out.split(": ", 1)[1].split()
    assert len(fields) == 8  # 4 classes: top-k capped by the class count
    assert sum(float(f) for f in fields[1::2]) == pytest.approx(1.0, abs=1e-3)


def test_predict_reports_unreadable_files_and_goes_on(ckpt, tmp_path, capsys):
    good = tmp_path / "ok.png"
    Image.fromarray(np.zeros((10, 10, 3), np.uint8), "RGB").save(good)
    junk = tmp_path / "junk.png"
    junk.write_text("not an image")
    assert pr.main([ckpt, str(junk), str(tmp_path / "missing.png"), str(good)]) == 1
    cap = capsys.readouterr()
    assert "junk.png: cannot decode this image" in cap.err and "missing.png" in cap.err
    assert cap.out.startswith(str(good))
