"""Training images/s of utensil-train's network in utensil and in PyTorch, on the digits.

    python bench/compare_mobilenet.py [--device cuda] [--width 32] [--epochs 3] [--threads N]

Both start from the same weights (``to_torch``: the same architecture as a ``torch.nn.Sequential``,
loaded with utensil's ``state_dict()`` by PyTorch's ``load_state_dict(strict=True)``) and see the
same batches. Needs torch; scikit-learn for the digits.
"""

import argparse
import os
import sys
import time

import numpy as np

if __name__ == "__main__" and __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import utensil_ffi as ut  # noqa: E402
from utensil_ffi import data as _data  # noqa: E402
from utensil_ffi.cli.train import train_epoch  # noqa: E402
from utensil_ffi.nn import models  # noqa: E402


def _BatchNormAct(*args, **kwargs):
    """torch's BatchNorm2d followed by its .act, with BatchNorm2d's state_dict keys (the twin
    of a fused ut.BatchNorm2d(activation=...))."""
    import torch

    class BatchNormAct(torch.nn.BatchNorm2d):
        def forward(self, x):
            return self.act(super().forward(x))

    return BatchNormAct(*args, **kwargs)


def to_torch(net, dtype=None):
    """A torch.nn.Sequential with the layers of the flat Sequential ``net`` and a copy of its
    weights (CPU): PyTorch's ``load_state_dict(net.state_dict(), strict=True)``, so the indices,
    keys and shapes match. ``dtype`` defaults to torch.float32."""
    import torch
    from torch import nn

    mods = []
    for layer in net:
        if isinstance(layer, ut.DWConv2d):
            c = layer.channels
            m = nn.Conv2d(c, c, layer.kernel_size, stride=layer.stride, padding=layer.padding,
                          groups=c, bias=layer.bias is not None)
        elif isinstance(layer, ut.Conv2d):
            m = nn.Conv2d(layer.in_channels, layer.out_channels, layer.kernel_size,
                          stride=layer.stride, padding=layer.padding, bias=layer.bias is not None)
        elif isinstance(layer, ut.BatchNorm2d) and layer.activation:
            m = _BatchNormAct(layer.num_features, eps=layer.eps, momentum=layer.momentum)
            m.act = nn.ReLU6() if layer.activation == "relu6" else nn.ReLU()
        elif isinstance(layer, ut.BatchNorm2d):
            m = nn.BatchNorm2d(layer.num_features, eps=layer.eps, momentum=layer.momentum)
        elif isinstance(layer, ut.ReLU6):
            m = nn.ReLU6()
        elif isinstance(layer, ut.GlobalAvgPool2d):
            m = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        elif isinstance(layer, ut.Linear):
            m = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
        else:
            raise TypeError("to_torch: no PyTorch equivalent for %r" % (layer,))
        mods.append(m)
    tnet = nn.Sequential(*mods)
    tnet.load_state_dict({k: torch.from_numpy(v) for k, v in net.state_dict().items()},
                         strict=True)
    tnet.train(net.training)
    return tnet.to(dtype or torch.float32)


def compare_with_torch(device="cpu", width=32, batch_size=64, epochs=3, threads=None, seed=0):
    """Training images/s of this network in utensil and in PyTorch, on the digits.

    Both start from the same weights and see the same batches (Adam, lr 1e-2); epochs alternate
    between the two so a change of machine load hits both alike. The first epoch of each is a
    warm-up and not counted. Returns {"utensil": [img/s per epoch], "torch": [...] or None,
    "loss": {...: last epoch's mean train loss}}. Run this file as a script.
    """
    try:
        import torch
    except ImportError:
        torch = None
    old_threads = ut.get_num_threads()
    old_torch_threads = torch.get_num_threads() if torch is not None else None
    if threads:
        ut.set_num_threads(threads)
        if torch is not None:
            torch.set_num_threads(threads)
    ds = _data.load_digits()
    ut.seed(seed)
    net = models.mobilenet(ds.in_channels, ds.num_classes, width, device=device)
    opt = ut.Adam(net.parameters(), lr=1e-2)
    tdev = device if torch is not None and (device == "cpu" or torch.cuda.is_available()) else None
    tnet = to_torch(net).to(tdev) if tdev else None
    topt = torch.optim.Adam(tnet.parameters(), lr=1e-2) if tnet is not None else None
    rates = {"utensil": [], "torch": [] if tnet is not None else None}
    loss = {}
    try:
        for e in range(epochs + 1):
            lo, n, s = train_epoch(net, opt, ds.x_train, ds.y_train, batch_size, seed, e, device)
            loss["utensil"] = lo
            if e:
                rates["utensil"].append(n / s)
            if tnet is None:
                continue
            t0, n, tot = time.perf_counter(), 0, torch.zeros((), device=tdev)
            for idx in _data.batches(len(ds.x_train), batch_size, seed, e):
                xb = torch.from_numpy(ds.x_train[idx]).to(tdev)
                yb = torch.from_numpy(ds.y_train[idx]).to(tdev)
                lt = torch.nn.functional.cross_entropy(tnet(xb), yb)
                topt.zero_grad()
                lt.backward()
                topt.step()
                tot += lt.detach() * len(idx)
                n += len(idx)
            loss["torch"] = float(tot) / n  # waits for the device
            if e:
                rates["torch"].append(n / (time.perf_counter() - t0))
    finally:
        opt.close()
        net.close()
        ut.set_num_threads(old_threads)
        if torch is not None:
            torch.set_num_threads(old_torch_threads)
    rates["loss"] = loss
    return rates


def main(argv=None):
    p = argparse.ArgumentParser(prog="python bench/compare_mobilenet.py",
                                description="training images/s of the utensil-train network: "
                                "utensil vs PyTorch (same weights, same batches)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    r = compare_with_torch(a.device, a.width, a.batch_size, a.epochs, a.threads)
    for name in ("utensil", "torch"):
        if r[name] is None:
            print("%-8s not installed (or no GPU for it)" % name)
            continue
        print("%-8s %s width %d batch %d: %7.0f img/s (median of %d epochs: %s), last train loss "
              "%.4f" % (name, a.device, a.width, a.batch_size, float(np.median(r[name])),
                        len(r[name]), ", ".join("%.0f" % x for x in r[name]), r["loss"][name]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
