"""The device decision (`engine.runtime.device`) and what follows from it: the LLM's precision and
whether the CPU BLAS and the few-row forwarder are set up. GPUs and MLX builds are faked
with distributions written here; the last test checks this machine for real."""

from __future__ import annotations

import base64
import hashlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.native import blas, gemv_forward
from engine.runtime import device
from engine.weights import registry

LLM = registry.ModelSpec("any-llm", "llm", "path:/x", "a:b", precisions=("fp32", "4bit"))


@pytest.fixture(autouse=True)
def fresh_answer() -> Iterator[None]:
    device.accelerator.cache_clear()
    yield
    device.accelerator.cache_clear()


@pytest.fixture
def linux(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "linux")


def install_mlx_build(site: Path, name: str, *, recorded_size: int, actual_size: int) -> None:
    """A distribution `name` whose RECORD lists mlx/lib/libmlx.so at `recorded_size`
    bytes, with a library of `actual_size` bytes on disk (another build's, if they differ)."""
    library = site / "mlx" / "lib" / "libmlx.so"
    library.parent.mkdir(parents=True, exist_ok=True)
    library.write_bytes(b"\0" * actual_size)
    info = site / f"{name.replace('-', '_')}-0.32.4.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.32.4\n")
    digest = base64.urlsafe_b64encode(hashlib.sha256(b"x").digest()).rstrip(b"=").decode()
    (info / "RECORD").write_text(f"mlx/lib/libmlx.so,sha256={digest},{recorded_size}\n")


@pytest.fixture
def gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder standing in for /dev: empty until a test adds a GPU's device node."""
    dev = tmp_path / "dev"
    dev.mkdir()
    monkeypatch.setattr(device, "NVIDIA_DEVICES", str(dev / "nvidia[0-9]*"))
    return dev


def test_macos_is_metal_with_four_bit_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    assert device.accelerator() == "metal" and not device.uses_cpu_kernels()
    assert registry.resolve_precision(LLM, "auto") == "4bit"


def test_cuda_build_with_a_gpu_is_cuda_with_four_bit_weights_and_no_cpu_blas(
    linux: None, gpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_mlx_build(tmp_path / "site", "mlx-cuda-12", recorded_size=64, actual_size=64)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    (gpus / "nvidia0").touch()
    assert device.accelerator() == "cuda"
    assert registry.resolve_precision(LLM, "auto") == "4bit"
    assert registry.resolve_precision(LLM, "fp32") == "fp32"  # an explicit choice stands

    def must_not_load(path: str) -> bool:
        raise AssertionError("the few-row forwarder was set up for a GPU")

    monkeypatch.setattr(gemv_forward, "load", must_not_load)
    monkeypatch.setattr(blas, "_checked", False)
    monkeypatch.setattr(blas, "_active", None)
    monkeypatch.delitem(sys.modules, "mlx.core", raising=False)  # as before MLX loads
    assert blas.ensure_fast_blas() is None and blas.active_blas() is None


def test_cuda_build_without_a_gpu_runs_on_the_cpu(
    linux: None,
    gpus: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    install_mlx_build(tmp_path / "site", "mlx-cuda-12", recorded_size=64, actual_size=64)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with caplog.at_level(logging.WARNING, logger="engine.runtime.device"):
        assert device.accelerator() == "cpu"
    assert "no NVIDIA GPU is visible" in caplog.text
    assert registry.resolve_precision(LLM, "auto") == "fp32"


def test_cuda_build_overwritten_by_the_cpu_build_is_cpu_and_says_how_to_fix_it(
    linux: None,
    gpus: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    install_mlx_build(tmp_path / "site", "mlx-cuda-12", recorded_size=640, actual_size=64)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    (gpus / "nvidia0").touch()
    with caplog.at_level(logging.WARNING, logger="engine.runtime.device"):
        assert device.accelerator() == "cpu"
    assert "pip install --force-reinstall --no-deps mlx-cuda-12==0.32.4" in caplog.text
    assert device.uses_cpu_kernels()


def test_this_machine_without_mlx_cuda_is_the_cpu(gpus: Path) -> None:
    assert sys.platform.startswith("linux"), "this suite runs on Linux"
    assert device.accelerator() == "cpu" and device.uses_cpu_kernels()
    assert registry.resolve_precision(LLM, "auto") == "fp32"
    assert blas.active_blas() is not None  # set up when `engine` was imported
