"""The command-line programs (thin: arguments, progress, files), each a ``main(argv)``.

    train.py       utensil-train          (python -m utensil_ffi.cli.train)
    export.py      utensil-export         a checkpoint as ONNX
    predict.py     utensil-predict        a checkpoint's classes for image files
    train_data.py  what utensil-train trains on: arrays, or an image folder through the loader
    train_dist.py  utensil-train's data-parallel part (--nproc-per-node, ranks, sharing)

Nothing is imported here, so ``python -m utensil_ffi.cli.<program>`` runs each module once.
"""
