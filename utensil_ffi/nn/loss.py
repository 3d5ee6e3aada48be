"""Losses with a backward: MSELoss and CrossEntropyLoss (``loss = crit(pred, target)``, then
``grad = crit.backward()``)."""

from .. import functional as _F
from .._errors import ArgumentError
from ..tensor import Tensor
from .module import _kept

__all__ = ["MSELoss", "CrossEntropyLoss"]


class _Loss:
    """A loss with backward: ``loss = crit(pred, target)`` then ``grad = crit.backward()``."""

    _fwd = _bwd = None

    def __init__(self):
        self._saved = None

    def __call__(self, pred, target):
        return self.forward(pred, target)

    def forward(self, pred, target):
        out = self._fwd(pred, target)
        self.close()
        keep_p = _kept(pred, out)
        keep_t = _kept(target, out) if isinstance(target, Tensor) else target  # labels stay ints
        self._saved = (keep_p, keep_t)
        return out

    def __getstate__(self):
        # copy, deepcopy and pickle: the loss without the last call's saved inputs
        state = dict(vars(self))
        state["_saved"] = None
        return state

    def backward(self):
        """The gradient of the last loss with respect to ``pred``."""
        if self._saved is None:
            raise ArgumentError("%s.backward: call the loss first" % type(self).__name__)
        return self._bwd(*self._saved)

    def close(self):
        if self._saved is not None:
            for t in self._saved:
                if isinstance(t, Tensor):
                    t.close()
            self._saved = None


class MSELoss(_Loss):
    """mean((pred - target)^2); backward: 2 (pred - target) / pred.size."""

    _fwd = staticmethod(_F.mse_loss)
    _bwd = staticmethod(_F.mse_loss_backward)


class CrossEntropyLoss(_Loss):
    """Mean of -log softmax(logits)[label]; labels are integer class indices.

    label_smoothing (torch.nn.CrossEntropyLoss's, in [0, 1]): the target becomes (1 - eps)
    onehot + eps / K (see functional.cross_entropy)."""

    label_smoothing = 0.0  # what a loss pickled before issue 30 has

    def __init__(self, label_smoothing=0.0):
        super().__init__()
        self.label_smoothing = _F._label_smoothing(label_smoothing)

    def _fwd(self, pred, target):
        return _F.cross_entropy(pred, target, self.label_smoothing)

    def _bwd(self, pred, target):
        return _F.cross_entropy_backward(pred, target, self.label_smoothing)

    def __repr__(self):
        if self.label_smoothing:
            return "CrossEntropyLoss(label_smoothing=%g)" % self.label_smoothing
        return "CrossEntropyLoss()"
