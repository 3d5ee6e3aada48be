"""profile_modules.py: exclusive times that add up to the step, and the network's classes left
as they were."""

import utensil_ffi as ut
from utensil_ffi import nn

import profile_modules as pm


def test_exclusive_times_add_up_and_methods_come_back():
    before = {(c, a): c.__dict__.get(a) for c in type.mro(nn.Conv2d) for a in pm.PHASES}
    per, timed, plain = pm.profile("v1", size=32, batch=2, threads=1, steps=2)
    assert timed > 0 and plain > 0
    assert per[("Conv2d", "forward")] > 0 and per[("DWConv2d", "backward")] > 0
    assert per[("SGD", "step")] > 0 and per[("SGD", "zero_grad")] > 0
    # exclusive: the parts cannot exceed the step they were measured in; the Python outside
    # the modules (the loss, the loop) is all that is left out
    total = sum(per.values())
    assert 0.5 * timed < total <= timed * 1.01
    assert {(c, a): c.__dict__.get(a) for c in type.mro(nn.Conv2d) for a in pm.PHASES} == before
    with nn.Conv2d(2, 3, 1) as layer:  # an untimed layer still runs
        assert layer(ut.zeros((1, 2, 4, 4))).shape == (1, 3, 4, 4)
