"""Real SGLang 0.5.23 on CPU with the tiny local models.

- sglang.Engine greedy output equals HF transformers `generate`, token for token.
- The HTTP server in decode-instance mode (fake KV transfer) completes requests.
- harvest's plugin is discovered through the `sglang.srt.plugins` entry point and runs in
  the server's processes.
"""

from __future__ import annotations

import concurrent.futures
import importlib.metadata
import os

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = [
    "the trainer borrows memory",
    "the quick brown fox",
    "questions ask what, why, where",
    "a model reads text",
]
MAX_NEW_TOKENS = 24


def _hf_greedy(model_path, prompts):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    outputs = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, min_new_tokens=MAX_NEW_TOKENS)
        outputs.append(out[0, ids.shape[1]:].tolist())
    return tokenizer, outputs


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_engine_greedy_matches_hf_generate(family, request):
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    model_path = request.getfixturevalue(f"tiny_{family}_path")
    tokenizer, expected = _hf_greedy(model_path, PROMPTS)

    import sglang

    engine = sglang.Engine(
        model_path=str(model_path),
        device="cpu",
        attention_backend="torch_native",
        grammar_backend="none",
        dtype="float32",
        max_total_tokens=4096,
        disable_cuda_graph=True,
        skip_server_warmup=True,
        log_level="error",
    )
    try:
        prompt_ids = [tokenizer(p).input_ids for p in PROMPTS]
        outs = engine.generate(
            input_ids=prompt_ids,
            sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True},
        )
    finally:
        engine.shutdown()
    got = [out["output_ids"] for out in outs]
    assert got == expected
    # The model is not degenerate: different prompts give different continuations.
    assert len({tuple(g) for g in got}) == len(PROMPTS)


def test_decode_instance_server_completes_requests_with_plugin_loaded(tiny_llama_path, tmp_path):
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    from harvest.sglang import server
    from harvest.sglang.plugin import LOADED_MESSAGE

    args = server.cpu_server_args(tiny_llama_path, decode_instance=True)
    with server.launch(args, log_path=tmp_path / "sglang.log") as srv:
        status, _ = srv.get("/health")
        assert status == 200

        def generate(room):
            return srv.post(
                "/generate",
                {
                    "input_ids": [5 + (room * 11 + j) % 300 for j in range(12 + room)],
                    "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
                    "bootstrap_host": FAKE_BOOTSTRAP_HOST,
                    "bootstrap_room": room,
                },
            )

        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            outs = list(pool.map(generate, range(8)))
        log = srv.log_path.read_text(errors="replace")
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [8] * 8
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    assert "disaggregation_mode='decode'" in log or "'disaggregation_mode': 'decode'" in log
    # Loaded by SGLang itself, in the server's processes (engine and scheduler).
    assert log.count(LOADED_MESSAGE) >= 2, log[-3000:]


def test_plugin_entry_point_is_registered_and_loads():
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=GENERAL_PLUGINS_GROUP)}
    assert names.get("harvest") == "harvest.sglang.plugin:load"
    plugins = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    func, dist = plugins["harvest"]
    assert dist == "harvest"
    assert func() is True


def test_plugin_refuses_other_sglang_versions():
    from harvest.sglang.plugin import version_problem

    assert version_problem("0.5.23") is None
    assert "supports sglang==0.5.23, found 0.5.24" in version_problem("0.5.24")
