"""Data: data sets, image folders, their transforms, and the batch loader.

    from utensil_ffi import data                    # the data sets below, as before the split
    from utensil_ffi.data import images, transforms as T
    from utensil_ffi.data.loader import Loader

    datasets.py    the embedded digits and .npz files as a Dataset; batches(), the epoch order
                   (its names are this package's own: data.load_npz, data.DataError, ...)
    images.py      image folders (torchvision's ImageFolder layout), decoded with Pillow
    transforms.py  their augmentations, random only through the caller's Generator
    loader.py      batches decoded by worker processes, in utensil-train's order
    shm_ring.py    the shared memory the loader's workers hand batches over in
"""

# every name the module utensil_ffi.data had before it became this package (KEYS, LAYOUTS too)
from .datasets import (
    EXTRA_HINT,
    KEYS,
    LAYOUTS,
    DataError,
    Dataset,
    batches,
    load_digits,
    load_npz,
    stratified_split,
)

__all__ = ["DataError", "Dataset", "load_digits", "load_npz", "batches", "stratified_split",
           "EXTRA_HINT"]
