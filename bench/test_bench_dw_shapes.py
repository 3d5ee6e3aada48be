"""bench_dw_shapes.py in quick mode: one tiny case per device and dtype; checks that both sides
ran and what the rows and the summary say, not speed."""

import pytest

import bench_dw_shapes as bd
import utensil_ffi as ut

pytest.importorskip("torch")

DEVICES = [d for d in ("cpu", "cuda") if d in ut.devices()]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_rows_and_summary(device, dtype):
    rows = bd.run(threads=1, kernels=((3, 5), (2, 2)), strides=(2,), dilations=(1, 2),
                  channels=(3,), planes=(9,), batch=2, reps=1, modes=("fwd", "step"),
                  out=lambda s: None, device=device, dtype=dtype)
    # 2x2 at dilation 2 pads 2 * (2 // 2); every case fits a 9x9 plane: 2 kernels x 2 dilations
    assert [(r[0], r[1], r[2], r[4]) for r in rows] == [
        (m, kh, kw, d) for kh, kw in ((3, 5), (2, 2)) for d in (1, 2) for m in ("fwd", "step")]
    for mode, kh, kw, s, d, c, h, ours, theirs, ratio in rows:
        assert ours > 0 and theirs > 0 and ratio == pytest.approx(theirs / ours)
    lines = []
    bd.summary(rows, out=lines.append)
    assert len(lines) == 2 and lines[0].startswith("fwd: 4 cases") and lines[1].startswith(
        "step: 4 cases")


def test_bad_dtype_is_refused():
    with pytest.raises(ValueError, match="fp32 or bf16"):
        bd.run(kernels=((3, 3),), out=lambda s: None, dtype="fp16")


@pytest.mark.parametrize("device", DEVICES)
def test_eval_mode_rows(device):
    rows = bd.run(threads=1, kernels=((3, 3),), strides=(1, 2), channels=(4,), planes=(7,),
                  batch=1, reps=1, modes=("eval",), out=lambda s: None, device=device)
    assert [(r[0], r[3]) for r in rows] == [("eval", 1), ("eval", 2)]
    assert all(r[7] > 0 and r[8] > 0 for r in rows)


def test_bad_modes_are_refused():
    with pytest.raises(ValueError, match="fwd, step and eval"):
        bd.run(kernels=((3, 3),), out=lambda s: None, modes=("fwd", "infer"))
    with pytest.raises(ValueError, match="float32 only"):
        bd.run(kernels=((3, 3),), out=lambda s: None, modes=("eval",), dtype="bf16")


def test_rounds_follow_untimed_calls_of_their_own_side():
    """A round is timed only after warm_ms of its side's own calls (the other side's thread
    pool quiet by then); what is timed is the round's calls alone."""
    import time

    counts = {"a": 0, "b": 0}

    def side(name):
        def fn():
            counts[name] += 1
            time.sleep(0.001)
        return fn

    a, b = bd._best_pair(side("a"), side("b"), reps=2, calls=1, warm_ms=0.0)
    assert counts == {"a": 3, "b": 3}  # one warm-up round, then reps rounds of one call
    counts.update(a=0, b=0)
    a, b = bd._best_pair(side("a"), side("b"), reps=2, calls=1, warm_ms=20.0)
    # each of the 3 rounds: >= 20 ms of 1 ms calls first, then the timed call
    assert counts["a"] >= 3 * 2 and counts["b"] >= 3 * 2
    assert counts["a"] <= 3 * 21 + 3 and counts["b"] <= 3 * 21 + 3
    assert 0.0 < a < 20.0 and 0.0 < b < 20.0  # the warm-up calls are not in the time
