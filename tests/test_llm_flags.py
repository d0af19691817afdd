"""`--llm NAME_OR_PATH` and `--llm-url URL`: another LLM without writing YAML.

For real: the converted SmolLM2 laid out as a plain mlx-lm model folder (config.json,
safetensors, tokenizer) is started with `--llm <folder>`, then served by a real
`mlx_lm.server` and used with `--llm-url`; each answers a text turn from the official
`openai` SDK. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from openai import AsyncOpenAI

from engine.weights.paths import CACHE_ENV, cache_dir
from gateway.cli import llm_override, local_llm_ref, served_name
from tests.helpers import ROOT, free_port, running_gateway, wait_until_serving

PROFILE = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())


def flags(**given: Any) -> argparse.Namespace:
    return argparse.Namespace(**{"llm": None, "llm_url": None, "llm_model": None, **given})


# -- what the flags do to the profile --------------------------------------------------


def test_llm_url_makes_the_llm_stage_remote_and_keeps_the_sampling() -> None:
    url = "http://10.0.0.5:8000/v1"
    llm = llm_override(PROFILE, flags(llm_url=url, llm_model="Qwen/Qwen2.5-7B-Instruct"))
    stage = llm["stages"]["llm"]
    assert stage["backend"] == "remote" and "model" not in stage
    assert stage["remote"] == {"base_url": url, "model": "Qwen/Qwen2.5-7B-Instruct"}
    assert stage["sampling"] == PROFILE["stages"]["llm"]["sampling"]
    assert llm["stages"]["asr"] == PROFILE["stages"]["asr"]
    default = llm_override(PROFILE, flags(llm_url=url))["stages"]["llm"]["remote"]["model"]
    assert default == "default_model"


def test_llm_names_a_registry_model_a_folder_or_a_hugging_face_id(tmp_path: Path) -> None:
    assert local_llm_ref("smollm2-135m-instruct") == {"name": "smollm2-135m-instruct"}
    folder = local_llm_ref(str(tmp_path))
    assert folder["source"] == f"path:{tmp_path.resolve()}"
    assert folder["name"].startswith(f"local-{tmp_path.name}-")
    hub = local_llm_ref("mlx-community/Qwen2.5-1.5B-Instruct-4bit")
    assert hub == {
        "name": "hf-mlx-community--Qwen2.5-1.5B-Instruct-4bit",
        "source": "hf:mlx-community/Qwen2.5-1.5B-Instruct-4bit",
    }
    stage = llm_override(PROFILE, flags(llm=str(tmp_path)))["stages"]["llm"]
    assert stage["backend"] == "local" and stage["model"] == folder


def test_the_gateway_is_named_for_the_llm_it_serves(tmp_path: Path) -> None:
    assert served_name(PROFILE, flags()) == {}
    named = served_name(PROFILE, flags(llm_url="http://h/v1", llm_model="Qwen/Qwen2.5-7B"))
    assert named == {"model_name": "duplex-Qwen2.5-7B"}
    assert served_name(PROFILE, flags(llm_url="http://h/v1")) == {
        "model_name": "duplex-default_model"
    }
    assert served_name(PROFILE, flags(llm=str(tmp_path))) == {
        "model_name": f"duplex-{tmp_path.name}"
    }
    assert served_name(PROFILE, flags(llm="smollm2-135m-instruct")) == {
        "model_name": "duplex-smollm2-135m-instruct"
    }
    # A profile that names itself keeps its name.
    own = {**PROFILE, "gateway": {**PROFILE["gateway"], "model_name": "my-agent"}}
    assert served_name(own, flags(llm=str(tmp_path))) == {}


@pytest.mark.parametrize("given", [{"llm": "./no/such/folder"}, {"llm_model": "m"}])
def test_what_the_flags_cannot_mean_is_refused_by_name(given: dict[str, str]) -> None:
    with pytest.raises(SystemExit) as refused:
        llm_override(PROFILE, flags(**given))
    assert "--llm" in str(refused.value)


# -- for real ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The converted SmolLM2 as a user's own mlx-lm model folder (files linked)."""
    from engine.weights.registry import MARKER, prepare

    converted = prepare("smollm2-135m-instruct", precision="fp32", progress=False)
    folder = tmp_path_factory.mktemp("models") / "SmolLM2-135M-Instruct"
    folder.mkdir()
    for path in converted.iterdir():
        if path.name != MARKER:
            (folder / path.name).symlink_to(path)
    return folder


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model cache of this test's own, so `--llm <folder>` leaves nothing in the shared
    one; the other stages' converted models are linked in as they are."""
    cache = tmp_path_factory.mktemp("cache")
    for entry in cache_dir().iterdir():
        if not entry.name.startswith(".") and not entry.name.startswith("smollm2"):
            (cache / entry.name).symlink_to(entry)
    return cache


@pytest.fixture(scope="module")
def greedy_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    profile = json.loads(json.dumps(PROFILE))
    profile["stages"]["llm"]["sampling"]["temperature"] = 0.0
    path = tmp_path_factory.mktemp("profile") / "greedy.yaml"
    path.write_text(yaml.safe_dump(profile))
    return path


async def capital_of_france(port: int) -> str:
    base = f"ws://127.0.0.1:{port}/v1"
    async with AsyncOpenAI(api_key="sk-local", websocket_base_url=base).realtime.connect(
        model="gpt-realtime"
    ) as conn:
        session = {
            "type": "realtime",
            "output_modalities": ["text"],
            "audio": {"input": {"turn_detection": None}},
        }
        await conn.session.update(session=session)  # type: ignore[arg-type]
        question = "What is the capital of France?"
        await conn.conversation.item.create(
            item={
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": question}],
            }
        )
        await conn.response.create()
        text = ""
        async for event in conn:
            if event.type == "response.output_text.delta":
                text += event.delta
            elif event.type == "response.done":
                assert event.response.status == "completed", event.response.status_details
                return text
    raise AssertionError("the connection closed before response.done")


@pytest.mark.models
async def test_llm_with_a_local_model_folder(
    model_folder: Path, model_cache: Path, greedy_profile: Path
) -> None:
    with running_gateway(
        "--config",
        str(greedy_profile),
        "--llm",
        str(model_folder),
        env={CACHE_ENV: str(model_cache)},
    ) as gw:
        answer = await capital_of_france(gw.port)
    assert "paris" in answer.lower(), answer
    assert gw.proc.returncode == 0
    # The LLM stage ran the folder: its files were linked into the cache under its name.
    (entry,) = model_cache.glob("local-SmolLM2-135M-Instruct-*")
    marker = json.loads((entry / ".complete.json").read_text())
    assert marker["source"] == f"path:{model_folder}"


@pytest.fixture(scope="module")
def mlx_lm_server(
    model_folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    """`python -m mlx_lm.server --model <folder>`; yields its URL and request log."""
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "requests.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_lm.server", "--model", str(model_folder)]
            + ["--host", "127.0.0.1", "--port", str(port)],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.DEVNULL,
            stderr=out,
        )
    try:
        wait_until_serving(proc, f"http://127.0.0.1:{port}/v1/models", 300, log.read_text)
        yield f"http://127.0.0.1:{port}/v1", log
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.models
async def test_llm_url_with_a_real_mlx_lm_server(
    mlx_lm_server: tuple[str, Path], greedy_profile: Path
) -> None:
    url, log = mlx_lm_server
    with running_gateway("--config", str(greedy_profile), "--llm-url", url) as gw:
        answer = await capital_of_france(gw.port)
        # The turn went to the server: it logged the request.
        assert "POST /v1/chat/completions" in log.read_text()
    assert "paris" in answer.lower(), answer
    assert gw.proc.returncode == 0
