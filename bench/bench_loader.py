"""Images/s from an image folder through utensil_ffi.data.loader, against slicing in-memory arrays.

    python bench/bench_loader.py [--images 2000] [--classes 10] [--size 32] [--batch 128]
        [--workers 0,1,2] [--cached-workers 0] [--epochs 3] [--step-ms 40] [--device cpu]
        [--threads 2] [--width 16] [--augment] [--no-train] [--dir DIR]

Writes ``--images`` PNGs of ``--size``^2 (smooth random colour fields, ``--classes`` class
folders) into a temporary folder (or ``--dir``, reused when it holds them), then measures:

- load: the images/s one epoch of ``Loader(ImageFolder)`` delivers at each worker count (after
  a warm-up epoch that starts the workers), the same with the folder's images decoded once and
  kept in memory (``ImageFolder.cached()``, at each ``--cached-workers`` count; its transforms
  still run per sample), next to indexing an in-memory float32 array in the same
  ``data.batches`` order, and the CPU time decoding costs per image (workers=0); with workers,
  also this process's CPU time per batch (receiving a batch: what the training thread pays),
  with the loader's views (``copy=False``, as utensil-train) and with its copies (the default);
- epoch start: with workers, how long ``loader.epoch(e)`` makes its consumer wait for the first
  batch, against the median wait for a batch inside the epoch, when the consumer spends
  ``--step-ms`` on each batch (sleeping: a GPU's training step, during which the training
  thread only waits). The Loader loads the next epoch's first batches while the consumer takes
  an epoch's last ones, so a consumer the workers keep up with should find them ready;
- train (unless ``--no-train``, when utensil loads): images/s of training steps of
  ``models.mobilenet(3, classes, width, stem_stride=1)`` (Adam, cross-entropy, as utensil-train)
  fed from the folder at each worker count, and fed from in-memory arrays, with their ratio (the
  issue's target: folder >= 90% of in-memory at 32x32). Rounds alternate between the feeds so
  a change of machine load hits all of them; the median round is printed. On the CPU, also the
  bound that CPU times give, which other processes on the machine do not move: training's CPU
  time per image t and decoding's d allow at most t / (t + d) of the in-memory rate.

The folder's transform is ToArray + Normalize (``--augment``: RandomResizedCrop +
RandomHorizontalFlip first); the in-memory arrays are the same images through the same
(non-random) transform, so without ``--augment`` both feeds give bitwise the same batches and,
on the CPU, the same losses: ``run()`` returns them for bench/test_bench_loader.py.
"""

import argparse
import importlib
import os
import statistics
import sys
import tempfile
import time

import numpy as np

if __name__ == "__main__" and __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from utensil_ffi import data  # noqa: E402
from utensil_ffi.data import images  # noqa: E402
from utensil_ffi.data import transforms as T  # noqa: E402
from utensil_ffi.data.loader import Loader  # noqa: E402


def write_folder(root, n, classes, size, seed=0):
    """``n`` PNGs of size^2 in ``classes`` folders (bilinear upsampled 4x4 colour noise, so the
    files compress like photographs more than like noise); kept when already there."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for i in range(n):
        c = i % classes
        path = os.path.join(root, "class%02d" % c, "%05d.png" % i)
        if os.path.exists(path):
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        small = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
        small[..., c % 3] = np.maximum(small[..., c % 3], 160)  # something to learn
        Image.fromarray(small).resize((size, size), Image.BILINEAR).save(path)
    return root


def _transform(mean, std, size, augment):
    steps = [T.ToArray(), T.Normalize(mean, std)]
    if augment:
        steps = [T.RandomResizedCrop(size, scale=(0.25, 1.0)), T.RandomHorizontalFlip()] + steps
    return T.Compose(steps)


def load_rates(feeds, x, y, batch, epochs, seed=0):
    """{feed: images/s} of each (name, dataset, workers) feed's Loader (``copy=False``, as
    utensil-train) and of in-memory indexing; whether every feed's batches equal the first
    one's; the CPU time per image of the first feed with workers=0 (this process did all its
    decoding); {feed with workers: {"view"/"copy": this process's CPU us per batch}}."""
    out, same, parent = {}, True, {}
    n = len(y)
    t0 = time.perf_counter()
    for e in range(epochs):
        for idx in data.batches(n, batch, seed, e):
            xb, yb = np.ascontiguousarray(x[idx]), y[idx]
    out["memory"] = epochs * n / (time.perf_counter() - t0)
    first, cpu_us = None, None
    for name, ds, w in feeds:
        with Loader(ds, batch, seed=seed, workers=w, copy=False) as loader:
            # warm-up: starts the workers (the views are valid until the next batch: copy)
            got = [(a.copy(), b.copy()) for a, b in loader.epoch(0)]
            if first is None:
                first = got
            else:
                same = same and all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
                                    for a, b in zip(first, got))
            t0, c0 = time.perf_counter(), time.process_time()
            for e in range(1, epochs + 1):
                for xb, yb in loader.epoch(e):
                    pass
            out[name] = epochs * n / (time.perf_counter() - t0)
            if w == 0 and cpu_us is None:
                cpu_us = 1e6 * (time.process_time() - c0) / (epochs * n)
            if w > 0:
                parent[name] = {"view": _parent_us(loader, epochs)}
                loader.copy = True
                parent[name]["copy"] = _parent_us(loader, epochs)
    return out, same, cpu_us, parent


def _parent_us(loader, epochs):
    """This process's CPU time (all its threads) per batch over ``epochs`` epochs of
    ``loader``: the workers' decoding is theirs, so this is the hand-over's cost."""
    c0, batches = time.process_time(), 0
    for e in range(1, epochs + 1):
        for _ in loader.epoch(e):
            batches += 1
    return 1e6 * (time.process_time() - c0) / batches


def epoch_start_ms(feeds, batch, epochs, step_s, seed=0):
    """{feed with workers: (median ms from ``loader.epoch(e)`` to its first batch, median ms
    waited for each later batch)} over epochs 1..``epochs`` (epoch 0, which starts the
    workers, is not counted), the consumer sleeping ``step_s`` per batch."""
    out = {}
    for name, ds, w in feeds:
        if w == 0:
            continue
        first, inside = [], []
        with Loader(ds, batch, seed=seed, workers=w, copy=False) as loader:
            for e in range(epochs + 1):
                t0 = time.perf_counter()
                it = loader.epoch(e)
                next(it)
                if e:
                    first.append(time.perf_counter() - t0)
                while True:
                    time.sleep(step_s)
                    t0 = time.perf_counter()
                    if next(it, None) is None:
                        break
                    if e:
                        inside.append(time.perf_counter() - t0)
        out[name] = (1e3 * statistics.median(first),
                     1e3 * statistics.median(inside) if inside else 0.0)
    return out


def _train_round(net, opt, feed, device):
    """Train on every (x, y) of ``feed``; (images/s, list of losses)."""
    import utensil_ffi as ut

    losses, seen = [], 0
    t0 = time.perf_counter()
    for xb, yb in feed:
        xt = ut.Tensor(xb, device)
        yt = ut.Tensor(yb.astype(np.float32), device)
        logits = net(xt)
        loss = ut.cross_entropy(logits, yt)
        grad = ut.cross_entropy_backward(logits, yt)
        opt.zero_grad()
        net.backward(grad, input_grad=False)  # the images need no gradient
        opt.step()
        losses.append(loss)
        seen += len(yb)
        for t in (xt, yt, logits, grad):
            t.close()
    values = [t.item() for t in losses]  # reading the last waits for the device
    elapsed = time.perf_counter() - t0
    for t in losses:
        t.close()
    return seen / elapsed, values


def train_rates(feeds, x, y, classes, batch, epochs, device, width, seed=0):
    """{feed: images/s (median round)}, {feed: the first round's losses}, training's CPU time
    per image from memory: one fresh network per feed (the same initial weights), ``epochs``
    rounds of one epoch each, alternating feeds."""
    import utensil_ffi as ut
    from utensil_ffi.nn import models

    names = ["memory"] + [name for name, _, _ in feeds]
    nets, opts, loaders = {}, {}, {}
    for f in names:
        ut.seed(seed)
        nets[f] = models.mobilenet(3, classes, width, device=device, stem_stride=1)
        opts[f] = ut.Adam(nets[f].parameters(), lr=1e-2)
    rates = {f: [] for f in names}
    losses, cpu = {}, []
    try:
        for name, ds, w in feeds:
            loaders[name] = Loader(ds, batch, seed=seed, workers=w, copy=False)  # as training
            for _ in loaders[name].epoch(0):  # warm-up: start the workers
                pass
        for e in range(epochs):
            for f in names:
                if f == "memory":
                    feed = ((x[idx], y[idx]) for idx in data.batches(len(y), batch, seed, e))
                else:
                    feed = loaders[f].epoch(e)
                c0 = time.process_time()
                rate, values = _train_round(nets[f], opts[f], feed, device)
                if f == "memory":  # CPU time of all this process's threads, per image
                    cpu.append(1e6 * (time.process_time() - c0) / len(y))
                rates[f].append(rate)
                losses.setdefault(f, values)
    finally:
        for loader in loaders.values():
            loader.close()
        for f in names:
            nets[f].close()
    return {f: statistics.median(r) for f, r in rates.items()}, losses, statistics.median(cpu)


def run(images_n=2000, classes=10, size=32, batch=128, workers=(0, 1, 2), epochs=3,
        device="cpu", threads=2, width=16, augment=False, train=True, folder=None,
        cached_workers=(0,), step_ms=40.0):
    """Everything the command line prints, as a dict."""
    tmp = None
    if folder is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench_loader_")
        folder = tmp.name
    try:
        write_folder(folder, images_n, classes, size)
        plain = images.ImageFolder(folder)
        mean, std = images.channel_stats(plain)
        ds = plain.with_transform(_transform(mean, std, size, augment))
        # in memory: the same images through the same transform (without the random steps)
        fixed = plain.with_transform(_transform(mean, std, size, False))
        x = np.stack([fixed[i][0] for i in range(len(fixed))])
        y = np.asarray(fixed.targets, dtype=np.int64)
        feeds = [("folder w=%d" % w, ds, w) for w in workers]
        if cached_workers:
            kept = ds.cached()
            feeds += [("cached w=%d" % w, kept, w) for w in cached_workers]
        out = {"images": len(ds), "size": size, "batch": batch, "augment": augment}
        (out["load"], out["same_batches"], out["load_cpu_us"],
         out["parent_us"]) = load_rates(feeds, x, y, batch, epochs)
        out["epoch_start_ms"] = epoch_start_ms(feeds, batch, epochs, step_ms / 1e3)
        if train:
            import utensil_ffi as ut

            saved = ut.get_num_threads()
            if device == "cpu":
                ut.set_num_threads(threads)
            try:
                out["train"], out["losses"], out["train_cpu_us"] = train_rates(
                    feeds, x, y, classes, batch, epochs, device, width)
            finally:
                ut.set_num_threads(saved)
        return out
    finally:
        if tmp is not None:
            tmp.cleanup()


def main(argv=None):
    p = argparse.ArgumentParser(prog="python bench/bench_loader.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--workers", default="0,1,2", help="comma-separated worker counts")
    p.add_argument("--cached-workers", default="0",
                   help="worker counts for the cached folder (comma-separated; '' for none)")
    p.add_argument("--epochs", type=int, default=3, help="timed epochs (rounds) per feed")
    p.add_argument("--step-ms", type=float, default=40.0,
                   help="the consumer's time per batch when timing the epoch start")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--threads", type=int, default=2, help="utensil's CPU threads")
    p.add_argument("--width", type=int, default=16, help="the network's width")
    p.add_argument("--augment", action="store_true", help="RandomResizedCrop + flip")
    p.add_argument("--no-train", action="store_true", help="loading only")
    p.add_argument("--dir", default=None, help="the folder to write (and reuse) the images in")
    a = p.parse_args(argv)
    workers = [int(w) for w in a.workers.split(",")]
    cached = [int(w) for w in a.cached_workers.split(",") if w.strip()]
    train = not a.no_train
    if train:
        try:
            importlib.import_module("utensil_ffi")
        except ImportError as e:
            print("utensil cannot be loaded (%s): loading only" % e)
            train = False
    r = run(a.images, a.classes, a.size, a.batch, workers, a.epochs, a.device, a.threads,
            a.width, a.augment, train, a.dir, cached, a.step_ms)
    print("%d PNGs of %dx%d, batch %d%s; %d CPUs" % (
        r["images"], a.size, a.size, a.batch, ", augmented" if a.augment else "",
        len(os.sched_getaffinity(0))))
    print("load only (img/s):  " + "  ".join("%s %.0f" % kv for kv in r["load"].items()))
    print("batches bitwise equal across worker counts: %s" % r["same_batches"])
    if r["load_cpu_us"] is not None:
        print("reading a file (decode + transform) costs %.0f us of CPU time per image"
              % r["load_cpu_us"])
    if r["parent_us"]:
        print("this process's CPU time per batch from workers (us), views / copies:  "
              + "  ".join("%s %.0f / %.0f" % (f, v["view"], v["copy"])
                          for f, v in r["parent_us"].items()))
    if r["epoch_start_ms"]:
        print("wait for an epoch's first batch / for a batch inside it (ms, median), the "
              "consumer taking %g ms per batch:  " % a.step_ms
              + "  ".join("%s %.1f / %.1f" % (f, v[0], v[1])
                          for f, v in r["epoch_start_ms"].items()))
    if train:
        base = r["train"]["memory"]
        print("training %s, mobilenet width %d (img/s, median of %d epochs):"
              % (a.device if a.device == "cuda" else "cpu %d threads" % a.threads, a.width,
                 a.epochs))
        for f, rate in r["train"].items():
            print("  %-12s %8.0f  %5.1f%% of in-memory" % (f, rate, 100.0 * rate / base))
        if a.device == "cpu" and r["load_cpu_us"] is not None:
            # on a CPU that training saturates, decoding takes its CPU time from training
            # whatever the worker count; this bound holds however busy the machine is
            t = r["train_cpu_us"]
            print("training costs %.0f us of CPU time per image: on a saturated CPU the folder "
                  "can reach %.1f%% of in-memory" % (t, 100.0 * t / (t + r["load_cpu_us"])))
    return r


if __name__ == "__main__":
    main()
