"""SyncBatchNorm: batch normalization whose training statistics are those of every rank's batch.

Data-parallel training splits each batch over the GPUs; with small per-GPU batches the
per-rank statistics are noisy and training diverges from the one-GPU run. SyncBatchNorm sums
the per-channel moments over the ranks (two all-reduces of C + 1 floats in forward, one of
2 C + 1 in backward, done by the C core: ``ut_batchnorm2d_forward_sync``), so every rank
normalizes with the statistics of the whole global batch, as one process would.
"""

from .._errors import ArgumentTypeError
from .._lib import ffi, lib
from .module import Module
from .norm import BatchNorm2d

__all__ = ["SyncBatchNorm"]

_NULL = ffi.NULL


class SyncBatchNorm(BatchNorm2d):
    """:class:`BatchNorm2d` with the training statistics of every rank in ``process_group``.

    ``process_group`` is a :class:`utensil_ffi.distributed.ProcessGroup` (the sums go straight
    from C to NCCL) or any object with ``all_reduce(tensor, op="sum")`` (called from C with a
    tensor on the layer's device); None: this process alone, as BatchNorm2d. Every rank must run
    the same SyncBatchNorm layers in the same order. Eval mode uses the running statistics
    (which stay equal on every rank: each applies the same global statistics). The state_dict
    is BatchNorm2d's; pickling and copying keep the layer but not its group (set
    ``process_group`` again).
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, device="cpu", activation=None,
                 process_group=None):
        super().__init__(num_features, eps, momentum, device, activation)
        self.process_group = process_group

    @property
    def process_group(self):
        return getattr(self, "_sync_group", None)

    @process_group.setter
    def process_group(self, group):
        if group is not None and not callable(getattr(group, "all_reduce", None)):
            raise ArgumentTypeError("SyncBatchNorm: process_group must be a ProcessGroup or have "
                                    "all_reduce(tensor, op), got %s" % type(group).__name__)
        self._sync_group = group
        self._sync_fn, self._sync_ctx, self._sync_error = _NULL, _NULL, None
        if group is None:
            return
        ptr = getattr(group, "_p", None)
        if ptr is not None and ffi.typeof(ptr) is ffi.typeof("ut_dist *"):
            # a ProcessGroup: C calls NCCL itself, no Python on the way
            self._sync_fn, self._sync_ctx = ffi.addressof(lib, "ut_dist_sum"), ptr
            return
        self._sync_fn = ffi.callback("int(void *, ut_tensor *)", self._reduce_in_python,
                                     onerror=self._reduce_failed)

    def _reduce_in_python(self, ctx, t):
        from ..tensor import Tensor

        with Tensor._borrow(t) as view:
            self._sync_group.all_reduce(view, "sum")
        return 0

    def _reduce_failed(self, exc_type, exc, tb):
        self._sync_error = exc
        return lib.UT_ERR_ARG

    def _c_forward(self, s, xp, c):
        self._sync_error = None
        p = lib.ut_batchnorm2d_forward_sync(s, xp, c, self._sync_fn, self._sync_ctx)
        self._raise_group_error(p)
        return p

    def _c_backward(self, s, c, gp, dW, db):
        self._sync_error = None
        p = lib.ut_batchnorm2d_backward_sync(s, c, gp, dW, db, self._sync_fn, self._sync_ctx)
        self._raise_group_error(p)
        return p

    def _raise_group_error(self, p):
        err, self._sync_error = self._sync_error, None
        if p == _NULL and err is not None:
            raise err

    def _describe(self):
        return super()._describe() + (", synced" if self.process_group is not None else "")

    @classmethod
    def convert_sync_batchnorm(cls, module, process_group=None):
        """Make every BatchNorm2d in ``module`` (itself included) a SyncBatchNorm over
        ``process_group``, in place, keeping its parameters, buffers and activation (optimizers
        made earlier still hold the same tensors); returns ``module`` (PyTorch's name)."""
        if not isinstance(module, Module):
            raise ArgumentTypeError("convert_sync_batchnorm: expected a Module, got %s"
                                    % type(module).__name__)
        for m in module.modules():
            if isinstance(m, BatchNorm2d):
                if not isinstance(m, SyncBatchNorm):
                    m.__class__ = cls  # the same C struct and tensors; a new forward/backward
                m.process_group = process_group
        return module
