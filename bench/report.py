"""Run every benchmark in bench/ with `--json` and write bench/RESULTS.md with the figures,
the machine they ran on, and PNG plots under bench/plots/.

    python bench/report.py [--only NAME ...] [--timeout-s 900]

Each benchmark runs in its own process with the quick options below (so the whole report
takes minutes, not hours); an option a script does not declare is not passed. A script
that fails or times out is reported with the tail of its output and the run goes on; the
exit status is then 1. The raw results are kept in bench/results.json; `--only` reruns
just the named benchmarks and keeps the others' results from that file.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
PLOTS = BENCH / "plots"
RESULTS = BENCH / "RESULTS.md"
RAW = BENCH / "results.json"

# Known benchmarks in the order they are reported, each with its quick options.
QUICK: dict[str, list[str]] = {
    "blas": ["--seconds", "1"],
    "llm": ["--rounds", "1", "--max-tokens", "48"],
    "llm_batch": ["--max-tokens", "32"],
    "asr": ["--repeats", "2"],
    "tts": ["--repeats", "1", "--skip-stock"],
    "vad": ["--sessions", "32", "--seconds", "5"],
    "duplex_core": ["--turns", "100", "--chunks", "10000", "--sessions", "200"],
    "pipeline": ["--questions", "10"],
    "barge_in": [],
    "realtime": ["--baseline"],
    "load": ["--levels", "10,50,100", "--max-speaking", "4", "--plot-dir", str(PLOTS)],
}
NOT_BENCHMARKS = {"report", "_gateway"}


# -- the machine -----------------------------------------------------------------------


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    if sys.platform == "darwin":
        out = subprocess.run(
            ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True
        )
        return out.stdout.strip() or platform.processor()
    return platform.processor() or "unknown"


def blas_name() -> str:
    """The BLAS the engine loads, asked of a fresh process (it must load before mlx)."""
    code = (
        "import engine.native.blas as b; b.ensure_fast_blas(); "
        "print(b.active_blas() or 'reference')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 else "unknown"


def machine() -> dict[str, Any]:
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "mlx": importlib.metadata.version("mlx"),
        "mlx_lm": importlib.metadata.version("mlx-lm"),
        "blas": blas_name(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


# -- running the benchmarks ------------------------------------------------------------


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def benchmarks(only: list[str] | None) -> list[str]:
    found = {p.stem for p in BENCH.glob("*.py")} - NOT_BENCHMARKS
    ordered = [name for name in QUICK if name in found]
    ordered += sorted(found - set(QUICK))
    if only:
        unknown = set(only) - found
        if unknown:
            raise SystemExit(f"no benchmark named {sorted(unknown)} in {BENCH}")
        ordered = [name for name in ordered if name in only]
    return ordered


def command(name: str) -> list[str]:
    """The script's command line: `--json` and the quick options it declares."""
    source = (BENCH / f"{name}.py").read_text()
    args = ["--json"] if '"--json"' in source else []
    quick = QUICK.get(name, [])
    for i, arg in enumerate(quick):
        if arg.startswith("--") and f'"{arg}"' in source:
            value = quick[i + 1 : i + 2]
            args += [arg, *[v for v in value if not v.startswith("--")]]
    return [sys.executable, f"bench/{name}.py", *args]


def run_one(name: str, timeout_s: float) -> dict[str, Any]:
    cmd = command(name)
    started = time.monotonic()
    try:
        out = subprocess.run(
            cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"")[-2000:]
        text = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return _failure(name, cmd, started, f"timed out after {timeout_s:g} s\n{text}")
    result = _last_json(out.stdout)
    detail = f"exit status {out.returncode}\n{(out.stdout + out.stderr)[-2000:]}"
    if result is None:
        return _failure(name, cmd, started, detail)
    run = {
        "name": name,
        "command": _shown(cmd),
        "seconds": round(time.monotonic() - started, 1),
        "result": result,
    }
    if out.returncode != 0:
        # The figures were printed, but the process then died: keep both.
        run["error"] = detail.strip()
    return run


def _failure(name: str, cmd: list[str], started: float, detail: str) -> dict[str, Any]:
    return {
        "name": name,
        "command": _shown(cmd),
        "seconds": round(time.monotonic() - started, 1),
        "error": detail.strip(),
    }


def _shown(cmd: list[str]) -> str:
    return " ".join(
        ["python", *[os.path.relpath(c, ROOT) if c == str(PLOTS) else c for c in cmd[1:]]]
    )


def _last_json(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


# -- figures and plots -----------------------------------------------------------------


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Scalar figures keyed by dotted path; lists of records become `key[i].field`."""
    if isinstance(value, dict):
        flat: dict[str, Any] = {}
        for key, sub in value.items():
            flat.update(flatten(sub, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        flat = {}
        for i, sub in enumerate(value):
            flat.update(flatten(sub, f"{prefix}[{i}]"))
        return flat
    return {prefix: value}


def _numbers(runs: list[dict[str, Any]], pattern: str) -> list[tuple[str, float]]:
    found = []
    for run in runs:
        for key, value in flatten(run.get("result", {})).items():
            leaf = key.rsplit(".", 1)[-1]
            if (
                re.search(pattern, leaf)
                and isinstance(value, (int, float))
                and not isinstance(value, bool)
            ):
                found.append((f"{run['name']}: {key}", float(value)))
    return found


def _bar_plot(items: list[tuple[str, float]], title: str, xlabel: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.32 * len(items) + 1.2))
    labels = [label for label, _ in items]
    ax.barh(labels, [v for _, v in items], color="tab:blue")
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(axis="x", alpha=0.3)
    if "ratio" in xlabel:
        ax.axvline(1.0, color="gray", linestyle="--")
    if "ratio" not in xlabel:
        ax.set_xscale("log")  # figures span orders of magnitude
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plots(runs: list[dict[str, Any]]) -> list[Path]:
    """Ratios to the plain libraries, real-time factors and latencies across benchmarks."""
    PLOTS.mkdir(exist_ok=True)
    made = []
    charts = [
        (r"ratio$", "engine beside the plain library (ratio, >1 = engine faster)", "ratio"),
        (
            r"rtf",
            "real-time factor (wall time / audio time, <1 = faster than real time)",
            "real-time factor",
        ),
        (r"_ms(_p50|_p95|_p99)?$", "latencies and times (ms)", "milliseconds"),
    ]
    for pattern, title, xlabel in charts:
        items = [(k, v) for k, v in _numbers(runs, pattern) if v > 0]  # log axes need > 0
        if items:
            name = "summary_" + re.sub(r"[^a-z]+", "_", xlabel.split(" ")[0]) + ".png"
            made.append(_bar_plot(items, title, xlabel, PLOTS / name))
    return made


# -- RESULTS.md ------------------------------------------------------------------------


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return (
        json.dumps(value) if isinstance(value, (list, dict, bool)) or value is None else str(value)
    )


def markdown(info: dict[str, Any], runs: list[dict[str, Any]], images: list[Path]) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Benchmark results",
        "",
        f"Generated by `python bench/report.py` on {now}. Each benchmark ran in its own",
        "process with the quick options shown; figures are from one run on this machine,",
        "which may have been shared with other work (see the load average).",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        *[f"| {key} | {_cell(value)} |" for key, value in info.items()],
        "",
        "## Plots",
        "",
        *[f"![{p.stem}](plots/{p.name})" for p in images],
        "",
    ]
    for run in runs:
        lines += [f"## {run['name']}", "", f"`{run['command']}` ({run['seconds']} s)", ""]
        if "error" in run:
            lines += ["**failed**:", "", "```", run["error"], "```", ""]
        if "result" not in run:
            continue
        lines += ["| figure | value |", "|---|---|"]
        lines += [f"| {key} | {_cell(value)} |" for key, value in flatten(run["result"]).items()]
        lines += ["", "<details><summary>JSON</summary>", "", "```json"]
        lines += [json.dumps(run["result"]), "```", "", "</details>", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run just these benchmarks")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per benchmark")
    args = parser.parse_args()
    names = benchmarks(args.only)
    info = machine()
    fresh = {}
    for name in names:
        print(f"running {name} ...", flush=True)
        fresh[name] = run_one(name, args.timeout_s)
        status = "failed" if "error" in fresh[name] else "ok"
        print(f"  {status} in {fresh[name]['seconds']} s", flush=True)
    kept = {}
    if args.only and RAW.exists():
        kept = {run["name"]: run for run in json.loads(RAW.read_text())["runs"]}
    merged = {**kept, **fresh}
    runs = [merged[name] for name in benchmarks(None) if name in merged]
    RAW.write_text(json.dumps({"machine": info, "runs": runs}, indent=1) + "\n")
    images = plots(runs)
    images += sorted(p for p in PLOTS.glob("load_*.png") if any(r["name"] == "load" for r in runs))
    RESULTS.write_text(markdown(info, runs, images))
    print(f"wrote {RESULTS.relative_to(ROOT)}")
    raise SystemExit(1 if any("error" in r for r in runs) else 0)


if __name__ == "__main__":
    main()
