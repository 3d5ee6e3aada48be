"""Sequential built from an OrderedDict, as torch's: children named by its keys (state_dict
keys, attribute access, repr), still indexed by position; copies and pickles keep the names;
forward and backward as a Sequential of the same layers."""

import copy
import pickle
from collections import OrderedDict

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi.nn import Sequential


def _named(seed=0):
    ut.seed(seed)
    return Sequential(OrderedDict([
        ("conv", ut.Conv2d(2, 3, 3, padding=1)),
        ("bn", ut.BatchNorm2d(3)),
        ("act", ut.ReLU()),
        ("pool", ut.GlobalAvgPool2d()),
        ("fc", ut.Linear(3, 4)),
    ]))


def test_names_are_the_keys_in_state_dict_and_attributes():
    net = _named()
    assert [k for k, _ in net.named_children()] == ["conv", "bn", "act", "pool", "fc"]
    assert list(net.state_dict()) == [
        "conv.weight", "conv.bias", "bn.weight", "bn.bias", "bn.running_mean",
        "bn.running_var", "bn.num_batches_tracked", "fc.weight", "fc.bias"]
    assert net.conv is net[0] and net.fc is net[-1] and net.bn is net[1]
    assert len(net) == 5 and list(net) == net.layers
    assert [k for k, _ in net.named_parameters()][:2] == ["conv.weight", "conv.bias"]
    with pytest.raises(AttributeError):
        net.nothing
    r = repr(net)
    assert "(conv): Conv2d(" in r and "(fc): Linear(" in r


def test_names_may_skip_indices_and_nest():
    inner = Sequential(OrderedDict([("0", ut.Conv2d(2, 2, 1)), ("2", ut.BatchNorm2d(2))]))
    net = Sequential(OrderedDict([("features", inner), ("head", ut.GlobalAvgPool2d())]))
    assert list(net.state_dict())[:3] == ["features.0.weight", "features.0.bias",
                                          "features.2.weight"]
    assert net.features is inner
    # the default names stay "0", "1", ...: a dict with those keys is a plain Sequential
    plain = Sequential(OrderedDict([("0", ut.ReLU()), ("1", ut.ReLU())]))
    assert repr(plain) == repr(Sequential(ut.ReLU(), ut.ReLU()))


def test_forward_backward_match_the_unnamed_sequential(rng):
    a, b = _named(1), _named(1)
    plain = Sequential(*b.layers)
    x = rng.normal(0, 1, (2, 2, 5, 5)).astype(np.float32)
    g = rng.normal(0, 1, (2, 4)).astype(np.float32)
    ya, yb = a(x), plain(x)
    np.testing.assert_array_equal(ya.numpy(), yb.numpy())
    dxa, dxb = a.backward(ut.tensor(g)), plain.backward(ut.tensor(g))
    np.testing.assert_array_equal(dxa.numpy(), dxb.numpy())
    for pa, pb in zip(a.parameters(), plain.parameters()):
        np.testing.assert_array_equal(pa.grad.numpy(), pb.grad.numpy())


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_keep_the_names(rng, how):
    net = _named(2)
    net.eval()
    c = copy.deepcopy(net) if how == "deepcopy" else pickle.loads(pickle.dumps(net))
    assert [k for k, _ in c.named_children()] == [k for k, _ in net.named_children()]
    assert c.fc is c[-1] and c.fc is not net.fc
    x = rng.normal(0, 1, (2, 2, 4, 4)).astype(np.float32)
    np.testing.assert_array_equal(c(x).numpy(), net(x).numpy())
    c.load_state_dict(net.state_dict())


def test_bad_names_are_refused():
    with pytest.raises(ut.ArgumentTypeError):
        Sequential(OrderedDict([(0, ut.ReLU())]))
    with pytest.raises(ut.ArgumentError):
        Sequential(OrderedDict([("a.b", ut.ReLU())]))
    with pytest.raises(ut.ArgumentError):
        Sequential(OrderedDict([("", ut.ReLU())]))
    with pytest.raises(ut.ArgumentTypeError, match="item x"):
        Sequential(OrderedDict([("x", 3)]))
