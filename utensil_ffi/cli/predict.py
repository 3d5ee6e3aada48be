"""utensil-predict: the classes a utensil-train checkpoint sees in image files.

    utensil-predict utensil_checkpoint.npz cat.jpg dog.png --top-k 3

Each image is prepared as training's evaluation saw its data: converted to grayscale or RGB as
the network's input channels ask, then put through the evaluation transform the checkpoint
records (an image folder's: resized, center-cropped, scaled to [0, 1] and normalized with the
training images' per-channel mean and std, exactly as training evaluated). A checkpoint without
that record (trained on arrays, or written before it was kept) gets the old rule: resized
(shorter side) and center-cropped to the trained size when square, else stretched to it, then
normalized with the mean and std recorded. (The digits and image folders are [0, 1] images, so a photo is prepared as they
were; a network trained on a .npz of another scale expects that scale.) Prints one line per
image: the top-k classes (their folder names when trained on an image folder) with their
softmax probabilities. A file that cannot be read is reported and skipped; the exit status is 1
if any was. Needs Pillow (``pip install 'utensil-ffi[images]'``).
"""

import argparse
import sys

import numpy as np

from .._errors import UtensilError
from ..data import DataError
from .checkpoint import CheckpointError

__all__ = ["main", "PROG", "prepare", "predict"]

PROG = "utensil-predict"


def prepare(path, data_info):
    """The image at ``path`` as a float32 [C, H, W] array, prepared as in training."""
    from ..data import transforms as T
    from ..data.images import eval_transform, open_image

    c, h, w = data_info["image_shape"]
    img = open_image(path, "L" if c == 1 else "RGB")
    spec = data_info.get("eval_transform")
    if spec:
        try:
            transform = eval_transform(spec)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError("the checkpoint's evaluation transform %r is malformed (%s)"
                                  % (spec, e)) from None
        return transform(img)
    steps = [T.Resize(h), T.CenterCrop(h)] if h == w else [T.Resize((h, w))]
    steps.append(T.ToArray())
    if data_info.get("mean") is not None:
        steps.append(T.Normalize(data_info["mean"], data_info["std"]))
    return T.Compose(steps)(img)


def predict(net, batch, device="cpu"):
    """Softmax probabilities [N, classes] of ``net`` (eval mode) for a float32 batch."""
    from ..tensor import tensor

    with tensor(batch, device) as x:
        logits = net(x)
        try:
            z = logits.numpy().astype(np.float64)
        finally:
            logits.close()
    z -= z.max(axis=1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(axis=1, keepdims=True)


def main(argv=None, out=None):
    out = out or sys.stdout
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a checkpoint written by utensil-train")
    p.add_argument("images", nargs="+", help="image files (PNG, JPEG, ...)")
    p.add_argument("--top-k", type=int, default=5, help="classes to print per image (default 5)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the network runs (default cpu; cuda needs a CUDA build and GPU)")
    a = p.parse_args(argv)
    if a.top_k < 1:
        p.error("--top-k must be at least 1, got %d" % a.top_k)
    from .export import load_network

    try:
        net, meta = load_network(a.checkpoint, a.device)
    except (CheckpointError, UtensilError) as e:
        print("%s: error: %s" % (PROG, e), file=sys.stderr)
        return 2
    info = meta["data_info"]
    names = info.get("class_names") or [str(i) for i in range(info["num_classes"])]
    failed = 0
    try:
        for path in a.images:
            try:
                x = prepare(path, info)[None]
            except DataError as e:
                print("%s: error: %s" % (PROG, e), file=sys.stderr)
                failed += 1
                continue
            except CheckpointError as e:  # no image can be prepared: stop
                print("%s: error: %s: %s" % (PROG, a.checkpoint, e), file=sys.stderr)
                return 2
            probs = predict(net, x, a.device)[0]
            top = np.argsort(-probs, kind="stable")[:a.top_k]
            print("%s: %s" % (path, "  ".join("%s %.4f" % (names[i], probs[i]) for i in top)),
                  file=out, flush=True)
    finally:
        net.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
