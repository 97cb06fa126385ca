"""Serving a finished adapter from the running SGLang server (harvest/sglang/adapters.py).

- the checks made before SGLang is called: a server that cannot load adapters, an adapter
  it would refuse (rank, target modules, files) or serve wrong (options it ignores);
- the client against a local stand-in for SGLang's endpoint (the HTTP boundary only):
  the body and auth header sent, SGLang's failure replies, an unreachable server;
- (slow) a real CPU SGLang server with LoRA enabled loads a PEFT adapter by name, and
  greedy /generate with that name gives PEFT's own greedy tokens.
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from harvest.sglang import adapters
from harvest.sglang.adapters import AdapterServingError


def _server_args(**overrides):
    args = dict(enable_lora=True, lora_paths=None, max_lora_rank=8, lora_target_modules=["q_proj", "v_proj"],
                dp_size=1, device="cuda", lora_backend="csgmv", host="127.0.0.1", port=30000,
                api_key=None, admin_api_key=None, ssl_certfile=None)
    args.update(overrides)
    return SimpleNamespace(**args)


def _adapter(directory: Path, weights: bool = True, **config) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    fields = dict(peft_type="LORA", r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], use_dora=False,
                  use_rslora=False, rank_pattern={}, alpha_pattern={}, lora_bias=False, modules_to_save=None)
    fields.update(config)
    (directory / "adapter_config.json").write_text(json.dumps(fields))
    if weights:
        (directory / "adapter_model.safetensors").write_bytes(b"\0")
    return directory


# -- lora_serving_problem ---------------------------------------------------------------


@pytest.mark.parametrize("overrides, expected", [
    (dict(enable_lora=None), "--enable-lora"),
    (dict(enable_lora=False, lora_paths=["a=/x"]), "LoRA serving is off"),
    (dict(max_lora_rank=None), "--max-lora-rank and --lora-target-modules"),
    (dict(lora_target_modules=None), "--max-lora-rank and --lora-target-modules"),
    (dict(dp_size=2), "--dp-size 2"),
    (dict(device="cpu"), "--lora-backend torch_native"),
])
def test_serving_problem_names_the_flag(overrides, expected):
    problem = adapters.lora_serving_problem(_server_args(**overrides))
    assert problem is not None and expected in problem


@pytest.mark.parametrize("overrides", [
    {},
    dict(device="cpu", lora_backend="torch_native"),
    # --enable-lora implied by --lora-paths, the limits taken from its adapters
    dict(enable_lora=None, lora_paths=["a=/x"], max_lora_rank=None, lora_target_modules=None),
])
def test_server_able_to_serve_has_no_problem(overrides):
    assert adapters.lora_serving_problem(_server_args(**overrides)) is None


# -- adapter_problem ----------------------------------------------------------------------


def test_adapter_within_the_servers_limits_has_no_problem(tmp_path):
    assert adapters.adapter_problem(_adapter(tmp_path / "a"), _server_args()) is None
    # SGLang pools q/k/v as one fused module: a q_proj server takes a k_proj adapter.
    assert adapters.adapter_problem(_adapter(tmp_path / "k", target_modules=["k_proj"], r=4), _server_args()) is None
    assert adapters.adapter_problem(_adapter(tmp_path / "all", target_modules="all-linear"), _server_args()) is None
    assert adapters.adapter_problem(_adapter(tmp_path / "b", target_modules=["gate_proj"]),
                                    _server_args(lora_target_modules=["all"])) is None


@pytest.mark.parametrize("config, expected", [
    (dict(r=16), "rank 16 is above the server's --max-lora-rank 8"),
    (dict(target_modules=["q_proj", "gate_proj"]), "need ['gate_up_proj']"),
    (dict(target_modules="attn"), "target_modules 'attn'"),
    (dict(target_modules=[]), "non-empty list"),
    (dict(r=0), "r must be an integer > 0"),
    (dict(use_rslora=True), "use_rslora"),
    (dict(use_dora=True), "DoRA"),
    (dict(rank_pattern={"q_proj": 4}), "per-module ranks"),
    (dict(lora_bias=True), "bias"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(peft_type="IA3"), "peft_type 'IA3'"),
])
def test_adapter_the_server_would_refuse_or_serve_wrong(tmp_path, config, expected):
    directory = _adapter(tmp_path / "job-out", **config)
    problem = adapters.adapter_problem(directory, _server_args())
    assert problem is not None and expected in problem and str(directory) in problem


def test_missing_or_broken_adapter_files(tmp_path):
    args = _server_args()
    assert "not a directory" in adapters.adapter_problem(tmp_path / "absent", args)
    (tmp_path / "empty").mkdir()
    assert "no adapter_config.json" in adapters.adapter_problem(tmp_path / "empty", args)
    assert "no adapter_model.safetensors" in adapters.adapter_problem(_adapter(tmp_path / "w", weights=False), args)
    broken = _adapter(tmp_path / "broken")
    (broken / "adapter_config.json").write_text("{not json")
    assert "adapter_config.json unreadable" in adapters.adapter_problem(broken, args)


def test_a_server_off_is_the_adapters_problem_too(tmp_path):
    assert "LoRA serving is off" in adapters.adapter_problem(_adapter(tmp_path / "a"), _server_args(enable_lora=None))


def test_limits_inferred_from_startup_adapters(tmp_path):
    """Without --max-lora-rank/--lora-target-modules SGLang takes both from --lora-paths."""
    startup = _adapter(tmp_path / "startup", r=8, target_modules=["q_proj"])
    for lora_paths in ([f"first={startup}"], [str(startup)], [{"lora_name": "first", "lora_path": str(startup)}],
                       [SimpleNamespace(lora_name="first", lora_path=str(startup))], {"first": str(startup)}):
        args = _server_args(enable_lora=None, lora_paths=lora_paths, max_lora_rank=None, lora_target_modules=None)
        assert adapters.adapter_problem(_adapter(tmp_path / "ok", r=8, target_modules=["v_proj"]), args) is None
        assert "--max-lora-rank 8" in adapters.adapter_problem(_adapter(tmp_path / "big", r=16), args)
        mlp = _adapter(tmp_path / "mlp", target_modules=["up_proj"])
        assert "['gate_up_proj']" in adapters.adapter_problem(mlp, args)
    # A startup adapter that is not a local directory (a hub id): the limits are unknown, SGLang decides.
    args = _server_args(enable_lora=None, lora_paths=["hub/adapter"], max_lora_rank=None, lora_target_modules=None)
    assert adapters.adapter_problem(_adapter(tmp_path / "big", r=64), args) is None


# -- base_url_of, adapter_endpoint_key ---------------------------------------------------------


@pytest.mark.parametrize("host, ssl, url", [
    ("0.0.0.0", None, "http://127.0.0.1:30000"),
    ("::", None, "http://[::1]:30000"),
    ("fe80::1", None, "http://[fe80::1]:30000"),
    ("10.1.2.3", "/cert.pem", "https://10.1.2.3:30000"),
    (None, None, "http://127.0.0.1:30000"),
])
def test_base_url_of(host, ssl, url):
    assert adapters.base_url_of(_server_args(host=host, ssl_certfile=ssl)) == url


def test_endpoint_key_is_the_admin_key_when_there_is_one():
    assert adapters.adapter_endpoint_key(_server_args(api_key="user", admin_api_key="admin")) == "admin"
    assert adapters.adapter_endpoint_key(_server_args(api_key="user")) == "user"
    assert adapters.adapter_endpoint_key(_server_args()) is None


# -- load_adapter / unload_adapter against a stand-in endpoint ---------------------------------


class _FakeSGLang(http.server.BaseHTTPRequestHandler):
    """Answers as SGLang 0.5.23's /load_lora_adapter and /unload_lora_adapter do
    (ADMIN_OPTIONAL auth; LoRAUpdateOutput bodies, 400 when success is false)."""

    key: str | None = None
    reply: tuple[int, dict | str] | None = None  # forced answer
    requests: list

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append((self.path, dict(self.headers), body))
        if self.key and self.headers.get("Authorization") != f"Bearer {self.key}":
            return self._send(401, {"error": "Unauthorized"})
        if self.reply:
            return self._send(*self.reply)
        if self.path == "/load_lora_adapter":
            return self._send(200, {"rid": None, "http_worker_ipc": None, "success": True, "error_message": "",
                                    "loaded_adapters": {body["lora_name"]: body["lora_path"]}})
        return self._send(200, {"rid": None, "success": True, "error_message": "", "loaded_adapters": {}})

    def _send(self, status, payload):
        data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_sglang():
    handler = type("Handler", (_FakeSGLang,), {"requests": []})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    handler.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    yield handler
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=10)


@pytest.mark.timeout(30)
def test_load_sends_sglangs_body_and_returns_its_reply(fake_sglang, tmp_path, monkeypatch):
    adapter = _adapter(tmp_path / "out")
    monkeypatch.chdir(tmp_path)
    reply = adapters.load_adapter(fake_sglang.url, "support-bot", "out")
    path, headers, body = fake_sglang.requests[-1]
    assert path == "/load_lora_adapter"
    # Absolute: the server's working directory is not ours.
    assert body == {"lora_name": "support-bot", "lora_path": str(adapter.resolve()), "pinned": False}
    assert "Authorization" not in headers
    assert reply["success"] is True and reply["loaded_adapters"] == {"support-bot": str(adapter.resolve())}

    adapters.unload_adapter(fake_sglang.url, "support-bot")
    assert fake_sglang.requests[-1][0] == "/unload_lora_adapter"
    assert fake_sglang.requests[-1][2] == {"lora_name": "support-bot"}


@pytest.mark.timeout(30)
def test_bearer_key_is_sent_and_a_wrong_one_named(fake_sglang, tmp_path):
    fake_sglang.key = "admin-secret"
    adapter = _adapter(tmp_path / "out")
    adapters.load_adapter(fake_sglang.url, "a", adapter, api_key="admin-secret")
    assert fake_sglang.requests[-1][1]["Authorization"] == "Bearer admin-secret"
    with pytest.raises(AdapterServingError, match="HTTP 401: Unauthorized"):
        adapters.load_adapter(fake_sglang.url, "a", adapter, api_key="user-key")
    with pytest.raises(AdapterServingError, match="HTTP 401"):
        adapters.unload_adapter(fake_sglang.url, "a")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("status", [400, 200])
def test_sglangs_failure_reply_is_quoted(fake_sglang, tmp_path, status):
    message = "Failed to load LoRA adapter a because it is already loaded"
    fake_sglang.reply = (status, {"rid": None, "success": False, "error_message": message, "loaded_adapters": {}})
    adapter = _adapter(tmp_path / "out")
    with pytest.raises(AdapterServingError) as raised:
        adapters.load_adapter(fake_sglang.url, "a", adapter)
    text = str(raised.value)
    assert fake_sglang.url in text and "'a'" in text and str(adapter.resolve()) in text and message in text


@pytest.mark.timeout(30)
def test_reply_that_is_not_sglangs(fake_sglang, tmp_path):
    fake_sglang.reply = (200, "<html>proxy</html>")
    with pytest.raises(AdapterServingError, match="not JSON"):
        adapters.load_adapter(fake_sglang.url, "a", _adapter(tmp_path / "out"))
    fake_sglang.reply = (500, "Internal Server Error")
    with pytest.raises(AdapterServingError, match="HTTP 500: Internal Server Error"):
        adapters.unload_adapter(fake_sglang.url, "a")


@pytest.mark.timeout(30)
def test_unreachable_server_is_named(tmp_path):
    from harvest.sglang.server import free_port

    # A port nothing listens on, below the ephemeral range (one from the OS's range may be
    # an outgoing connection's by the time it is dialed, or this dial's own: no refusal).
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(AdapterServingError) as raised:
        adapters.load_adapter(url, "a", _adapter(tmp_path / "out"), timeout_s=5)
    assert url in str(raised.value) and "cannot reach the server" in str(raised.value)
    assert "refused" in str(raised.value).lower()


@pytest.mark.timeout(30)
def test_silent_server_times_out():
    with socket.socket() as listener:  # accepts, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(AdapterServingError, match=r"no answer within 0.5s"):
            adapters.unload_adapter(url, "a", timeout_s=0.5)


def test_empty_name_is_refused_before_any_call(tmp_path):
    with pytest.raises(AdapterServingError, match="non-empty name"):
        adapters.load_adapter("http://127.0.0.1:1", "", tmp_path)


# -- a real SGLang server on CPU -----------------------------------------------------------------

# SGLang 0.5.23's LoRA layers and backends allocate pinned host tensors unconditionally
# (pin_memory=True in sglang/srt/lora/layers.py and backend/torch_backend.py, .pin_memory()
# in lora.py and torch_backend.py); a CPU-only torch build has no pinned allocator, so
# without this the server dies at start-up: "RuntimeError: pin_memory=True requires a CUDA
# or other accelerator backend". Pinning only speeds host-to-device copies, so on a CPU
# device it can be a no-op. Given to the server's processes only (sitecustomize on their
# PYTHONPATH).
#
# Only those two modules see factories without pinning (their ``torch`` global is swapped
# for a view of torch), never ``torch.*`` itself: torch's device contexts (``with
# torch.device("meta")``, which transformers builds models under) find factories by
# identity, so replacing ``torch.arange`` and the like made them allocate real, unset
# memory there; the trainer in the same process then loaded its model with uninitialised
# rotary frequencies (garbage RoPE, sometimes a NaN loss at step 1).
_PIN_MEMORY_SHIM = '''
import importlib.abc, importlib.machinery, sys

_UNPINNED_MODULES = ("sglang.srt.lora.layers", "sglang.srt.lora.backend.torch_backend")


class _TorchWithoutPinning:
    """torch, except that its factories ignore ``pin_memory``."""

    def __init__(self, torch):
        self._torch = torch

    def __getattr__(self, name):
        value = getattr(self._torch, name)
        if name in ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_strided", "as_tensor"):
            def without_pinning(*args, **kwargs):
                kwargs.pop("pin_memory", None)
                return value(*args, **kwargs)
            return without_pinning
        return value


class _Unpinning(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _UNPINNED_MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            exec_module = spec.loader.exec_module

            def exec_unpinned(module):
                exec_module(module)
                import torch
                if not torch.cuda.is_available():
                    module.torch = _TorchWithoutPinning(torch)
                    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self

            spec.loader.exec_module = exec_unpinned
        return spec


sys.meta_path.insert(0, _Unpinning())
'''

def lora_cpu_server_env(tmp_path):
    """The CPU server's environment with pinning made a no-op (``_PIN_MEMORY_SHIM``)."""
    from harvest.sglang import server

    shim = tmp_path / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(_PIN_MEMORY_SHIM)
    env = server.cpu_server_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), env.get("PYTHONPATH")]))
    return env


PROMPTS = [[5, 17, 33, 40, 81, 99, 120, 7], [200, 13, 64, 9, 150, 31]]
NUM_NEW_TOKENS = 12


def _peft_adapter_and_greedy(model_path, adapter_dir):
    """A rank-8 LoRA on q_proj/v_proj with random (non-zero) B, saved as PEFT saves it,
    and the greedy continuations of PROMPTS by the base model and by the PEFT model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)

    def greedy(m):
        outputs = []
        for ids in PROMPTS:
            prompt = torch.tensor([ids])
            out = m.generate(prompt, max_new_tokens=NUM_NEW_TOKENS, min_new_tokens=NUM_NEW_TOKENS, do_sample=False)
            outputs.append(out[0, prompt.shape[1]:].tolist())
        return outputs

    base = greedy(model)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                  init_lora_weights=False))
    peft_model.eval()
    peft_model.save_pretrained(str(adapter_dir))
    return base, greedy(peft_model)


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_real_cpu_server_serves_a_loaded_adapter(tiny_llama_path, tmp_path, monkeypatch):
    from harvest.sglang import server

    adapter_dir = tmp_path / "job-output"
    base_tokens, peft_tokens = _peft_adapter_and_greedy(tiny_llama_path, adapter_dir)
    assert base_tokens != peft_tokens  # else the comparison below proves nothing

    def lora_flags(max_rank):
        return server.cpu_server_args(tiny_llama_path) + [
            "--enable-lora", "--max-lora-rank", str(max_rank), "--lora-target-modules", "q_proj", "v_proj",
            "--lora-backend", "torch_native",  # the default csgmv's Triton kernels need a GPU
        ]

    # The checks read SGLang's own ServerArgs for these flags.
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    from sglang.srt.server_args import prepare_server_args

    flags = lora_flags(8)
    server_args = prepare_server_args(flags)
    assert adapters.lora_serving_problem(server_args) is None
    assert adapters.adapter_problem(adapter_dir, server_args) is None
    assert "--max-lora-rank 4" in adapters.adapter_problem(adapter_dir, prepare_server_args(lora_flags(4)))

    env = lora_cpu_server_env(tmp_path)

    def generate(srv, ids, lora=None):
        payload = {"input_ids": ids, "sampling_params": {"max_new_tokens": NUM_NEW_TOKENS, "temperature": 0,
                                                         "ignore_eos": True}}
        if lora:
            payload["lora_path"] = lora
        return srv.post("/generate", payload)["output_ids"]

    with server.launch(flags, log_path=tmp_path / "server.log", env=env, timeout_s=240) as srv:
        assert [generate(srv, ids) for ids in PROMPTS] == base_tokens

        reply = adapters.load_adapter(srv.base_url, "support-bot", adapter_dir)
        assert reply["loaded_adapters"] == {"support-bot": str(adapter_dir.resolve())}
        assert [generate(srv, ids, "support-bot") for ids in PROMPTS] == peft_tokens
        assert [generate(srv, ids) for ids in PROMPTS] == base_tokens  # the base model is untouched

        with pytest.raises(AdapterServingError, match="support-bot because it is already loaded"):
            adapters.load_adapter(srv.base_url, "support-bot", adapter_dir)

        adapters.unload_adapter(srv.base_url, "support-bot")
        with pytest.raises(AdapterServingError, match="does not exist"):
            adapters.unload_adapter(srv.base_url, "support-bot")
        # SGLang 0.5.23 remembers every name it loaded (TokenizerManager.lora_ref_cache, kept
        # for --max-loaded-loras eviction): a request naming an unloaded adapter reloads it
        # from its path. Unloading frees the memory; it does not retire the name.
        assert generate(srv, PROMPTS[0], "support-bot") == peft_tokens[0]
        adapters.unload_adapter(srv.base_url, "support-bot")
