"""Convert a CTranslate2 Whisper `model.bin` into an MLX Whisper directory.

The reader parses the CTranslate2 binary format itself (no ctranslate2 at run time):
little-endian `u32 version | str spec | u32 revision | u32 n_vars`, then per variable
`str name | u8 ndim | u32 dims[ndim] | u8 dtype | u32 nbytes | bytes`, then
`u32 n_aliases | (str alias, str target)*`, where `str` is a u16 length (with NUL) + UTF-8.

Output: `model.safetensors` (names of `engine.models.whisper`), `config.json` (dims,
special token ids, suppress ids, the start tokens) and `tokenizer.json`.

A carrier holds `model.bin` whole (whisper-tiny.en's, under `model/`) or split into
`model.bin.part1`, `model.bin.part2`, ... across the packages of a multi-part source
(whisper base's); the parts are read back to back. A multilingual model is asked for
English transcription by its start tokens.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

__all__ = ["CONVERTER_VERSION", "convert", "read_ct2", "to_mlx_weights"]

# Bump when the output changes, so cached conversions are redone.
CONVERTER_VERSION = "3"

_DTYPES = {
    0: np.float32,
    1: np.int8,
    2: np.int16,
    3: np.int32,
    4: np.float16,
}
_SUPPORTED_BINARY_VERSION = 6
MULTILINGUAL_VOCAB = 51865


class _Reader:
    def __init__(self, data: bytes):
        self.data = data
        self.pos = 0

    def unpack(self, fmt: str) -> int:
        (value,) = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("H")
        text = self.data[self.pos : self.pos + n - 1].decode("utf-8")
        self.pos += n
        return text

    def raw(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ValueError("model.bin is truncated")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk


def read_ct2(
    path: Path | list[Path], progress: Callable[[int, int], None] | None = None
) -> tuple[str, dict[str, np.ndarray]]:
    """Read a CTranslate2 model.bin (or its parts, in order); returns (spec name,
    {variable name: array}).

    Aliases are resolved into the returned dict as extra keys sharing the target array.
    """
    paths = path if isinstance(path, list) else [path]
    r = _Reader(b"".join(Path(p).read_bytes() for p in paths))
    version = r.unpack("I")
    if version != _SUPPORTED_BINARY_VERSION:
        raise ValueError(f"unsupported CTranslate2 binary version {version} in {path}")
    spec = r.string()
    r.unpack("I")  # spec revision: the layout below is the same for every Whisper revision
    n_vars = r.unpack("I")
    variables: dict[str, np.ndarray] = {}
    for i in range(n_vars):
        name = r.string()
        dims = tuple(r.unpack("I") for _ in range(r.unpack("B")))
        dtype_id = r.unpack("B")
        nbytes = r.unpack("I")
        if dtype_id not in _DTYPES:
            raise ValueError(f"unsupported dtype id {dtype_id} for {name} in {path}")
        variables[name] = np.frombuffer(r.raw(nbytes), dtype=_DTYPES[dtype_id]).reshape(dims)
        if progress is not None:
            progress(i + 1, n_vars)
    for _ in range(r.unpack("I")):
        alias, target = r.string(), r.string()
        variables[alias] = variables[target]
    return spec, variables


def _split(w: np.ndarray, parts: int) -> list[np.ndarray]:
    return np.split(w, parts, axis=0)


def _attention(src: dict, ct2: str, mlx: str, fused: str, out: str) -> dict:
    """Map one CTranslate2 attention (fused projections) onto query/key/value/out."""
    w: dict[str, np.ndarray] = {}
    weight, bias = src[f"{ct2}/{fused}/weight"], src[f"{ct2}/{fused}/bias"]
    names = ["query", "key", "value"] if len(weight) == 3 * weight.shape[1] else ["key", "value"]
    if len(names) == 2:  # cross-attention: the query is a separate linear_0
        w[f"{mlx}.query.weight"] = src[f"{ct2}/linear_0/weight"]
        w[f"{mlx}.query.bias"] = src[f"{ct2}/linear_0/bias"]
    for name, wt, b in zip(
        names, _split(weight, len(names)), _split(bias, len(names)), strict=True
    ):
        w[f"{mlx}.{name}.weight"] = wt
        if name != "key":  # Whisper's key projection has no bias (CTranslate2 stores zeros)
            w[f"{mlx}.{name}.bias"] = b
    w[f"{mlx}.out.weight"] = src[f"{ct2}/{out}/weight"]
    w[f"{mlx}.out.bias"] = src[f"{ct2}/{out}/bias"]
    return w


def _layer_norm(src: dict, ct2: str, mlx: str) -> dict:
    return {f"{mlx}.weight": src[f"{ct2}/gamma"], f"{mlx}.bias": src[f"{ct2}/beta"]}


def _block(src: dict, ct2: str, mlx: str, cross: bool) -> dict:
    w = _attention(src, f"{ct2}/self_attention", f"{mlx}.attn", "linear_0", "linear_1")
    w |= _layer_norm(src, f"{ct2}/self_attention/layer_norm", f"{mlx}.attn_ln")
    if cross:
        w |= _attention(src, f"{ct2}/attention", f"{mlx}.cross_attn", "linear_1", "linear_2")
        w |= _layer_norm(src, f"{ct2}/attention/layer_norm", f"{mlx}.cross_attn_ln")
    w |= _layer_norm(src, f"{ct2}/ffn/layer_norm", f"{mlx}.mlp_ln")
    for i in (0, 1):
        w[f"{mlx}.mlp{i + 1}.weight"] = src[f"{ct2}/ffn/linear_{i}/weight"]
        w[f"{mlx}.mlp{i + 1}.bias"] = src[f"{ct2}/ffn/linear_{i}/bias"]
    return w


def _n_layers(src: dict, prefix: str) -> int:
    found = {int(m.group(1)) for k in src if (m := re.match(rf"{prefix}/layer_(\d+)/", k))}
    return len(found)


def to_mlx_weights(src: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """CTranslate2 Whisper variables -> `engine.models.whisper.Model` parameter names."""
    w: dict[str, np.ndarray] = {}
    for i in (1, 2):
        # Conv weights: (out, in, kernel) -> MLX (out, kernel, in).
        w[f"encoder.conv{i}.weight"] = src[f"encoder/conv{i}/weight"].transpose(0, 2, 1)
        w[f"encoder.conv{i}.bias"] = src[f"encoder/conv{i}/bias"]
    w["encoder.positional_embedding"] = src["encoder/position_encodings/encodings"]
    for i in range(_n_layers(src, "encoder")):
        w |= _block(src, f"encoder/layer_{i}", f"encoder.blocks.{i}", cross=False)
    w |= _layer_norm(src, "encoder/layer_norm", "encoder.ln_post")
    w["decoder.token_embedding.weight"] = src["decoder/embeddings/weight"]
    w["decoder.positional_embedding"] = src["decoder/position_encodings/encodings"]
    for i in range(_n_layers(src, "decoder")):
        w |= _block(src, f"decoder/layer_{i}", f"decoder.blocks.{i}", cross=True)
    w |= _layer_norm(src, "decoder/layer_norm", "decoder.ln")
    return w


def _dims(src: dict[str, np.ndarray]) -> dict[str, int]:
    n_vocab, n_text_state = src["decoder/embeddings/weight"].shape
    n_audio_state, n_mels, _ = src["encoder/conv1/weight"].shape
    return {
        "n_mels": int(n_mels),
        "n_audio_ctx": int(src["encoder/position_encodings/encodings"].shape[0]),
        "n_audio_state": int(n_audio_state),
        "n_audio_head": int(src["encoder/num_heads"]),
        "n_audio_layer": _n_layers(src, "encoder"),
        "n_vocab": int(n_vocab),
        "n_text_ctx": int(src["decoder/position_encodings/encodings"].shape[0]),
        "n_text_state": int(n_text_state),
        "n_text_head": int(src["decoder/num_heads"]),
        "n_text_layer": _n_layers(src, "decoder"),
    }


def _token_config(model_dir: Path, n_vocab: int) -> dict:
    ct2_config = json.loads((model_dir / "config.json").read_text())
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    special = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    sot = special["<|startoftranscript|>"]
    start = [sot]
    # Multilingual models have one more token than English-only ones (as openai-whisper
    # tells them apart; both list language ids): ask for English, transcribed.
    if n_vocab >= MULTILINGUAL_VOCAB:
        start += [special["<|en|>"], special["<|transcribe|>"]]
    # Everything from <|startoftranscript|> on is control or timestamp tokens: a plain
    # transcript never contains them, so greedy decoding must never pick them.
    suppress = sorted(set(ct2_config["suppress_ids"]) | set(range(sot, n_vocab)))
    return {
        "eot_id": special["<|endoftext|>"],
        "sot_id": sot,
        "no_timestamps_id": special["<|notimestamps|>"],
        "start_ids": [*start, special["<|notimestamps|>"]],
        "suppress_ids": suppress,
        "suppress_ids_begin": ct2_config["suppress_ids_begin"],
    }


def _model_files(source_dir: Path) -> tuple[Path, list[Path]]:
    """The folder holding config.json and tokenizer.json, and model.bin or its parts."""
    whole = sorted(Path(source_dir).rglob("model.bin"))
    if len(whole) == 1:
        return whole[0].parent, whole
    parts = sorted(Path(source_dir).rglob("model.bin.part*"), key=_part_number)
    configs = sorted(Path(source_dir).rglob("tokenizer.json"))
    if whole or not parts or len(configs) != 1:
        raise FileNotFoundError(f"no CTranslate2 model.bin (whole or in parts) under {source_dir}")
    numbers = [_part_number(p) for p in parts]
    if numbers != list(range(1, len(parts) + 1)):
        raise FileNotFoundError(f"model.bin parts {numbers} under {source_dir} have gaps")
    return configs[0].parent, parts


def _part_number(path: Path) -> int:
    match = re.search(r"(\d+)$", path.name)
    return int(match[1]) if match else -1


def convert(source_dir: Path, out_dir: Path, progress: Callable[[int, int], None]) -> None:
    """Convert a carrier's CTranslate2 Whisper (whole or in parts) into `out_dir`."""
    model_dir, model_bin = _model_files(Path(source_dir))
    steps: list[int] = [0]

    def on_read(done: int, total: int) -> None:
        # One extra step for writing the converted files.
        steps[0] = total + 1
        progress(done, total + 1)

    spec, src = read_ct2(model_bin, on_read)
    if spec != "WhisperSpec":
        raise ValueError(f"{model_bin} holds a {spec}, not a WhisperSpec")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = {k: mx.array(np.ascontiguousarray(v)) for k, v in to_mlx_weights(src).items()}
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights)
    dims = _dims(src)
    config = {"model_type": "whisper", **dims, **_token_config(model_dir, dims["n_vocab"])}
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    shutil.copyfile(model_dir / "tokenizer.json", out_dir / "tokenizer.json")
    progress(steps[0], steps[0])
