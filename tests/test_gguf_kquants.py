"""GGUF block dequantization (`engine.models.qwen2_gguf.dequantize`) against llama.cpp's
definitions of the blocks, written out here element by element after
`dequantize_row_q4_K`, `_q6_K`, `_q5_0` and `_q8_0` in ggml-quants.c: hand-made blocks
with values worked out by hand, and seeded random blocks. Also the 8-bit regrouping the
fp32 conversion applies on top."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from engine.models.qwen2_gguf import dequantize, q4_k_groups, requantize_bits, symmetric_8bit

QK_K = 256


def half(value: float) -> bytes:
    return struct.pack("<e", value)


def scale_min_k4(j: int, scales: bytes) -> tuple[int, int]:
    if j < 4:
        return scales[j] & 63, scales[j + 4] & 63
    sc = (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4)
    m = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4)
    return sc, m


def ref_q4_k(block: bytes) -> list[float]:
    d, dmin = struct.unpack_from("<ee", block, 0)
    scales, qs = block[4:16], block[16:144]
    out = [0.0] * QK_K
    for n, j in enumerate(range(0, QK_K, 64)):
        sc1, m1 = scale_min_k4(2 * n, scales)
        sc2, m2 = scale_min_k4(2 * n + 1, scales)
        q = qs[32 * n : 32 * n + 32]
        for lane in range(32):
            out[j + lane] = d * sc1 * (q[lane] & 0xF) - dmin * m1
            out[j + 32 + lane] = d * sc2 * (q[lane] >> 4) - dmin * m2
    return out


def ref_q6_k(block: bytes) -> list[float]:
    ql, qh = block[0:128], block[128:192]
    sc = struct.unpack_from("<16b", block, 192)
    (d,) = struct.unpack_from("<e", block, 208)
    out = [0.0] * QK_K
    for half_ in range(2):
        low, high, s, y = ql[64 * half_ :], qh[32 * half_ :], sc[8 * half_ :], 128 * half_
        for lane in range(32):
            i = lane // 16
            q1 = ((low[lane] & 0xF) | (((high[lane] >> 0) & 3) << 4)) - 32
            q2 = ((low[lane + 32] & 0xF) | (((high[lane] >> 2) & 3) << 4)) - 32
            q3 = ((low[lane] >> 4) | (((high[lane] >> 4) & 3) << 4)) - 32
            q4 = ((low[lane + 32] >> 4) | (((high[lane] >> 6) & 3) << 4)) - 32
            out[y + lane] = d * s[i] * q1
            out[y + lane + 32] = d * s[i + 2] * q2
            out[y + lane + 64] = d * s[i + 4] * q3
            out[y + lane + 96] = d * s[i + 6] * q4
    return out


def ref_q5_0(block: bytes) -> list[float]:
    (d,) = struct.unpack_from("<e", block, 0)
    (qh,) = struct.unpack_from("<I", block, 2)
    qs = block[6:22]
    out = [0.0] * 32
    for j in range(16):
        high0 = ((qh >> j) << 4) & 0x10
        high1 = (qh >> (j + 12)) & 0x10
        out[j] = d * (((qs[j] & 0xF) | high0) - 16)
        out[j + 16] = d * (((qs[j] >> 4) | high1) - 16)
    return out


def ref_q8_0(block: bytes) -> list[float]:
    (d,) = struct.unpack_from("<e", block, 0)
    return [d * q for q in struct.unpack_from("<32b", block, 2)]


REFERENCES = {
    T.Q4_K: (144, ref_q4_k, (0, 2)),  # block bytes, reference, offsets of its halves
    T.Q6_K: (210, ref_q6_k, (208,)),
    T.Q5_0: (22, ref_q5_0, (0,)),
    T.Q8_0: (34, ref_q8_0, (0,)),
}


def random_blocks(qtype: T, count: int, seed: int) -> bytes:
    """Random bytes, with every fp16 scale a finite value of a weight's magnitude."""
    size, _, halves = REFERENCES[qtype]
    rng = np.random.default_rng(seed)
    out = bytearray()
    for _ in range(count):
        block = bytearray(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
        for offset in halves:
            block[offset : offset + 2] = half(float(rng.uniform(-0.02, 0.02)))
        out += block
    return bytes(out)


def ours(qtype: T, data: bytes, rows: int = 1) -> np.ndarray:
    raw = np.frombuffer(data, dtype=np.uint8).reshape(rows, -1)
    return dequantize(raw, int(qtype))


def test_a_hand_made_q4_k_block() -> None:
    # d = 0.5, dmin = 0.25; sub-block 0: scale 3, min 2; sub-block 1: scale 1, min 4;
    # sub-blocks 4..7 take their high bits from bytes 0..3 and 8..11 of the scales.
    scales = bytearray(12)
    scales[0], scales[4] = 3, 2
    scales[1], scales[5] = 1, 4
    scales[8] = 0x21  # sub-block 4: scale 1 | (scales[0] >> 6) << 4, min 2 | ...
    scales[0] |= 0x40  # sub-block 4's scale gets bit 4 (16): 17; sub-block 0 keeps 3
    qs = bytearray(128)
    qs[0] = 0x7A  # weight 0: q 10 (sub-block 0); weight 32: q 7 (sub-block 1)
    qs[64] = 0x05  # weight 128: q 5 (sub-block 4)
    block = half(0.5) + half(0.25) + bytes(scales) + bytes(qs)
    values = ours(T.Q4_K, block)[0]
    assert values[0] == 0.5 * 3 * 10 - 0.25 * 2  # 14.5
    assert values[1] == -0.25 * 2  # q 0: just the minimum
    assert values[32] == 0.5 * 1 * 7 - 0.25 * 4  # 2.5
    # Sub-block 4: scale 1 + 16 from the high bits of scales[0], min (0x21 >> 4) = 2.
    assert values[128] == 0.5 * 17 * 5 - 0.25 * 2  # 42.0
    np.testing.assert_array_equal(values, np.float32(ref_q4_k(block)))


def test_a_hand_made_q6_k_block() -> None:
    ql, qh = bytearray(128), bytearray(64)
    ql[0] = 0x3F  # weight 0: low 15 (and weight 64: low 3)
    qh[0] = 0b01  # weight 0: high 1 -> q = 15 + 16 - 32 = -1
    ql[32] = 0x02  # weight 32: low 2, high 0 -> q = -30
    sc = struct.pack("<16b", *([2] * 16))
    block = bytes(ql) + bytes(qh) + sc + half(0.125)
    values = ours(T.Q6_K, block)[0]
    assert values[0] == 0.125 * 2 * -1
    assert values[32] == 0.125 * 2 * -30
    assert values[64] == 0.125 * 2 * (3 - 32)
    assert values[255] == 0.125 * 2 * -32
    np.testing.assert_array_equal(values, np.float32(ref_q6_k(block)))


@pytest.mark.parametrize("qtype", list(REFERENCES), ids=lambda t: t.name)
def test_random_blocks_match_the_definition(qtype: T) -> None:
    size, reference, _ = REFERENCES[qtype]
    data = random_blocks(qtype, 8, seed=int(qtype))
    values = ours(qtype, data, rows=2)
    expected = np.array(
        [v for i in range(0, len(data), size) for v in reference(data[i : i + size])]
    ).reshape(2, -1)
    assert values.shape == expected.shape and values.dtype == np.float32
    scale = np.abs(expected).max()
    np.testing.assert_allclose(values, expected, rtol=1e-6, atol=1e-6 * scale)


def test_block_types_regroup_into_4_or_8_bits() -> None:
    assert requantize_bits(int(T.Q4_K)) == 4
    assert [requantize_bits(int(t)) for t in (T.Q6_K, T.Q5_0, T.Q8_0)] == [8, 8, 8]
    assert requantize_bits(int(T.F32)) is None


def test_regrouped_weights_are_signed_bytes_times_a_group_scale() -> None:
    values = ours(T.Q6_K, random_blocks(T.Q6_K, 4, seed=1), rows=4)
    regrouped = symmetric_8bit(values)
    groups = regrouped.reshape(-1, 32)
    scale = np.abs(groups).max(axis=1, keepdims=True) / np.float32(127)
    q = np.rint(groups / scale)
    # Exactly the form the few-row products check: q in -127..127, q * scale == weight.
    assert np.abs(q).max() <= 127
    np.testing.assert_array_equal((q * scale).astype(np.float32), groups)
    step = np.abs(values.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
    assert np.all(np.abs(groups - values.reshape(-1, 32)) <= step * 0.51)


def test_q4_k_blocks_give_their_own_4_bit_groups() -> None:
    # Two rows of four blocks each: every value is exactly q * scale + offset, with q
    # packed two to a byte as the twins hold them (byte j: values j and j + 16).
    data = random_blocks(T.Q4_K, 8, seed=7)
    raw = np.frombuffer(data, dtype=np.uint8).reshape(2, -1)
    q, scales, offsets = q4_k_groups(raw)
    assert q.shape == (2, 4 * 256 // 2) and scales.shape == offsets.shape == (2, 4 * 256 // 32)
    groups = q.reshape(2, -1, 16)
    unpacked = np.concatenate([groups & 15, groups >> 4], axis=-1).astype(np.float32)
    rebuilt = unpacked * scales[..., None] + offsets[..., None]
    np.testing.assert_array_equal(rebuilt.reshape(2, -1), ours(T.Q4_K, data, rows=2))
