"""utensil next to other frameworks. Nothing is imported here: each module needs its framework.

    torch.py        the utensil::depthwise_conv2d op, DepthwiseConv2d and convert() inside a
                    PyTorch model: ``import utensil_ffi.interop.torch as utt`` (needs PyTorch)
    onnx_export.py  a utensil model as an ONNX file (needs onnx)

DLPack, the zero-copy exchange every framework speaks, is the Tensor's own (utensil_ffi.dlpack).
"""
