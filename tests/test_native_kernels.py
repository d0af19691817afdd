"""The native kernels (`engine/native/kernels.c`): the convolutions against a NumPy
reference, row for row the same whatever the rows beside them, in place, refusing what
they cannot do; the layer norm, GELU, softmax and products; the voice through them; and
its fallback to MLX's convolutions without them (Whisper's encoder: tests/test_asr.py)."""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from engine.models import smart_turn, vits
from engine.native import kernels
from tests.helpers import busy_core
from tests.test_tts import SUM_ORDER_ATOL, TINY, run, tiny_model


@pytest.fixture(autouse=True)
def loaded() -> None:
    # The project's install has a compiler (README); without one these tests fail.
    assert kernels.load(), "the native convolutions did not build (see the log)"


def reference(
    x: np.ndarray, weight: np.ndarray, length: int, pad_left: int, **given: Any
) -> np.ndarray:
    """The definition, in float64: weight is (out, taps, in), as the models store it;
    `given` holds `conv1d`'s dilation, bias, residual and slope."""
    dilation, slope = given.get("dilation", 1), given.get("slope", 1.0)
    bias, residual = given.get("bias"), given.get("residual")
    out_ch, taps, _ = weight.shape
    act = np.maximum(x, x * slope).astype(np.float64)
    rows = length + (taps - 1) * dilation
    padded = np.zeros((rows, x.shape[1]))
    n = max(0, min(x.shape[0], rows - pad_left))
    padded[pad_left : pad_left + n] = act[:n]
    y = np.zeros((length, out_ch))
    for k in range(taps):
        y += padded[k * dilation : k * dilation + length] @ weight[:, k, :].T
    if bias is not None:
        y += bias
    if residual is not None:
        y += residual
    return y


CASES = [
    # rows, in, out, taps, dilation, slope
    (8192, 32, 32, 7, 12, 0.1),  # the voice's last stage: split over the threads
    (300, 64, 64, 5, 6, 0.1),
    (97, 16, 24, 3, 2, 0.0),  # out channels not a whole 16: the 8-wide kernel too
    (40, 192, 8, 1, 1, 1.0),  # a 1x1 conv, no activation
    (57, 192, 768, 3, 1, 0.0),  # the text encoder's: few rows, cut evenly over the threads
    (5, 8, 16, 7, 3, 0.01),  # fewer rows than the taps reach
]


@pytest.mark.parametrize("rows,ci,co,taps,dilation,slope", CASES)
def test_the_conv_is_the_definition(
    rows: int, ci: int, co: int, taps: int, dilation: int, slope: float
) -> None:
    rng = np.random.default_rng(rows + co)
    x = rng.standard_normal((rows, ci), dtype=np.float32)
    weight = (rng.standard_normal((co, taps, ci)) / np.sqrt(ci * taps)).astype(np.float32)
    bias = rng.standard_normal(co, dtype=np.float32)
    residual = rng.standard_normal((rows, co), dtype=np.float32)
    pad = dilation * (taps - 1) // 2
    packed = kernels.pack_taps(weight)
    given = dict(dilation=dilation, bias=bias, residual=residual, slope=slope)
    got = kernels.conv1d(x, packed, length=rows, pad_left=pad, **given)
    want = reference(x, weight, length=rows, pad_left=pad, **given)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    bare = kernels.conv1d(x, packed, length=rows, pad_left=pad, dilation=dilation, slope=slope)
    np.testing.assert_allclose(bare, got - bias - residual, atol=1e-4)


def test_a_polyphase_window_reads_zeros_past_both_ends() -> None:
    # The transposed conv's form: more zero rows before than the taps' centre, and
    # output rows that reach past the input's end.
    rng = np.random.default_rng(3)
    x = rng.standard_normal((11, 8), dtype=np.float32)
    weight = rng.standard_normal((16, 3, 8)).astype(np.float32)
    got = kernels.conv1d(x, kernels.pack_taps(weight), length=13, pad_left=2)
    np.testing.assert_allclose(got, reference(x, weight, length=13, pad_left=2), atol=1e-5)


def test_a_row_is_the_same_whatever_rows_are_computed_beside_it() -> None:
    # Each output sums its taps and channels in one order: the rows of a long call (split
    # over the threads) equal, bit for bit, those of a short call on their neighbourhood.
    rng = np.random.default_rng(4)
    x = rng.standard_normal((6000, 32), dtype=np.float32)
    packed = kernels.pack_taps(rng.standard_normal((32, 5, 32)).astype(np.float32) / 12)
    long = kernels.conv1d(x, packed, length=6000, pad_left=12, dilation=6, slope=0.1)
    a, b = 2011, 2046  # a window that starts and ends off the kernel's blocks of rows
    short = kernels.conv1d(
        x[a - 12 : b + 12], packed, length=b - a + 24, pad_left=12, dilation=6, slope=0.1
    )
    assert np.array_equal(short[12:-12], long[a:b])


def test_a_short_wide_call_cut_over_the_threads_gives_each_row_as_alone() -> None:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((57, 192), dtype=np.float32)
    packed = kernels.pack_taps(rng.standard_normal((768, 3, 192)).astype(np.float32) / 24)
    whole = kernels.conv1d(x, packed, length=57, pad_left=1)
    for row in (0, 29, 56):  # the first, one past an even cut, the last
        alone = kernels.conv1d(x[max(0, row - 1) : row + 2], packed, length=3, pad_left=1)
        assert np.array_equal(alone[min(row, 1)], whole[row])


def test_calls_stay_right_while_helpers_lose_their_core() -> None:
    # Many calls cut over the threads, back to back, while another process takes a core:
    # a helper that wakes late finds a later call under way and must take no rows of one
    # that ended, nor leave one unfinished.
    rng = np.random.default_rng(8)
    xs = [rng.standard_normal((90 + 7 * i, 128), dtype=np.float32) for i in range(4)]
    packed = kernels.pack_taps(rng.standard_normal((128, 3, 128)).astype(np.float32) / 20)
    want = [kernels.conv1d(x, packed, length=len(x), pad_left=1) for x in xs]
    with busy_core():
        for i in range(1000):
            got = kernels.conv1d(xs[i % 4], packed, length=len(xs[i % 4]), pad_left=1)
            assert np.array_equal(got, want[i % 4])


def test_in_place_equals_a_fresh_output() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((500, 16), dtype=np.float32)
    packed = kernels.pack_taps(rng.standard_normal((16, 3, 16)).astype(np.float32) / 7)
    fresh = kernels.conv1d(x, packed, length=500, pad_left=1, residual=x, slope=0.1)
    y = x.copy()
    kernels.conv1d(y, packed, length=500, pad_left=1, residual=y, out=y, slope=0.1)
    assert np.array_equal(y, fresh)


def test_what_it_cannot_do_is_refused() -> None:
    x = np.ones((10, 8), np.float32)
    packed = kernels.pack_taps(np.ones((8, 3, 8), np.float32))
    with pytest.raises(ValueError, match="channels"):
        kernels.conv1d(np.ones((10, 4), np.float32), packed, length=10, pad_left=1)
    with pytest.raises(ValueError, match="refused"):
        kernels.conv1d(x, packed, length=10, pad_left=1, slope=2.0)
    with pytest.raises(ValueError, match="residual"):
        kernels.conv1d(x, packed, length=10, pad_left=1, residual=np.ones((9, 8), np.float32))
    work = np.empty((3, 10, 8), np.float32)
    strided = kernels.Conv(np.ones((3, 8, 16), np.float32)[:, :, ::2], None, 1)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.resblocks(x, [[strided]], False, 0.1, work)
    with pytest.raises(ValueError, match="channels"):
        kernels.resblocks(
            np.ones((10, 16), np.float32), [[kernels.Conv(packed, None, 1)]], False, 0.1, work
        )


def test_the_gate_is_tanh_times_sigmoid() -> None:
    rng = np.random.default_rng(6)
    a = (rng.standard_normal((300, 2 * 24)) * 4).astype(np.float32)
    a[0, :8] = [0.0, -0.0, 1e-8, -1e-8, 50.0, -50.0, 100.0, -100.0]  # tanh's tails
    a[0, 24:32] = [0.0, 50.0, -50.0, 100.0, -100.0, 1e-8, 90.0, -90.0]  # sigmoid's
    wide = a.astype(np.float64)
    want = np.tanh(wide[:, :24]) / (1.0 + np.exp(-wide[:, 24:]))
    np.testing.assert_allclose(kernels.gate(a), want, rtol=0, atol=2e-7)
    with pytest.raises(ValueError, match="even"):
        kernels.gate(np.ones((3, 5), np.float32))


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("width", [192, 29])  # whole vectors, and a tail past them
def test_the_layer_norm_is_the_definition(gelu: bool, width: int) -> None:
    rng = np.random.default_rng(8)
    x, residual = (rng.standard_normal((40, width), dtype=np.float32) * 3 for _ in range(2))
    gamma, beta = (rng.standard_normal(width, dtype=np.float32) for _ in range(2))
    wide = x.astype(np.float64) + residual
    centred = wide - wide.mean(axis=1, keepdims=True)
    want = centred / np.sqrt((centred**2).mean(axis=1, keepdims=True) + 1e-5) * gamma + beta
    if gelu:
        want = 0.5 * want * (1.0 + np.vectorize(math.erf)(want / math.sqrt(2.0)))
    got = kernels.layer_norm(x, gamma, beta, residual, gelu)
    np.testing.assert_allclose(got, want, rtol=0, atol=5e-6)
    alone = kernels.layer_norm(x + residual, gamma, beta, gelu=gelu)
    np.testing.assert_allclose(alone, got, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="gamma"):
        kernels.layer_norm(x, gamma[:-1], beta)


def test_the_softmax_and_the_gelu_are_the_definitions() -> None:
    rng = np.random.default_rng(10)
    x = (rng.standard_normal((30, 203)) * 20).astype(np.float32)  # a tail past the vectors
    x[0, :3] = [-1e4, 80.0, 80.0]  # a masked score, a tie at the top
    wide = np.exp(x - x.max(axis=1, keepdims=True).astype(np.float64))
    want = wide / wide.sum(axis=1, keepdims=True)
    got = kernels.softmax(x.copy())
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.softmax(x[:, ::2])
    erf = np.vectorize(math.erf)
    np.testing.assert_allclose(
        kernels.gelu(x / 10), 0.5 * (x / 10) * (1 + erf(x / 10 / math.sqrt(2))), rtol=0, atol=6e-7
    )


@pytest.mark.parametrize("shape", [(57, 96, 57), (3, 9, 96), (179, 179, 96)])
def test_the_product_is_the_definition(shape: tuple[int, int, int]) -> None:
    rows, k, n = shape
    rng = np.random.default_rng(9)
    a = rng.standard_normal((rows, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    got = kernels.matmul(a, b)
    assert got.shape == (rows, n) and got.flags.c_contiguous
    np.testing.assert_allclose(got, a.astype(np.float64) @ b, rtol=0, atol=1e-4)


@pytest.mark.parametrize("rows", [14, 13])  # the phases of an even and an odd length
def test_the_strided_conv_is_mlxs(rows: int) -> None:
    rng = np.random.default_rng(10)
    x = rng.standard_normal((rows, 12), dtype=np.float32)
    weight = rng.standard_normal((24, 3, 12), dtype=np.float32)
    bias = rng.standard_normal(24, dtype=np.float32)
    got = kernels.strided_conv1d(x, kernels.pack_strided_taps(weight), bias)
    want = mx.conv1d(mx.array(x[None]), mx.array(weight), stride=2, padding=1) + mx.array(bias)
    assert got.shape == ((rows + 1) // 2, 24)
    np.testing.assert_allclose(got, np.array(want[0]), rtol=0, atol=1e-5)


# --- quantised activations, as Smart Turn's MLX port computes them ----------------------


def quantiser(scale: float, zero: float) -> smart_turn.FakeQuant:
    q = smart_turn.FakeQuant()
    q.scale = mx.array([scale], dtype=mx.float32)
    q.zero_point = mx.array([zero], dtype=mx.float32)
    return q


def test_requantizing_is_the_ports_quantise_and_dequantise() -> None:
    rng = np.random.default_rng(11)
    # Integer sums, and halves exactly on rounding steps (ties go to even, as in MLX).
    sums = np.concatenate([rng.integers(-40_000, 40_000, (6, 32)), np.full((1, 32), 7)])
    sums = sums.astype(np.float32)
    mult = rng.uniform(0.001, 0.01, 32).astype(np.float32)
    mult[:4] = 0.5
    bias = rng.standard_normal(32, dtype=np.float32)
    q = quantiser(0.037, 131.0)
    scale, zero = q.constants()
    levels = q.level(mx.array(sums) * mx.array(mult))
    assert 0 < (np.array(levels) == 255).mean() < 0.5  # some clip, most do not
    np.testing.assert_array_equal(kernels.requantize(sums.copy(), mult, zero), levels)
    codes = kernels.requantize(sums.copy(), mult, zero, out="code")
    np.testing.assert_array_equal(codes, levels - q.zero_point)
    values = kernels.requantize(sums.copy(), mult, zero, out="value", scale=scale, bias=bias)
    np.testing.assert_array_equal(values, q.dequantize(levels) + mx.array(bias))
    x = rng.standard_normal((5, 32), dtype=np.float32)
    np.testing.assert_array_equal(q.native_codes(x.copy()), q.codes_of(mx.array(x)))


def test_a_lookup_reads_each_columns_table() -> None:
    rng = np.random.default_rng(12)
    levels = rng.integers(0, 256, (9, 40)).astype(np.float32)
    per_column = rng.standard_normal((256, 40), dtype=np.float32)
    one = rng.standard_normal((256, 1), dtype=np.float32)
    index = levels.astype(int)
    np.testing.assert_array_equal(kernels.lookup(levels, per_column), per_column[index, range(40)])
    np.testing.assert_array_equal(kernels.lookup(levels, one), one[index, 0])
    levels[3, 5] = 256
    with pytest.raises(ValueError, match="0 to 255"):
        kernels.lookup(levels, one)


def test_the_quantised_softmax_is_the_ports_bit_for_bit() -> None:
    rng = np.random.default_rng(13)
    spread = rng.integers(-3000, 3000, (2, 40, 400))
    peaked = np.clip(rng.normal(100, 20, (1, 40, 400)), 0, 255) * 37
    sums = np.concatenate([spread, peaked]).astype(np.float32)
    levels_of, mult = quantiser(0.0473, 128.0), np.float32(0.0213)
    softmax = smart_turn.QuantSoftmax()
    softmax.scale = mx.array([1 / 255], dtype=mx.float32)
    softmax.build(0.0473, 400)
    want = softmax.codes_of_levels(levels_of.level(mx.array(sums) * mx.array(mult)))
    got = softmax.native_codes_of_sums(sums.copy(), levels_of, mult)
    np.testing.assert_array_equal(got, np.array(want))
    with pytest.raises(ValueError, match="multiple of 8"):
        kernels.quant_softmax(sums[:, :, :396].copy(), mult, 128.0, np.ones(256), 255.0, 0.0)


def test_the_quantised_softmax_over_the_helpers_gives_each_row_as_alone() -> None:
    # Smart Turn's 400 x 400 scores go to the helper threads; 40 rows stay on the caller.
    rng = np.random.default_rng(14)
    sums = rng.integers(-3000, 3000, (400, 400)).astype(np.float32)
    table = np.exp(np.arange(256, dtype=np.float32) - 255.0).astype(np.float32)
    args = (np.float32(0.0213), 128.0, table, 255.0, 0.0)
    whole = kernels.quant_softmax(sums.copy(), *args)
    alone = np.concatenate(
        [kernels.quant_softmax(part.copy(), *args) for part in np.split(sums, 10)]
    )
    np.testing.assert_array_equal(whole, alone)


@pytest.mark.parametrize("rows,ci,co,taps,dilation", [(57, 96, 56, 3, 1), (13, 80, 392, 3, 2)])
def test_integer_taps_give_the_float_taps_sums(
    rows: int, ci: int, co: int, taps: int, dilation: int
) -> None:
    # A quantised model's codes: exact sums either way (16-bit products with AVX2).
    rng = np.random.default_rng(15)
    weight = rng.integers(-128, 128, (co, taps, ci)).astype(np.float32)
    x = rng.integers(-255, 256, (rows, ci)).astype(np.float32)
    floats, integers = kernels.pack_taps(weight), kernels.pack_taps(weight, integers=True)
    assert integers.dtype == np.int16 and integers.shape == floats.shape
    bias = kernels.padded_bias(rng.integers(-999, 999, co).astype(np.float32), floats)
    given: dict[str, Any] = {"length": rows, "pad_left": 1, "dilation": dilation, "bias": bias}
    want = kernels.conv1d(x, floats, **given)
    np.testing.assert_array_equal(want[:, :co], reference(x, weight, **given)[:, :co])
    if kernels.integer_products():
        np.testing.assert_array_equal(kernels.conv1d(x, integers, **given), want)
    else:  # no AVX2: refused, and the models keep the float taps
        with pytest.raises(ValueError, match="refused"):
            kernels.conv1d(x, integers, **given)
    with pytest.raises(ValueError, match="no activation"):
        kernels.conv1d(x, integers, **given, slope=0.5)
    with pytest.raises(ValueError, match="even number of inputs"):
        kernels.pack_taps(weight[:, :, 1:], integers=True)
    with pytest.raises(ValueError, match="int16 values"):
        kernels.pack_taps(weight + 0.5, integers=True)


# --- the voice through it -------------------------------------------------------------


def test_the_native_durations_are_the_mlx_ones() -> None:
    # Encoder and duration predictor, item by item cut to its length, against MLX's
    # masked batch, with the same noise drawn.
    model = tiny_model(11)
    ids = mx.array(
        [[1, 0, 5, 0, 9, 0, 12, 0, 3, 0, 2, 0, 7], [1, 0, 7, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0]]
    )
    lengths, noise_w, length_scale = mx.array([13, 5]), mx.array([0.8, 0.5]), mx.array([1.0, 1.3])
    got = {}
    for mode in ("taps", "native"):
        model.set_conv_mode(mode)
        mx.random.seed(12)
        got[mode] = [np.array(a) for a in model.durations(ids, lengths, noise_w, length_scale)]
    for mlx_a, native_a in zip(got["taps"], got["native"], strict=True):
        np.testing.assert_allclose(native_a, mlx_a, rtol=1e-5, atol=1e-5)
    assert got["native"][2].sum() > 0 and not got["native"][2][1, 5:].any()
    assert not got["native"][0][1, 5:].any()  # padding: nothing past an item's end


def test_the_native_flows_are_the_mlx_ones() -> None:
    model = tiny_model(10)
    frames = np.array([9, 23])  # a masked batch: each item alone, cut to its frames
    z_p = mx.random.normal((2, 23, TINY.inter_channels))
    model.set_conv_mode("taps")
    mlx_z = np.array(model.flows(z_p, frames))
    model.set_conv_mode("native")
    native = np.array(model.flows(z_p, frames))
    for b, n in enumerate(frames):
        np.testing.assert_allclose(native[b, :n], mlx_z[b, :n], atol=1e-5, rtol=1e-5)
        assert not native[b, n:].any()


@pytest.mark.parametrize("resblock", ["1", "2"])
def test_the_native_vocoder_sounds_as_the_mlx_one(resblock: str) -> None:
    args = vits.ModelArgs(**{**TINY.__dict__, "resblock": resblock})
    model = tiny_model(7, args)
    seqs = [[1, 0, 5, 0, 9, 0, 12, 0, 3, 0, 2], [1, 0, 7, 0, 2]]  # a masked batch
    model.set_conv_mode("taps")
    mlx_audio = run(model, seqs)
    model.set_conv_mode("native")
    native = run(model, seqs)
    model.dec.TILE_BYTES, model.dec.MIN_TILE = 256, 8  # tiles of a few samples
    tiled = run(model, seqs)
    for m, n, t in zip(mlx_audio, native, tiled, strict=True):
        assert m.shape == n.shape == t.shape and m.size > 64
        np.testing.assert_allclose(n, m, atol=SUM_ORDER_ATOL)
        np.testing.assert_allclose(t, n, atol=SUM_ORDER_ATOL)


def test_a_vocoded_item_is_the_same_alone_and_in_a_batch() -> None:
    model = tiny_model(8)
    model.set_conv_mode("native")
    frames = np.array([9, 23])
    z = mx.random.normal((2, 23, TINY.inter_channels))
    batched = np.array(model.vocode(z, frames))
    hop = TINY.hop_length
    for b, n in enumerate(frames):
        single = np.array(model.vocode(z[b : b + 1, :n], frames[b : b + 1]))
        assert np.array_equal(single[0], batched[b, : n * hop])  # each item runs alone


def test_the_native_vocoder_pauses_where_the_mlx_one_does() -> None:
    model = tiny_model(5)
    model.dec.TILE_BYTES, model.dec.MIN_TILE = 256, 8
    ids = mx.array([[1, 0, 5, 0, 9, 0, 12, 0, 3, 0, 2]])
    z_p, frames = model.latents(ids, mx.array([11]), 0.0, 1.0, 0.0)
    z = model.flows(z_p, frames)
    counts = {}
    for mode in ("taps", "native"):
        model.set_conv_mode(mode)
        pauses: list[int] = []
        model.vocode(z, frames, lambda: pauses.append(1))  # noqa: B023 - used at once
        counts[mode] = len(pauses)
    assert counts["native"] == counts["taps"] > len(TINY.upsample_rates)


# --- without it -----------------------------------------------------------------------


@pytest.fixture
def unloaded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The module as in a fresh process, with an empty engine cache."""
    monkeypatch.setattr(kernels, "_lib", None)
    monkeypatch.setattr(kernels, "_tried", False)
    monkeypatch.setenv("DUPLEX_GATEWAY_CACHE", str(tmp_path))


def test_without_a_compiler_the_voice_keeps_mlx_convolutions(
    unloaded: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING):
        assert not kernels.load()
    assert "no C compiler" in caplog.text
    model = tiny_model(9)
    with pytest.raises(RuntimeError, match="compiler"):
        model.set_conv_mode("native")
    assert not model.dec.native
    (audio,) = run(model, [[1, 0, 5, 0, 2]])
    assert audio.size > 0


def test_it_can_be_turned_off(unloaded: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.ENV, "0")
    assert not kernels.load()
    with pytest.raises(RuntimeError):
        kernels.conv1d(
            np.ones((4, 8), np.float32), np.ones((1, 8, 8), np.float32), length=4, pad_left=0
        )
