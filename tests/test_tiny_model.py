"""The tiny local models: deterministic, cached, loadable by transformers."""

from __future__ import annotations

import json

import pytest

from harvest import tiny_model


def test_cached_models_load_with_expected_shapes(tiny_llama_path, tiny_qwen2_path):
    for path, model_type in ((tiny_llama_path, "llama"), (tiny_qwen2_path, "qwen2")):
        config = json.loads((path / "config.json").read_text())
        assert config["model_type"] == model_type
        assert config["num_hidden_layers"] == 2 and config["num_key_value_heads"] == 2
        assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()


def test_tokenizer_round_trips_text(tiny_llama_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    text = "the scheduler predicts the latency of the next step"
    ids = tokenizer(text).input_ids
    assert len(ids) < len(text) / 2  # BPE merges learned from the corpus, not raw bytes
    assert tokenizer.decode(ids) == text
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == "<|user|>hi<|assistant|>"


def test_build_is_deterministic(tmp_path, monkeypatch):
    import hashlib

    monkeypatch.setenv("HARVEST_CACHE_DIR", str(tmp_path))
    spec = tiny_model.TinyModelSpec(num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    first = tiny_model.ensure_tiny_model(spec)
    digest = hashlib.sha256((first / "model.safetensors").read_bytes()).hexdigest()
    again = tiny_model.ensure_tiny_model(spec)  # cached: same directory, no rebuild
    assert again == first
    import shutil

    shutil.rmtree(first)
    rebuilt = tiny_model.ensure_tiny_model(spec)
    assert hashlib.sha256((rebuilt / "model.safetensors").read_bytes()).hexdigest() == digest


def test_unknown_family_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("HARVEST_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="TinyModelSpec.family: unknown family 'gpt'"):
        tiny_model.ensure_tiny_model(tiny_model.TinyModelSpec(family="gpt"))
    assert not any(p.name.startswith("tiny-gpt") for p in (tmp_path / "tiny-models").iterdir())
