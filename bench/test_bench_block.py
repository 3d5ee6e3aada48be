"""One MobileNet-block training step, utensil against the identical torch.nn block.

dw kxk (stride s, padding k//2, no bias) -> BatchNorm2d -> ReLU6 -> pw 1x1 C->C (no bias)
-> BatchNorm2d -> ReLU6, MSE loss against a fixed target, backward through everything
(including dx of the block input), SGD momentum 0.9 step. Both sides start from the same
weights; the utensil case is checked against torch after one step (loss, dx, weight grads,
updated weights). Shapes: the issue's (N, C, H, W, k, stride).
"""

import pytest


@pytest.mark.bench_op("block")
def test_block_train_step(run_case):
    run_case()
