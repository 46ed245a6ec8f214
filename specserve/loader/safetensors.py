"""HF model directory: config.json + *.safetensors (single or sharded) + tokenizer.json."""

from __future__ import annotations

import glob
import json
import os
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    import torch


def read_hf_config(model_dir: str) -> dict[str, Any]:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{model_dir} is not an HF model directory: config.json is missing")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def safetensors_files(model_dir: str) -> list[str]:
    """The weight files of a model directory, from the shard index when there is one."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"shard(s) listed in {index} are missing: {', '.join(missing)}")
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        other = [os.path.basename(p) for p in glob.glob(os.path.join(model_dir, "*.bin"))]
        hint = f" (found {', '.join(other)}: only safetensors are supported)" if other else ""
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}{hint}")
    return files


def safetensors_weights(model_dir: str, device: str = "cpu", sliced: bool = False) -> Iterator[tuple[str, Any]]:
    """(name, tensor) for every tensor of every weight file, read lazily one at a time; ``sliced``: a
    safetensors slice instead, of which only what is indexed is read (a tensor-parallel rank's part)."""
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device=device) as f:
            for name in f.keys():
                yield name, f.get_slice(name) if sliced else f.get_tensor(name)
