"""The model a run serves: ``--model``, the profile's folder or Hugging Face id, or the generated
tiny model; and whether it is at hand, without downloading or generating anything.

Engines run with ``HF_HUB_OFFLINE=1``, so a Hugging Face id serves only from the local cache.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ratebench import tinymodel
from ratebench.profiles import Profile

SOURCE_OPTION = "--model"
SOURCE_PROFILE = "profile"
SOURCE_TINY = "tiny"


@dataclass
class ModelChoice:
    """The model a run passes to ``vllm serve --model``, where it comes from, and whether it is there."""

    path: str  # a folder (absolute) or a Hugging Face id
    source: str  # SOURCE_OPTION | SOURCE_PROFILE | SOURCE_TINY
    local_dir: Path | None  # the folder, when path is one that exists
    present: bool  # the folder is complete, the id is in the local cache, the tiny model is generated
    detail: str  # what was found, in words
    cached_dir: Path | None = None  # a Hugging Face id in the local cache: its snapshot folder

    @property
    def files_dir(self) -> Path | None:
        """The folder holding the model's files (config, tokenizer), where one is at hand."""
        return self.local_dir or self.cached_dir


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache folder, from the environment as it is now."""
    env = os.environ
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(name):
            return Path(env[name]).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def model_folder_problem(folder: Path) -> str | None:
    """What keeps a model folder from serving (no config.json, weights missing), or None."""
    if not folder.is_dir():
        return f"{folder} is not a folder"
    if not (folder / "config.json").is_file():
        return f"{folder} has no config.json"
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if index.is_file():
            try:
                shards = set(json.loads(index.read_text())["weight_map"].values())
            except (OSError, ValueError, KeyError, AttributeError) as exc:
                return f"{index} is unreadable ({exc})"
            missing = sorted(s for s in shards if not (folder / s).is_file())
            return f"{folder} lacks {len(missing)} weight shard(s) ({', '.join(missing[:3])})" if missing else None
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        return f"{folder} has no weights (*.safetensors or *.bin)"
    return None


def hf_cached_folder(model_id: str) -> Path | None:
    """The snapshot folder of ``model_id`` (revision main) in the local Hugging Face cache, when complete."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        config = try_to_load_from_cache(model_id, "config.json", cache_dir=hf_hub_cache())
    except ValueError:  # not a valid Hugging Face id (a folder path that does not exist)
        return None
    if not isinstance(config, str):
        return None
    folder = Path(config).parent
    return folder if model_folder_problem(folder) is None else None


def model_choice(profile: Profile, override: str | None = None) -> ModelChoice:
    """The model a run of ``profile`` serves (``override``: the ``--model`` option); reads only."""
    if override is None and profile.model.source == "tiny":
        folder = tinymodel.default_tiny_model_path().absolute()
        if tinymodel.tiny_model_is_generated(folder):
            return ModelChoice(str(folder.resolve()), SOURCE_TINY, folder.resolve(), True,
                               f"the generated tiny model, already generated at {folder.resolve()}")
        return ModelChoice(str(folder), SOURCE_TINY, None, False,
                           f"the generated tiny model, not generated yet: the run generates it at {folder} first "
                           f"(or `ratebench tiny-model`)")
    source = SOURCE_PROFILE if override is None else SOURCE_OPTION
    path = profile.model.name if override is None else override
    if Path(path).is_dir():
        folder = Path(path).resolve()
        problem = model_folder_problem(folder)
        return ModelChoice(str(folder), source, folder, problem is None,
                           f"a local folder{'' if problem is None else f', unusable: {problem}'}")
    looks_like_path = path.startswith(("/", ".", "~")) or path.count("/") > 1
    if looks_like_path:
        return ModelChoice(path, source, None, False, "a local folder that does not exist")
    cached = hf_cached_folder(path)
    if cached is not None:
        return ModelChoice(path, source, None, True, f"a Hugging Face id, in the local cache ({cached})", cached)
    return ModelChoice(path, source, None, False,
                       f"a Hugging Face id, not in the local cache ({hf_hub_cache()}); engines run with "
                       f"HF_HUB_OFFLINE=1: download it first or pass --model FOLDER")


def stop_token_ids(folder: Path) -> list[int] | None:
    """The token ids at which the model's answers end by themselves (an answer not under ``ignore_eos``
    that vLLM finishes with "stop" ends with one of them): the tokenizer's EOS token and
    ``generation_config.json``'s ``eos_token_id`` (an id or a list), as vLLM's ``SamplingParams`` takes
    them. None when the folder says neither (the answers-end rule of reconciliation is then not applied)."""
    ids: set[int] = set()

    def read(name: str) -> dict:
        try:
            data = json.loads((folder / name).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def add(value: object) -> None:
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                ids.add(v)

    add(read("generation_config.json").get("eos_token_id"))
    tok = read("tokenizer_config.json")
    eos = tok.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if isinstance(eos, str):
        for key, entry in (tok.get("added_tokens_decoder") or {}).items():
            if isinstance(entry, dict) and entry.get("content") == eos and str(key).isdigit():
                ids.add(int(key))
    return sorted(ids) or None


def model_max_len(folder: Path, profile: Profile) -> int | None:
    """The longest prompt plus answer the engines serve: the profile's ``max_model_len``, else the
    model's ``max_position_embeddings`` (vLLM's default); None when neither is known."""
    if profile.model.max_model_len is not None:
        return profile.model.max_model_len
    try:
        value = json.loads((folder / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None
