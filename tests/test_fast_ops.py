"""`engine.models.fast_ops`: each function against float64 within its stated error, over
any shape and layout, the same unfused, and attention row by row."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import mlx.core as mx
import numpy as np
import pytest

from engine.models import fast_ops

X64 = np.linspace(-40.0, 40.0, 400_001)
ERF = np.vectorize(math.erf)


def _inputs() -> tuple[mx.array, np.ndarray]:
    x = mx.array(X64.astype(np.float32))
    return x, np.array(x).astype(np.float64)  # the float32 inputs, exactly


def _got(fn: Callable[[mx.array], mx.array], x: mx.array) -> np.ndarray:
    return np.array(fn(x)).astype(np.float64)


def test_exp_within_its_stated_error_through_softmax() -> None:
    # A row (0, y), y <= 0: its second weight is e^y / (1 + e^y), e^y as `fast_ops` makes it
    # (within 3e-7), then divided once more (half an ulp).
    y = -np.linspace(0.0, 40.0, 200_001).astype(np.float32)
    rows = mx.array(np.stack([np.zeros_like(y), y], axis=-1))
    e = np.exp(y.astype(np.float64))
    got = np.array(fast_ops.softmax(rows))[:, 1].astype(np.float64)
    want = e / (1 + e)
    near = y > -20.7
    assert np.all(np.abs(got[near] - want[near]) <= 4e-7 * want[near])
    assert np.all(np.abs(got[~near] - want[~near]) <= 1e-9)
    assert np.all(got[y < -21] == 0.0)


@pytest.mark.parametrize(
    ("name", "want", "atol", "rtol"),
    [
        ("sigmoid", lambda x: 1 / (1 + np.exp(-x)), 2e-7, 0.0),
        ("tanh", np.tanh, 2e-7, 0.0),
        ("gelu", lambda x: 0.5 * x * (1 + ERF(x / math.sqrt(2))), 6e-7, 1e-7),
    ],
)
def test_functions_are_within_their_stated_error(
    name: str, want: Callable[[np.ndarray], np.ndarray], atol: float, rtol: float
) -> None:
    x, xr = _inputs()
    np.testing.assert_allclose(_got(getattr(fast_ops, name), x), want(xr), atol=atol, rtol=rtol)


def test_softmax_rows_and_masked_scores() -> None:
    rng = np.random.default_rng(0)
    rows = rng.normal(0, 4, (64, 300))
    rows[:5, ::3] = np.finfo(np.float32).min  # masked keys
    rows[5] = np.finfo(np.float32).min  # a padding row: every key masked
    x = mx.array(rows.astype(np.float32))
    xr = np.array(x).astype(np.float64)
    want = np.exp(xr - xr.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    got = np.array(fast_ops.softmax(x))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)
    assert np.all(got[:5, ::3] == 0.0)
    assert np.allclose(got[5], 1 / 300)


def _layouts() -> Iterator[mx.array]:
    base = mx.random.normal((3, 50, 96), key=mx.random.key(4)) * 6
    yield base
    yield base[..., :48]  # a channel slice, as a WaveNet gate takes
    yield base.transpose(0, 2, 1)
    yield base[0, 0]
    yield mx.random.normal((3, 800, 240), key=mx.random.key(6)) * 6  # taken in blocks
    yield mx.array(np.float32(-0.75))


@pytest.mark.parametrize("name", ["sigmoid", "tanh", "gelu"])
def test_any_shape_and_layout_gives_each_element_its_own_result(name: str) -> None:
    fn = getattr(fast_ops, name)
    for x in _layouts():
        got = np.array(fn(x))
        flat = np.array(fn(mx.array(np.array(x).ravel())))
        assert got.shape == x.shape
        assert np.array_equal(got.ravel(), flat)


def test_the_stages_unfused_give_the_same_results() -> None:
    # MLX runs a compiled function's ops one by one when compiling is off (or there is
    # no C++ compiler): the arithmetic, and so each result, is the same.
    x = mx.random.normal((7, 333), key=mx.random.key(5)) * 5
    names = ["sigmoid", "tanh", "gelu", "softmax"]
    fused = [np.array(getattr(fast_ops, name)(x)) for name in names]
    mx.disable_compile()
    try:
        for name, want in zip(names, fused, strict=True):
            got = np.array(getattr(fast_ops, name)(x))
            np.testing.assert_allclose(got, want, rtol=2e-7, atol=1e-9)
    finally:
        mx.enable_compile()


def test_attention_matches_mlx_and_each_row_is_its_own() -> None:
    rng = np.random.default_rng(1)
    q, k, v = (mx.array(rng.normal(size=(3, 6, n, 64)).astype(np.float32)) for n in (9, 9, 9))
    mask = mx.array(rng.random((3, 1, 9, 9)) > 0.3) | mx.eye(9, dtype=mx.bool_)
    for m in (None, "causal", mask):
        got = fast_ops.attention(q, k, v, 0.125, m)
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=m)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-5, atol=2e-6)
        for row in range(3):
            alone = fast_ops.attention(
                q[row : row + 1],
                k[row : row + 1],
                v[row : row + 1],
                0.125,
                m if not isinstance(m, mx.array) else m[row : row + 1],
            )
            assert np.array_equal(np.array(alone), np.array(got[row : row + 1]))
