"""--image-size against the machine: a size whose one batch of input images cannot be held in
this machine's memory is refused before anything is decoded (else numpy's MemoryError, or
an allocation that swaps for minutes, ends the run later)."""

import os

__all__ = ["image_size_problem", "physical_memory"]

_CHANNELS = 3  # a folder's images are decoded as RGB
_FLOAT32 = 4


def physical_memory():
    """Bytes of memory this machine has, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def image_size_problem(image_size, batch_size, eval_batch_size=0, memory=None):
    """Why ``--image-size`` cannot work with these batch sizes here (None if it may): the larger
    batch of float32 RGB inputs, batch * 3 * size * size * 4 bytes, must fit in the physical
    memory (the network's activations need several times more, so this is a floor, not a
    promise)."""
    if image_size is None:
        return None
    memory = physical_memory() if memory is None else memory
    if not memory:
        return None
    batch, flag = max((batch_size, "--batch-size"), (eval_batch_size, "--eval-batch-size"))
    need = batch * _CHANNELS * image_size * image_size * _FLOAT32
    if need <= memory:
        return None
    return ("--image-size %d: one batch of %d images (%s) of 3x%dx%d float32 takes %s, more "
            "than this machine's memory (%s); use a smaller --image-size (or %s)"
            % (image_size, batch, flag, image_size, image_size, _gib(need), _gib(memory), flag))


def _gib(n):
    return "%.1f GiB" % (n / 2.0 ** 30)
