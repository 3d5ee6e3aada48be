"""bench_loader.py in quick mode: a tiny generated folder; checks correctness, not speed. The
folder feeds bitwise the same batches at every worker count as in-memory arrays give, so on the
CPU training from either ends with the same losses (training takes the loader's views of its
workers' shared memory, copy=False, as utensil-train does)."""

import numpy as np

import bench_loader as bl


def test_folder_feed_trains_like_in_memory_arrays(tmp_path):
    r = bl.run(images_n=48, classes=3, size=12, batch=8, workers=(0, 2), epochs=1, width=4,
               threads=1, folder=str(tmp_path), cached_workers=(0,), step_ms=1.0)
    assert r["same_batches"]
    assert set(r["load"]) == {"memory", "folder w=0", "folder w=2", "cached w=0"}
    assert all(v > 0 for v in r["load"].values()) and all(v > 0 for v in r["train"].values())
    assert set(r["parent_us"]) == {"folder w=2"}  # the hand-over's cost: feeds with workers
    assert all(v > 0 for v in r["parent_us"]["folder w=2"].values())
    assert set(r["epoch_start_ms"]) == {"folder w=2"}  # waits for first and later batches
    assert all(v >= 0 for v in r["epoch_start_ms"]["folder w=2"])
    ref = r["losses"]["memory"]
    assert len(ref) == 6 and np.all(np.isfinite(ref))
    for feed in ("folder w=0", "folder w=2", "cached w=0"):
        assert r["losses"][feed] == ref, feed
