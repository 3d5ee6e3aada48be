"""Depthwise convolution over every filter shape kh, kw in 1..7 (square or not), stride 1..3 and
dilation 1..2 (issue 31: no slow shape). On the GPU these take the general strip kernels
(native/cuda/dw_general.cu: the filter width and the stride compiled in, the height and the
dilation not), except 3x3, 5x5 and 7x7 undilated, which keep their own kernels; on the CPU
they check the same rules.

Each of the 49 (kh, kw) pairs runs once, on planes large enough for several items per row
and several strips per plane (and a row band that ends part-way through a strip), stride,
dilation and padding cycling so that every (stride, dilation) pair meets every filter height
and every filter width. Forward, dx, dW and db against the float64 reference (backward twice:
gradients accumulate), then inf/NaN placed in x, the weights and grad_out against the sums
over real (output, tap, input) pairs. The helpers are test_dw_dilation_multiplier.py's.
"""

import itertools

from test_dw_dilation_multiplier import _check_geometry, _each, _gid, _nonfinite_case, _out

SIZES = range(1, 8)
STRIDE_DIL = list(itertools.product((1, 2, 3), (1, 2)))


def _geoms():
    """(N, C, multiplier, H, W, (kh, kw), stride, pad, dilation, bias) per (kh, kw)."""
    out = []
    for i, (kh, kw) in enumerate(itertools.product(SIZES, SIZES)):
        s, d = STRIDE_DIL[(kh + kw) % len(STRIDE_DIL)]
        p = (kh + kw + i) % 4
        h = d * (kh - 1) + 1 + 11 + (i % 5)
        w = d * (kw - 1) + 1 + 9 + (i % 7)
        out.append((2, 3, 1, h, w, (kh, kw), s, p, d, i % 3 != 2))
    return out


GEOMS = _geoms()


def test_geometries_cover_every_height_and_width_at_every_stride_and_dilation():
    seen_h = {(g[5][0], g[6], g[8]) for g in GEOMS}
    seen_w = {(g[5][1], g[6], g[8]) for g in GEOMS}
    want = {(k, s, d) for k in SIZES for s, d in STRIDE_DIL}
    assert want - seen_h == set() and want - seen_w == set()
    for n, c, m, h, w, (kh, kw), s, p, d, _ in GEOMS:
        assert _out(h, kh, s, p, d) >= 4 and _out(w, kw, s, p, d) >= 3


def test_every_kernel_shape_matches_reference(device):
    _each([(_gid(g), g) for g in GEOMS], _check_geometry(device, GEOMS.index))


def test_every_kernel_shape_bf16_matches_reference(device):
    """bf16 activations over the same shapes: the float32 answer on the bf16-rounded inputs
    (test_bf16_depthwise.py's rule), within bf16's rounding of the outputs."""
    import numpy as np

    import utensil_ffi as ut
    from tolerances import assert_close
    from utensil_ffi import reference as R

    def check(g):
        n, c, m, h, w, (kh, kw), s, p, d, bias = g
        rng = np.random.default_rng(GEOMS.index(g))
        x = ut.tensor(rng.standard_normal((n, c, h, w)).astype(np.float32), device, ut.bfloat16)
        go = ut.tensor(rng.standard_normal((n, c, _out(h, kh, s, p, d), _out(w, kw, s, p, d)))
                       .astype(np.float32), device, ut.bfloat16)
        xr, gr = x.numpy().astype(np.float64), go.numpy().astype(np.float64)
        with ut.DWConv2d(c, (kh, kw), stride=s, padding=p, bias=bias, device=device,
                         dilation=d) as layer:
            wt = layer.weight.numpy().astype(np.float64)
            b = layer.bias.numpy().astype(np.float64) if bias else None
            y = layer(x)
            dx = layer.backward(go)
            assert_close("bf16 forward", y.numpy().astype(np.float64),
                         R.dwconv2d(xr, wt, b, s, p, d), rtol=1e-2, atol=1e-2)
            rdx, rdw, _ = R.dwconv2d_backward(xr, wt, s, p, gr, d)
            assert_close("bf16 dx", dx.numpy().astype(np.float64), rdx, rtol=1e-2, atol=1e-2)
            assert_close("bf16 dW", layer.weight.grad.numpy(), rdw, rtol=1e-4, atol=1e-4)

    _each([(_gid(g), g) for g in GEOMS[::3]], check)


def test_every_kernel_shape_nonfinite_only_through_real_pairs(device):
    """One geometry in four, inf/NaN in x (read and unread), the weights and grad_out."""
    cases = []
    for g in GEOMS[1::4]:
        n, c, m, h, w, k, s, p, d, _ = g
        geom = (c, m, h, w, k, s, p, d)
        for site in ("x-read", "w", "go"):
            cases.append(("%s %s" % (site, _gid(g)), (geom, site)))
    _each(cases, lambda case: _nonfinite_case(device, *case))
