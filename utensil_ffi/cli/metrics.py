"""utensil-train's accuracy: whether a sample's label is among its k best logits.

Strict, so that a broken model cannot score: a tie with the label's logit counts against it
(equal logits, as a diverged or untrained network gives, are no prediction), and a row with a NaN
counts as wrong (numpy's comparisons with NaN are False, which would otherwise put a NaN label
logit first, and argmax picks a NaN). Top-1 and top-5 follow the same rule.
"""

import numpy as np

__all__ = ["topk_correct"]


def topk_correct(logits, labels, k):
    """bool [N]: True where fewer than ``k`` classes other than the label have a logit >= the
    label's, and the row holds no NaN. ``logits`` [N, K], ``labels`` [N] integers."""
    z = np.asarray(logits)
    y = np.asarray(labels, dtype=np.int64)
    mine = z[np.arange(len(y)), y]
    rivals = (z >= mine[:, None]).sum(axis=1) - 1  # the label's own logit is >= itself
    return (rivals < k) & ~np.isnan(z).any(axis=1)
