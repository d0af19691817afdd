"""Few-row products go through the forwarder in front of the BLAS (its own kernels, or
the BLAS's sgemv), with the same results as sgemm for every layout MLX hands over. Each
check that depends on load order runs in a fresh interpreter, as in test_blas.py. Checks
of the built library use the model cache this test process set up (conftest.py), so the
run builds it once; checks of building use a cache of their own."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from engine.native import gemv_forward
from tests.helpers import busy_core

ROOT = Path(__file__).resolve().parent.parent


def run_python(code: str, **env: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


# Every product shape the forwarder takes over: outputs of one row or one column, and
# 2-8 rows times transposed weights or a small plain matrix, in the layouts MLX passes to
# cblas_sgemm (transposed and plain operands, strided vectors, batches, widths that are
# not a multiple of the vector width, products large enough to be split over threads),
# plus alpha/beta through addmm; compared with a float64 numpy reference, forwarding on
# and off.
PRODUCTS = """
    import json
    import engine
    engine.setup()
    import mlx.core as mx
    import numpy as np
    from engine.native import gemv_forward

    rng = np.random.default_rng(0)
    def arr(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))
    W, v, c, col = arr(300, 64), arr(1, 64), arr(1, 300), arr(64, 1)
    X3, X4, X5, X7, X8 = arr(3, 64), arr(4, 64), arr(5, 90), arr(7, 70), arr(8, 576)
    Big, Odd, Xt, C4 = arr(1200, 576), arr(1100, 70), arr(64, 6), arr(4, 300)
    Q, K, V = arr(2, 3, 3, 64), arr(2, 3, 41, 64), arr(2, 3, 41, 64)
    S, P = arr(2, 3, 3, 41), arr(90, 37)
    def f64(a):
        return np.array(a, np.float64)
    cases = {
        "row @ W.T": lambda: (v @ W.T, f64(v) @ f64(W).T),
        "row @ W": lambda: (v @ W[:64, :], f64(v) @ f64(W)[:64]),
        "col.T @ W.T": lambda: (col.T @ W.T, f64(col).T @ f64(W).T),
        "W @ col": lambda: (W @ col, f64(W) @ f64(col)),
        "W @ row.T": lambda: (W @ v.T, f64(W) @ f64(v).T),
        "W.T @ col": lambda: (W.T @ c.T, f64(W).T @ f64(c).T),
        "W @ strided col": lambda: (W @ arr(64, 3)[:, 1:2], None),
        "batched rows": lambda: (arr(2, 3, 1, 64) @ arr(2, 3, 64, 5), None),
        "addmm": lambda: (
            mx.addmm(c, v, W.T, alpha=0.5, beta=2.0),
            2.0 * f64(c) + 0.5 * f64(v) @ f64(W).T,
        ),
        "addmm beta 0": lambda: (
            mx.addmm(c, v, W.T, alpha=1.5, beta=0.0),
            1.5 * f64(v) @ f64(W).T,
        ),
        "3 rows @ W.T": lambda: (X3 @ W.T, f64(X3) @ f64(W).T),
        "8 rows @ big W.T (split)": lambda: (X8 @ Big.T, f64(X8) @ f64(Big).T),
        "7 rows, k 70 @ big W.T": lambda: (X7 @ Odd.T, f64(X7) @ f64(Odd).T),
        "transposed rows @ W.T": lambda: (Xt.T @ W.T, f64(Xt).T @ f64(W).T),
        "GQA scores": lambda: (Q @ K.swapaxes(-1, -2), f64(Q) @ f64(K).swapaxes(-1, -2)),
        "scores @ V": lambda: (S @ V, f64(S) @ f64(V)),
        "5 rows @ small plain": lambda: (X5 @ P, f64(X5) @ f64(P)),
        "addmm 4 rows": lambda: (
            mx.addmm(C4, X4, W.T, alpha=0.5, beta=2.0),
            2.0 * f64(C4) + 0.5 * f64(X4) @ f64(W).T,
        ),
        "addmm 4 rows beta 0 over NaN": lambda: (
            mx.addmm(mx.full((4, 300), float("nan")), X4, W.T, alpha=1.5, beta=0.0),
            1.5 * f64(X4) @ f64(W).T,
        ),
    }
    errors = {}
    for on in (True, False):
        if gemv_forward.is_active():
            gemv_forward.enable(on)
        for name, case in cases.items():
            rng = np.random.default_rng(1)
            got, want = case()
            got = np.array(got, np.float64)
            if want is None:
                want = got  # compared between the two settings below
            errors[f"{name} {on}"] = (float(np.abs(got - want).max()), got.tolist())
    print(json.dumps({"active": gemv_forward.is_active(), "errors": errors}))
"""


LINUX = sys.platform.startswith("linux")


def test_forwarded_products_match_sgemm_in_every_layout() -> None:
    result = run_python(PRODUCTS)
    # Linux: a C compiler (cc or gcc) builds the forwarder. macOS: MLX uses Accelerate
    # and nothing is loaded; the products must be right either way.
    assert result["active"] == LINUX
    errors = result["errors"]
    names = {k.rsplit(" ", 1)[0] for k in errors}
    for name in names:
        on_err, on_vals = errors[f"{name} True"]
        off_err, off_vals = errors[f"{name} False"]
        assert on_err < 1e-3 and off_err < 1e-3, name
        # Forwarded and plain sgemm agree (up to summation order).
        diff = max(abs(a - b) for a, b in zip(_flat(on_vals), _flat(off_vals), strict=True))
        assert diff < 1e-3, name


def _flat(values: object) -> list[float]:
    if isinstance(values, list):
        return [x for v in values for x in _flat(v)]
    return [float(values)]  # type: ignore[arg-type]


# A row's product does not depend on the rows beside it, and products from two MLX streams
# at once (two calling threads, one of them finding the pool busy) are right.
POOL = """
    import json, threading
    import engine
    engine.setup()
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(0)
    W = mx.array(rng.standard_normal((2000, 576)).astype(np.float32))
    X = mx.array(rng.standard_normal((8, 576)).astype(np.float32))
    want = np.array(X, np.float64) @ np.array(W, np.float64).T
    alone = [np.array(X[i : i + 1] @ W.T)[0] for i in range(8)]
    invariant = all(
        np.array_equal(np.array(X[:m] @ W.T)[i], alone[i]) for m in range(1, 9) for i in range(m)
    )

    def close(got):
        return float(np.abs(np.array(got, np.float64) - want).max()) < 1e-3

    results = []
    def work():
        with mx.stream(mx.new_stream(mx.cpu)):  # streams belong to the thread that made them
            results.extend(close(X @ W.T) for _ in range(50))
    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"invariant": invariant, "concurrent": len(results) == 100 and all(results)}))
"""


def test_rows_are_batch_invariant_and_concurrent_products_are_right() -> None:
    result = run_python(POOL)
    assert result["concurrent"]
    if LINUX:  # the forwarder's promise; other platforms' BLAS make none
        assert result["invariant"]


# Thousands of small products split over the pool, back to back, while another process
# takes a core: a helper that wakes late (its core taken) finds a later product under
# way, and must take no part of one that ended nor leave one unfinished.
LATE_HELPERS = """
    import json
    import engine
    engine.setup()
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(3)
    W = mx.array(rng.standard_normal((4000, 576)).astype(np.float32))
    xs = [mx.array(rng.standard_normal((1 + i % 3, 576)).astype(np.float32)) for i in range(8)]
    want = [np.array(x @ W.T) for x in xs]
    same = all(np.array_equal(np.array(xs[i % 8] @ W.T), want[i % 8]) for i in range(3000))
    print(json.dumps({"same": same}))
"""


def test_products_stay_right_while_helpers_lose_their_core() -> None:
    with busy_core():
        assert run_python(LATE_HELPERS)["same"]


def test_the_forwarder_answers_first_and_can_be_turned_off(tmp_path: Path) -> None:
    if not LINUX:
        active = """
            import json, engine
            engine.setup()
            from engine.native import gemv_forward
            print(json.dumps(gemv_forward.is_active()))
        """
        assert run_python(active, DUPLEX_GATEWAY_CACHE=str(tmp_path)) is False
        return
    probe = """
        import ctypes, json, os
        import engine
        engine.setup()
        from engine.native import gemv_forward
        addr = ctypes.cast(ctypes.CDLL(None).cblas_sgemm, ctypes.c_void_p).value
        owner = None
        for line in open("/proc/self/maps").read().splitlines():
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= addr < hi and len(fields) > 5:
                owner = fields[5]
        print(json.dumps({"active": gemv_forward.is_active(), "owner": owner}))
    """
    # This process's build, in the cache the probes read: they load it, not a new one.
    built = gemv_forward._built()
    assert built is not None
    (tmp_path / "native").mkdir()
    shutil.copy2(built, tmp_path / "native" / built.name)
    on = run_python(probe, DUPLEX_GATEWAY_CACHE=str(tmp_path))
    assert on["active"] and on["owner"] == str(tmp_path / "native" / built.name)
    off = run_python(probe, DUPLEX_GATEWAY_CACHE=str(tmp_path), DUPLEX_GATEWAY_GEMV_FORWARD="0")
    assert not off["active"] and "gemv_forward-" not in off["owner"]


def test_builds_of_other_sources_stay_and_only_long_unused_ones_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DUPLEX_GATEWAY_CACHE", str(tmp_path))
    native = tmp_path / "native"
    native.mkdir()
    unused = native / "gemv_forward-0123456789abcdef.so"
    unused.write_bytes(b"a build no process loaded for a long time")
    month = time.time() - 31 * 24 * 3600
    os.utime(unused, (month, month))
    unrelated = native / "other.so"
    unrelated.write_bytes(b"not ours")
    # Two checkouts of different versions share the cache: each keeps its build. Two
    # small sources stand for them (the build is keyed by content, not by what it holds).
    version = tmp_path / "version.c"
    version.write_text("int gemv_forward_version(void) { return 1; }\n")
    other = tmp_path / "other_version.c"
    other.write_text("int gemv_forward_version(void) { return 2; }\n")
    monkeypatch.setattr(gemv_forward, "SOURCE", version)
    mine = gemv_forward._built()
    with monkeypatch.context() as patch:
        patch.setattr(gemv_forward, "SOURCE", other)
        theirs = gemv_forward._built()
        assert gemv_forward._built() == theirs  # cached from now on
    assert mine is not None and theirs is not None and mine != theirs
    assert mine.exists() and theirs.exists()
    assert not unused.exists() and unrelated.exists()
    assert gemv_forward._built() == mine
    assert sorted(p.name for p in native.iterdir()) == sorted([mine.name, theirs.name, "other.so"])


def _blas_path() -> str:
    from engine.native.blas import CANDIDATES

    found = [path for path in CANDIDATES if os.path.exists(path)]
    assert found, "install the Debian package libopenblas0-pthread"
    return found[0]


def test_a_product_of_no_rows_writes_nothing() -> None:
    if not LINUX:
        return  # nothing is built or loaded elsewhere
    built = gemv_forward._built()
    assert built is not None
    lib = ctypes.CDLL(str(built))  # the forwarder under this process's MLX: bound again, alike
    assert lib.gemv_forward_bind(_blas_path().encode())
    n = k = 64
    a = np.ones((8, k), np.float32)
    b = np.ones((n, k), np.float32)
    c = np.full((8, n), 7.0, np.float32)

    def ptr(x: np.ndarray) -> ctypes.c_void_p:
        return ctypes.c_void_p(x.ctypes.data)

    lib.cblas_sgemm.argtypes = [ctypes.c_int] * 6 + [
        ctypes.c_float,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_float,
        ctypes.c_void_p,
        ctypes.c_int,
    ]
    for rows in (0, -1):
        lib.cblas_sgemm(101, 111, 112, rows, n, k, 1.0, ptr(a), k, ptr(b), k, 0.0, ptr(c), n)
    assert (c == 7.0).all()


# A BLAS the forwarder cannot bind to (no library, or one without cblas_sgemm) leaves
# MLX's own sgemm answering: the products are right, not a call through a null pointer.
UNBOUND = """
    import json
    import engine
    engine.setup()
    import mlx.core as mx
    from engine.native import gemv_forward

    a, b = mx.ones((4, 64)), mx.ones((64, 64))
    print(json.dumps({"active": gemv_forward.is_active(), "sum": (a @ b).sum().item()}))
"""


@pytest.mark.parametrize("library", ["empty file", "libm"])
def test_a_blas_it_cannot_bind_to_leaves_products_to_mlx(tmp_path: Path, library: str) -> None:
    if library == "empty file":
        path = tmp_path / "libblas.so.3"
        path.write_bytes(b"")
    elif LINUX:
        path = Path(_mapped(ctypes.util.find_library("m") or "libm.so.6"))
    else:
        return  # no BLAS is loaded but the system's elsewhere
    result = run_python(UNBOUND, DUPLEX_GATEWAY_BLAS=str(path))
    assert result == {"active": False, "sum": 4 * 64 * 64}


def _mapped(name: str) -> str:
    """The path of the library `name` as this process mapped it."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) > 5 and Path(fields[5]).name == name:
            return fields[5]
    raise AssertionError(f"{name} is not mapped")


def test_without_a_compiler_nothing_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("DUPLEX_GATEWAY_CACHE", str(tmp_path))
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert gemv_forward._built() is None
    assert "no C compiler" in caplog.text
    assert not (tmp_path / "native").exists()


def test_a_failing_build_leaves_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("DUPLEX_GATEWAY_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    monkeypatch.setattr(shutil, "which", lambda name: "/bin/false" if name == "false" else None)
    assert gemv_forward._built() is None
    assert "failed" in caplog.text
    assert list((tmp_path / "native").iterdir()) == []


# Matrices whose values are exactly 4-bit or 8-bit groups times a scale (plus an offset)
# get a compact twin; products that read it in floats equal those over the fp32 weights
# bit for bit, for every row count and over the thread pool; those over 4-bit twins (and
# 8-bit ones, with 512-bit VNNI) run in integers by default, within a stated tolerance,
# each row's result its own.
# Other matrices get none, and a freed matrix's twin goes with it.
TWINS = """
    import gc, json
    import engine
    engine.setup()
    import mlx.core as mx
    import numpy as np
    from engine.native import gemv_forward

    rng = np.random.default_rng(0)
    def grouped(rows, cols, bits):
        groups = (rows, cols // 32)
        scale = rng.random(groups).astype(np.float16).astype(np.float32) / 8
        if bits == 4:
            q = rng.integers(0, 16, (rows, cols)).astype(np.float32)
            q[:, ::32], q[:, 1::32] = 0, 15  # each group spans the whole range
            offset = -7.5 * scale  # around zero, as a Q4_1 block's minimum
        else:
            q = rng.integers(-127, 128, (rows, cols)).astype(np.float32)
            q[:, ::32] = 127
            offset = np.zeros(groups, np.float32)
        w = q * np.repeat(scale, 32, axis=1) + np.repeat(offset, 32, axis=1)
        return mx.array(w.astype(np.float32))

    W4, W8, Wbig = grouped(300, 576, 4), grouped(200, 64, 8), grouped(2000, 1536, 4)
    plain = mx.array(rng.standard_normal((300, 576)).astype(np.float32))
    bits = [gemv_forward.twin(w) for w in (W4, W8, Wbig, plain)]
    live = gemv_forward.live_twins()
    equal, error, alone = {}, {}, {}
    before = gemv_forward.twin_products()
    for name, w in {"4": W4, "8": W8, "big": Wbig}.items():
        for rows in range(1, 15):  # from 9, in blocks of 8 (MAX_BLOCKED_ROWS: 14)
            x = mx.array(rng.standard_normal((rows, w.shape[1])).astype(np.float32))
            gemv_forward.exact_twins(True)
            twin = np.array(x @ w.T)
            gemv_forward.exact_twins(False)
            integer = np.array(x @ w.T)
            last_alone = np.array(x[-1:] @ w.T)
            gemv_forward.use_twins(False)
            fp32 = np.array(x @ w.T)
            gemv_forward.use_twins(True)
            # Past 8 rows the fp32 product (no twin) is sgemm's, summed in its own order.
            same = np.array_equal(twin, fp32) or (
                rows > 8 and float(np.abs(twin - fp32).max() / np.abs(fp32).max()) < 1e-6
            )
            equal[f"{name} x{rows}"] = bool(same)
            error[f"{name} x{rows}"] = float(np.abs(integer - fp32).max() / np.abs(fp32).max())
            alone[f"{name} x{rows}"] = bool(np.array_equal(integer[-1:], last_alone))
    used = gemv_forward.twin_products() - before
    del W4, W8, Wbig, w  # the loop variable holds the last one
    gc.collect()
    print(json.dumps({"bits": bits, "live": live, "equal": equal, "error": error,
                      "alone": alone, "used": used, "after_free": gemv_forward.live_twins()}))
"""

# The integer products round each group of 32 activations to 8 bits (a step of 1/127 of
# the group's largest magnitude); over 576 to 1536 random terms that leaves at most about
# 1 % of the largest output (0.5 to 0.8 % measured).
INTEGER_TOLERANCE = 0.02


def test_compact_twins_give_the_same_products_and_go_with_their_matrix() -> None:
    result = run_python(TWINS)
    if not LINUX:  # no forwarder: no twins, and the products are plain sgemm's
        assert result["bits"] == [None] * 4 and result["used"] == 0
        return
    assert result["bits"] == [4, 8, 4, None]
    assert result["live"] == 3
    # Exact: bit for bit (past 8 rows, within sgemm's order of sums).
    assert all(result["equal"].values()), result["equal"]
    error = result["error"]
    assert max(error.values()) < INTEGER_TOLERANCE, error
    # 4-bit twins run in integers (they round); 8-bit ones too where the CPU has 512-bit
    # VNNI, and are rebuilt in floats otherwise.
    assert all(e > 0 for name, e in error.items() if not name.startswith("8")), error
    assert all(result["alone"].values()), result["alone"]  # a row's result is its own
    # Every product above read its twin: up to 8 rows once, 9 to 14 in two blocks (the
    # exact and the integer product), the last row alone once.
    assert result["used"] == 3 * (8 * 3 + 6 * (2 + 2 + 1))
    assert result["after_free"] == 0


# A matrix from given 4-bit groups (a GGUF file's own, whose values need not span 0..15)
# gets its twin from them, and reads it as the found twins do; groups that do not rebuild
# the matrix exactly give none.
GIVEN_GROUPS = """
    import json
    import engine
    engine.setup()
    import mlx.core as mx
    import numpy as np
    from engine.native import gemv_forward

    rng = np.random.default_rng(3)
    rows, cols = 96, 576
    q = rng.integers(3, 12, (rows, cols)).astype(np.uint8)  # never the whole 0..15
    scales = (rng.integers(1, 64, (rows, cols // 32)) * 2.0**-12).astype(np.float32)
    offsets = -(rng.integers(0, 64, (rows, cols // 32)) * 2.0**-10).astype(np.float32)
    values = q.reshape(rows, -1, 32) * scales[..., None] + offsets[..., None]
    w = mx.array(values.reshape(rows, cols).astype(np.float32))
    groups = q.reshape(rows, -1, 32)
    packed = (groups[..., :16] | (groups[..., 16:] << 4)).reshape(rows, -1)
    made = gemv_forward.twin_groups(w, mx.array(packed), mx.array(scales), mx.array(offsets))
    # Not the 4-bit form the twins find by themselves (its values are halves: 16 bits).
    found = gemv_forward.twin(mx.array(values.reshape(rows, cols).astype(np.float32)))
    wrong = mx.array(np.array(w) + np.float32(1e-3))
    refused = gemv_forward.twin_groups(wrong, mx.array(packed), mx.array(scales), mx.array(offsets))
    x = mx.array(rng.standard_normal((2, cols)).astype(np.float32))
    gemv_forward.exact_twins(True)
    twin = np.array(x @ w.T)
    gemv_forward.exact_twins(False)
    integer = np.array(x @ w.T)
    gemv_forward.use_twins(False)
    fp32 = np.array(x @ w.T)
    print(json.dumps({"found": found, "made": made, "refused": refused,
                      "equal": bool(np.array_equal(twin, fp32)),
                      "error": float(np.abs(integer - fp32).max() / np.abs(fp32).max())}))
"""


def test_a_matrix_gets_its_twin_from_given_4_bit_groups() -> None:
    result = run_python(GIVEN_GROUPS)
    if not LINUX:
        assert not result["made"]
        return
    assert result["found"] == 16 and result["made"] and not result["refused"]
    assert result["equal"] and 0 < result["error"] < INTEGER_TOLERANCE


# A matrix whose every value is a half (a float16 model held in fp32) gets a 16-bit twin:
# every product over it, at any row count and in either mode, is the fp32 product bit for
# bit; one value that is not a half leaves the matrix without.
HALF_TWINS = """
    import gc, json
    import engine
    engine.setup()
    import mlx.core as mx
    import numpy as np
    from engine.native import gemv_forward

    rng = np.random.default_rng(5)
    halves = rng.standard_normal((300, 576)).astype(np.float16).astype(np.float32)
    # zeros, the smallest subnormal half, the largest half
    halves[0, :4] = np.array([0.0, -0.0, 6.0e-8, 65504.0], np.float16)
    w = mx.array(halves)
    almost = halves.copy()
    almost[7, 9] += np.float32(1e-5)
    bits = [gemv_forward.twin(w), gemv_forward.twin(mx.array(almost))]
    before = gemv_forward.twin_products()
    equal, alone = {}, {}
    for rows in range(1, 9):
        x = mx.array(rng.standard_normal((rows, 576)).astype(np.float32))
        got = {}
        for exact in (False, True):
            gemv_forward.exact_twins(exact)
            got[exact] = np.array(x @ w.T)
        last_alone = np.array(x[-1:] @ w.T)
        gemv_forward.use_twins(False)
        fp32 = np.array(x @ w.T)
        gemv_forward.use_twins(True)
        equal[rows] = all(bool(np.array_equal(g, fp32)) for g in got.values())
        alone[rows] = bool(np.array_equal(got[True][-1:], last_alone))
    used = gemv_forward.twin_products() - before
    del w
    gc.collect()
    print(json.dumps({"bits": bits, "equal": equal, "alone": alone, "used": used,
                      "after_free": gemv_forward.live_twins()}))
"""


def test_a_matrix_of_halves_gets_a_16_bit_twin_read_bit_for_bit() -> None:
    result = run_python(HALF_TWINS)
    if not LINUX:
        assert result["bits"] == [None, None] and result["used"] == 0
        return
    assert result["bits"] == [16, None]
    assert all(result["equal"].values()), result["equal"]
    assert all(result["alone"].values()), result["alone"]
    assert result["used"] == 8 * 3
    assert result["after_free"] == 0


# The embedded LLM, dequantized from GGUF blocks, gets a twin for every matrix, and its
# decode steps give the same logits with the twins read in floats as without them.
LLM_TWINS = """
    import json
    import engine
    engine.setup()
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import make_prompt_cache
    from engine.native import gemv_forward
    from engine.weights import registry
    from engine.llm.stage import LlmStage

    stage = LlmStage.from_path(registry.prepare("smollm2-135m-instruct", progress=False))
    model, tokenizer = stage.model, stage.tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
    )

    def decode(rows):
        # The prompt is read once and its cache copied to every row: its products (many
        # rows) are the BLAS's, whose sums may depend on the batch on some CPUs.
        cache = make_prompt_cache(model)
        logits = mx.repeat(model(mx.array([prompt]), cache=cache), rows, axis=0)
        for layer in cache:
            keys, values, offset = layer.state
            layer.state = (mx.repeat(keys, rows, axis=0), mx.repeat(values, rows, axis=0), offset)
        steps, tokens = [], []
        for _ in range(8):
            token = mx.argmax(logits[:, -1], axis=-1)
            tokens.append(token[0].item())
            logits = model(token[:, None], cache=cache)
            steps.append(np.array(logits))
        return steps, tokenizer.decode(tokens)

    integer, integer_answer = decode(1)
    integer4, _ = decode(4)
    gemv_forward.exact_twins(True)
    used = gemv_forward.twin_products()
    twins, answer = decode(1)
    twins4, _ = decode(4)
    used = gemv_forward.twin_products() - used
    gemv_forward.use_twins(False)
    fp32, plain = decode(1)
    fp32_4, _ = decode(4)
    same = all(np.array_equal(a, b) for a, b in zip(twins + twins4, fp32 + fp32_4))
    error = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(integer, fp32))
    alone = all(np.array_equal(a[:1], b) for a, b in zip(integer4, integer))
    matrices = sum(1 for _, w in tree_flatten(model.parameters()) if w.ndim == 2)
    print(json.dumps({"live": gemv_forward.live_twins(), "matrices": matrices, "used": used,
                      "same": same, "answer": answer, "plain": plain, "error": error,
                      "alone": alone, "integer_answer": integer_answer}))
"""


EXACT_FROM_ENV = """
    import json
    import engine
    engine.setup()
    from engine.native import gemv_forward
    print(json.dumps({"active": gemv_forward.is_active(),
                      "exact": gemv_forward.is_active() and gemv_forward.exact_twins(False)}))
"""


@pytest.mark.parametrize("value, exact", [("1", True), ("0", False)])
def test_the_environment_chooses_exact_twins(value: str, exact: bool) -> None:
    result = run_python(EXACT_FROM_ENV, **{gemv_forward.EXACT_ENV: value})
    assert result["exact"] == (exact and result["active"])
    assert result["active"] == LINUX


# Over 30 layers the rounding of each product's activations adds up: 3.2 % of the largest
# logit at worst over 8 steps, as measured.
LOGITS_TOLERANCE = 0.05


@pytest.mark.models
def test_the_embedded_llm_decodes_the_same_from_its_compact_twins() -> None:
    result = run_python(LLM_TWINS)
    if not LINUX:
        assert result["live"] == 0 and result["same"]
        return
    assert result["live"] == result["matrices"] == 121  # 30 layers x 4, the embedding
    assert result["used"] > 0 and result["same"]
    assert result["answer"] == result["plain"] and "Paris" in result["answer"]
    # The integer products' logits stay close, decode the same answer, and a row's
    # logits do not depend on the rows batched with it.
    assert 0 < result["error"] < LOGITS_TOLERANCE
    assert result["integer_answer"] == result["plain"]
    assert result["alone"]
