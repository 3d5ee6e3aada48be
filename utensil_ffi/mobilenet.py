"""A depthwise-separable (MobileNet-style) classifier built only from utensil layers.

    net = build_mobilenet(in_channels=1, num_classes=10, width=16, device="cpu")

The network is one flat ``Sequential`` (so its layers have stable integer names)::

    stem:   Conv2d 3x3 (stride 1, padding 1, no bias) -> BatchNorm2d -> ReLU6
    block:  DWConv2d 3x3 (stride s, padding 1, no bias) -> BatchNorm2d -> ReLU6
            -> Conv2d 1x1 (no bias) -> BatchNorm2d -> ReLU6             (one per entry of blocks)
    head:   GlobalAvgPool2d -> Linear(channels, num_classes)

``blocks`` lists ``(channel multiplier, stride)`` pairs: a block's output channel count is
``multiplier * width``. Convolutions followed by BatchNorm carry no bias, as in MobileNet.

Helpers:

- ``state_dict(net)`` / ``load_state_dict(net, state)``: every parameter and BatchNorm running
  statistic as float32 numpy arrays keyed ``"<layer index>.<name>"`` (``"0.weight"``,
  ``"1.running_var"``...) — the same keys PyTorch's ``nn.Sequential.state_dict()`` uses.
- ``to_torch(net)``: the same architecture as a ``torch.nn.Sequential`` holding a copy of the
  same weights (depthwise kernels reshaped to PyTorch's ``[C, 1, kh, kw]``); needs torch.
"""

import numpy as np

from .layers import (
    BatchNorm2d,
    Conv2d,
    DWConv2d,
    GlobalAvgPool2d,
    Linear,
    ReLU6,
    Sequential,
)

__all__ = [
    "DEFAULT_BLOCKS",
    "build_mobilenet",
    "block_channels",
    "state_dict",
    "load_state_dict",
    "to_torch",
    "count_parameters",
    "compare_with_torch",
]

# (channel multiplier, stride) per depthwise-separable block; one stride 2: 8x8 digits end at 4x4.
DEFAULT_BLOCKS = ((2, 1), (2, 1), (4, 2), (4, 1))


def block_channels(width, blocks=DEFAULT_BLOCKS):
    """[(in_channels, out_channels, stride)] for each block of a network of this width."""
    out = []
    c = width
    for mult, stride in blocks:
        o = int(mult) * width
        out.append((c, o, int(stride)))
        c = o
    return out


def build_mobilenet(in_channels=1, num_classes=10, width=16, blocks=DEFAULT_BLOCKS,
                    device="cpu", bn_momentum=0.1, bn_eps=1e-5):
    """The classifier as a flat Sequential; weights come from the library RNG (see ut.seed)."""
    if int(width) < 1:
        raise ValueError("width must be >= 1, got %r" % (width,))
    if not blocks:
        raise ValueError("the network needs at least one block")
    width = int(width)

    def bn(c):
        return BatchNorm2d(c, eps=bn_eps, momentum=bn_momentum, device=device)

    layers = [Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False, device=device),
              bn(width), ReLU6()]
    c = width
    for cin, cout, stride in block_channels(width, blocks):
        layers += [
            DWConv2d(cin, 3, stride=stride, padding=1, bias=False, device=device), bn(cin), ReLU6(),
            Conv2d(cin, cout, 1, bias=False, device=device), bn(cout), ReLU6(),
        ]
        c = cout
    layers += [GlobalAvgPool2d(), Linear(c, num_classes, device=device)]
    return Sequential(*layers)


def _named_tensors(net):
    """(key, Tensor) for every parameter and BatchNorm running statistic of a flat Sequential."""
    for i, layer in enumerate(net):
        for p in layer.parameters():
            yield "%d.%s" % (i, p.name), p
        if isinstance(layer, BatchNorm2d):
            yield "%d.running_mean" % i, layer.running_mean
            yield "%d.running_var" % i, layer.running_var


def named_parameters(net):
    """[(key, Parameter)] in the order of ``net.parameters()``."""
    return [("%d.%s" % (i, p.name), p) for i, layer in enumerate(net) for p in layer.parameters()]


def state_dict(net):
    """{key: float32 numpy copy} of every parameter and BatchNorm running statistic."""
    return {k: np.array(t.numpy(), dtype=np.float32, copy=True) for k, t in _named_tensors(net)}


def load_state_dict(net, state, strict=True):
    """Copy arrays from ``state`` into the network's tensors (in place, on any device)."""
    expected = dict(_named_tensors(net))
    if strict:
        missing = sorted(set(expected) - set(state))
        extra = sorted(set(state) - set(expected))
        if missing or extra:
            raise KeyError("state does not match the network: missing %s, unexpected %s"
                           % (missing or "none", extra or "none"))
    for k, t in expected.items():
        if k not in state:
            continue
        arr = np.asarray(state[k])
        if arr.shape != t.shape:
            raise ValueError("%s: shape %s in the state, %s in the network" % (k, arr.shape, t.shape))
        t.copy_from(arr)


def count_parameters(net):
    return sum(p.size for p in net.parameters())


def to_torch(net, dtype=None):
    """A torch.nn.Sequential with the same layers and a copy of ``net``'s weights (CPU).

    Layer indices match, so ``torch_net.state_dict()`` keys equal ``state_dict(net)`` keys (plus
    BatchNorm's ``num_batches_tracked``). ``dtype`` defaults to torch.float32.
    """
    import torch
    from torch import nn

    class GlobalAvgPool(nn.Module):
        def forward(self, x):
            return x.mean(dim=(2, 3))

    dtype = dtype or torch.float32
    mods = []
    for layer in net:
        if isinstance(layer, DWConv2d):
            c = layer.channels
            m = nn.Conv2d(c, c, layer.kernel_size, stride=layer.stride, padding=layer.padding,
                          groups=c, bias=layer.bias is not None)
        elif isinstance(layer, Conv2d):
            m = nn.Conv2d(layer.in_channels, layer.out_channels, layer.kernel_size,
                          stride=layer.stride, padding=layer.padding, bias=layer.bias is not None)
        elif isinstance(layer, BatchNorm2d):
            m = nn.BatchNorm2d(layer.num_features, eps=layer.eps, momentum=layer.momentum)
        elif isinstance(layer, ReLU6):
            m = nn.ReLU6()
        elif isinstance(layer, GlobalAvgPool2d):
            m = GlobalAvgPool()
        elif isinstance(layer, Linear):
            m = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
        else:
            raise TypeError("to_torch: no PyTorch equivalent for %r" % (layer,))
        mods.append(m)
    tnet = nn.Sequential(*mods).to(dtype)
    own = tnet.state_dict()
    with torch.no_grad():
        for k, arr in state_dict(net).items():
            own[k].copy_(torch.from_numpy(arr.reshape(tuple(own[k].shape))).to(dtype))
    tnet.train(net.training)
    return tnet


def compare_with_torch(device="cpu", width=32, batch_size=64, epochs=3, threads=None, seed=0):
    """Training images/s of this network in utensil and in PyTorch, on the digits.

    Both start from the same weights and see the same batches (Adam, lr 1e-2); epochs alternate
    between the two so a change of machine load hits both alike. The first epoch of each is a
    warm-up and not counted. Returns {"utensil": [img/s per epoch], "torch": [...] or None,
    "loss": {...: last epoch's mean train loss}}. Run it as ``python -m utensil_ffi.mobilenet``.
    """
    import time

    from . import data as _data
    from .optim import Adam
    from .tensor import seed as _seed, set_num_threads, get_num_threads
    from .train import train_epoch, _Progress

    try:
        import torch
    except ImportError:
        torch = None
    old_threads = get_num_threads()
    old_torch_threads = torch.get_num_threads() if torch is not None else None
    if threads:
        set_num_threads(threads)
        if torch is not None:
            torch.set_num_threads(threads)
    ds = _data.load_digits()
    _seed(seed)
    net = build_mobilenet(ds.in_channels, ds.num_classes, width, device=device)
    opt = Adam(net.parameters(), lr=1e-2)
    tdev = device if torch is not None and (device == "cpu" or torch.cuda.is_available()) else None
    tnet = to_torch(net).to(tdev) if tdev else None
    topt = torch.optim.Adam(tnet.parameters(), lr=1e-2) if tnet is not None else None
    rates = {"utensil": [], "torch": [] if tnet is not None else None}
    loss = {}
    try:
        for e in range(epochs + 1):
            lo, n, s = train_epoch(net, opt, ds.x_train, ds.y_train, batch_size, seed, e, device,
                                   _Progress(0, "", False))
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
        set_num_threads(old_threads)
        if torch is not None:
            torch.set_num_threads(old_torch_threads)
    rates["loss"] = loss
    return rates


def _main(argv=None):
    import argparse

    p = argparse.ArgumentParser(prog="python -m utensil_ffi.mobilenet",
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
    raise SystemExit(_main())
