"""utensil-export: a utensil-train checkpoint as an ONNX model, checked against onnxruntime.

    utensil-export utensil_checkpoint.npz model.onnx
    utensil-export ckpt.npz model.onnx --opset 17 --no-check

The network is rebuilt from the checkpoint's settings (``--arch``, widths, the data's image
shape and class count), its weights loaded (the EMA's when the run kept one, ``--ema``: they
are what it evaluated), and its eval-mode forward written as ONNX (input
``"input"`` [batch, C, H, W] float32, normalized as in training; output ``"output"`` the logits).
Unless ``--no-check``, onnxruntime (when installed) runs the file on random inputs and the
largest difference from utensil's own forward is printed; above ``--tolerance`` (1e-4) the
program fails and removes nothing it did not write: the file stays for inspection. Needs the
``onnx`` package (``pip install 'utensil-ffi[onnx]'``).
"""

import argparse
import sys

import numpy as np

from .._errors import UtensilError
from .checkpoint import CheckpointError, ema_weights, load_checkpoint
from .paths import writable_file_problem
from .train import build_network

__all__ = ["main", "PROG", "load_network"]

PROG = "utensil-export"


def load_network(path, device="cpu"):
    """(network in eval mode with the checkpoint's weights, checkpoint metadata); the weights
    are the EMA's when the checkpoint holds one (``meta["weights"]`` says which: "ema" or
    "model")."""
    meta, model_state, _, ema_state = load_checkpoint(path, with_ema=True)
    meta["weights"] = "model"
    if ema_state is not None:
        model_state = ema_weights(ema_state)
        meta["weights"] = "ema"
    info = meta.get("data_info") or {}
    shape, k = info.get("image_shape"), info.get("num_classes")
    if not (isinstance(shape, list) and len(shape) == 3 and isinstance(k, int)):
        raise CheckpointError("%s: the checkpoint does not record the data's image shape and "
                              "class count" % path)
    run = dict(meta.get("run") or {})
    run.setdefault("arch", "digits")
    run.setdefault("width_mult", 1.0)
    net = build_network(run, tuple(shape), k, device)
    try:
        net.load_state_dict(model_state)
    except UtensilError as e:
        net.close()
        raise CheckpointError("%s: the weights do not fit the network: %s" % (path, e)) from None
    net.eval()
    return net, meta


def _max_difference(net, path, shape, batch=4, seed=0):
    import onnxruntime as ort

    from ..tensor import tensor

    x = np.random.default_rng(seed).standard_normal((batch,) + tuple(shape)).astype(np.float32)
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    got = sess.run(["output"], {"input": x})[0]
    with tensor(x, "cpu") as xt:
        want = net(xt)
        try:
            return float(np.max(np.abs(got - want.numpy())))
        finally:
            want.close()


def main(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a checkpoint written by utensil-train")
    p.add_argument("output", help="the ONNX file to write")
    p.add_argument("--opset", type=int, default=17, help="ONNX opset (default 17)")
    p.add_argument("--no-check", action="store_true", help="skip the onnxruntime comparison")
    p.add_argument("--tolerance", type=float, default=1e-4,
                   help="largest allowed difference from utensil's forward (default 1e-4)")
    a = p.parse_args(argv)
    why = writable_file_problem(a.output, create_dirs=False)
    if why:  # before the work: loading, tracing and checking the model take a while
        p.error("%s: cannot write the ONNX file there: %s" % (a.output, why))
    try:
        from ..interop.onnx_export import export_onnx

        net, meta = load_network(a.checkpoint)
        try:
            shape = tuple(meta["data_info"]["image_shape"])
            try:
                export_onnx(net, a.output, (1,) + shape, opset=a.opset)
            except OSError as e:  # its temporary file's name is no help: say which file
                raise OSError("could not write %s: %s" % (a.output, e.strerror or e)) from None
            print("wrote %s: %s, input [batch, %d, %d, %d], %d classes%s" % (
                a.output, meta["run"].get("arch", "digits"), *shape,
                meta["data_info"]["num_classes"],
                ", the EMA of the weights" if meta["weights"] == "ema" else ""))
            if a.no_check:
                return 0
            try:
                import onnxruntime  # noqa: F401
            except ImportError:
                print("not checked: onnxruntime is not installed (pip install onnxruntime)")
                return 0
            diff = _max_difference(net, a.output, shape)
            print("onnxruntime against utensil: max abs difference %.2e" % diff)
            if not diff <= a.tolerance:
                print("%s: error: the exported model differs from utensil's by %.2e (more than "
                      "%g)" % (PROG, diff, a.tolerance), file=sys.stderr)
                return 1
            return 0
        finally:
            net.close()
    except CheckpointError as e:
        print("%s: error: %s" % (PROG, e), file=sys.stderr)
        return 2
    except (ImportError, UtensilError, OSError) as e:
        print("%s: error: %s" % (PROG, e), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
