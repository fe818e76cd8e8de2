"""The model a run serves, and whether it is at hand: read, never downloaded or generated."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from ratebench import tinymodel
from ratebench.models import (
    SOURCE_OPTION, SOURCE_PROFILE, SOURCE_TINY, hf_cached_folder, model_choice, model_max_len, stop_token_ids,
)
from ratebench.profiles import load_profile


def _model_folder(folder: Path, shards: int = 0) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    if shards:
        names = [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: n for n in names}}))
        for n in names:
            (folder / n).write_bytes(b"")
    else:
        (folder / "model.safetensors").write_bytes(b"")
    return folder


def _hf_cache(cache: Path, model_id: str, **kw) -> Path:
    """The Hugging Face hub cache layout: refs/main names the snapshot."""
    repo = cache / ("models--" + model_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    return _model_folder(repo / "snapshots" / "abc123", **kw)


@pytest.fixture
def empty_hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_a_complete_local_folder_is_present_and_resolved(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path / "m", shards=2)
    choice = model_choice(load_profile("rtx4090-qwen3-8b"), str(folder))
    assert (choice.source, choice.present, choice.local_dir, choice.path) == (
        SOURCE_OPTION, True, folder.resolve(), str(folder.resolve()))


def test_a_folder_missing_a_shard_or_its_config_is_not_present(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path / "m", shards=2)
    next(folder.glob("model-00002*")).unlink()
    choice = model_choice(load_profile("rtx4090-qwen3-8b"), str(folder))
    assert not choice.present and "lacks 1 weight shard" in choice.detail
    (folder / "config.json").unlink()
    assert "no config.json" in model_choice(load_profile("rtx4090-qwen3-8b"), str(folder)).detail
    assert not model_choice(load_profile("rtx4090-qwen3-8b"), str(tmp_path / "absent")).present


def test_a_hugging_face_id_is_present_only_when_cached_complete(empty_hf_cache: Path) -> None:
    profile = load_profile("rtx4090-qwen3-8b")
    choice = model_choice(profile)
    assert (choice.source, choice.path, choice.present) == (SOURCE_PROFILE, "Qwen/Qwen3-8B", False)
    assert "HF_HUB_OFFLINE=1" in choice.detail
    snapshot = _hf_cache(empty_hf_cache, "Qwen/Qwen3-8B")
    assert hf_cached_folder("Qwen/Qwen3-8B") == snapshot
    choice = model_choice(profile)
    assert choice.present and choice.path == "Qwen/Qwen3-8B" and str(snapshot) in choice.detail
    assert choice.files_dir == snapshot  # where the run reads the model's stop tokens


def test_the_tiny_model_is_looked_for_not_generated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(tinymodel.MODELS_DIR_ENV, str(tmp_path / "models"))
    choice = model_choice(load_profile("cpu-tiny"))
    assert choice.source == SOURCE_TINY and not choice.present and "not generated yet" in choice.detail
    assert choice.path == str(tmp_path / "models" / tinymodel.TINY_MODEL_NAME)
    assert not (tmp_path / "models").exists()
    assert model_choice(load_profile("cpu-tiny"), "/elsewhere").source == SOURCE_OPTION


def test_the_stop_tokens_are_the_tokenizers_eos_and_the_generation_configs(tmp_path):
    """Qwen3's layout: generation_config.json lists two EOS ids, tokenizer_config.json names one."""
    folder = _model_folder(tmp_path / "m")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": {"content": "<|im_end|>"},
        "added_tokens_decoder": {"151643": {"content": "<|endoftext|>"}, "151645": {"content": "<|im_end|>"},
                                 "151644": {"content": "<|im_start|>"}}}))
    assert stop_token_ids(folder) == [151643, 151645]
    (folder / "generation_config.json").unlink()
    assert stop_token_ids(folder) == [151645]
    (folder / "tokenizer_config.json").write_text("not json")
    assert stop_token_ids(folder) is None  # unknown: reconciliation does not judge where answers stop


def test_the_generated_tiny_model_stops_at_im_end(tiny_model):
    assert stop_token_ids(tiny_model) == [2]


def test_max_model_len_is_the_profiles_else_the_models(tmp_path):
    folder = _model_folder(tmp_path / "m")
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 40960}))
    profile = load_profile("cpu-tiny")
    assert model_max_len(folder, profile) == 2048
    unset = dataclasses.replace(profile, model=dataclasses.replace(profile.model, max_model_len=None))
    assert model_max_len(folder, unset) == 40960
