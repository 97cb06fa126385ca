"""Serve a finished job's PEFT LoRA adapter from the running SGLang server, by name.

A plain urllib client of SGLang's ``POST /load_lora_adapter`` (the one entry that loads on
every TP rank and registers the name), importable without SGLang or torch. Never call it
from the scheduler's loop thread or the HTTP server's event loop: the endpoint waits for
every scheduler, so it would wait for itself. Query first: :func:`adapter_problem` refuses
an adapter SGLang would reject vaguely or serve wrongly before anything is sent.

Rules: docs/jobs.md, 'Serving what was trained'.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")  # SGLang falls back to .bin

# SGLang sizes its adapter memory pool per fused module (get_normalized_target_modules in
# sglang/srt/lora/utils.py): a server started with q_proj accepts an adapter on k_proj.
_FUSED_MODULE = {
    "q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
    "vocab_emb": "embed_tokens", "embeddings": "embed_tokens", "word_embeddings": "embed_tokens",
    "output": "lm_head", "unembed_tokens": "lm_head",
}
_ALL_MODULES = ("all", "all-linear")  # PEFT shorthands; SGLang resolves them against the model

# PEFT options SGLang 0.5.23 ignores or refuses, with what would happen.
_UNSERVABLE_OPTIONS = (
    ("use_dora", "DoRA adapters are refused by SGLang's LoRA serving"),
    ("use_rslora", "SGLang scales by lora_alpha / r, not rsLoRA's lora_alpha / sqrt(r)"),
    ("rank_pattern", "SGLang ignores per-module ranks"),
    ("alpha_pattern", "SGLang ignores per-module alphas"),
    ("lora_bias", "SGLang loads no LoRA bias"),
    ("modules_to_save", "SGLang does not load fully trained modules"),
)


class AdapterServingError(RuntimeError):
    """SGLang could not be reached, or refused or failed to load/unload an adapter."""


def lora_serving_problem(server_args: Any) -> str | None:
    """Why this server cannot load adapters dynamically, or None if it can.

    ``server_args`` is SGLang's ServerArgs or anything with its attributes (enable_lora,
    lora_paths, max_lora_rank, lora_target_modules, dp_size, device, lora_backend)."""
    enabled = getattr(server_args, "enable_lora", None)
    startup_adapters = getattr(server_args, "lora_paths", None)
    if not (enabled or (enabled is None and startup_adapters)):
        return ("LoRA serving is off: start SGLang with --enable-lora --max-lora-rank R "
                "--lora-target-modules M [M ...] (R and the modules must cover every adapter to load)")
    if not startup_adapters and not (getattr(server_args, "max_lora_rank", None)
                                     and getattr(server_args, "lora_target_modules", None)):
        return ("--enable-lora without --lora-paths needs both --max-lora-rank and --lora-target-modules: "
                "SGLang sizes its adapter memory pool from them at start-up")
    if (getattr(server_args, "dp_size", 1) or 1) > 1:
        return (f"SGLang 0.5.23 refuses dynamic LoRA loading with data-parallel replicas "
                f"(--dp-size {server_args.dp_size})")
    backend = getattr(server_args, "lora_backend", "csgmv")
    if getattr(server_args, "device", None) == "cpu" and backend != "torch_native":
        return (f"--lora-backend {backend} does not run with --device cpu (its Triton kernels need a GPU); "
                "use --lora-backend torch_native")
    return None


def adapter_problem(adapter_dir: str | Path, server_args: Any) -> str | None:
    """Why this server would refuse the adapter in ``adapter_dir`` (or serve it wrong), or None."""
    problem = lora_serving_problem(server_args)
    if problem:
        return problem
    directory = Path(adapter_dir)
    config, problem = _read_adapter_config(directory)
    if problem:
        return problem
    if not any((directory / name).is_file() for name in WEIGHT_FILES):
        return f"adapter {directory}: no {WEIGHT_FILES[0]} (nor {WEIGHT_FILES[1]})"
    if config.get("peft_type", "LORA") != "LORA":
        return f"adapter {directory}: peft_type {config['peft_type']!r}, SGLang serves only LORA adapters"
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not (isinstance(rank, int) and not isinstance(rank, bool) and rank > 0):
        return f"adapter {directory}: adapter_config.json: r must be an integer > 0, got {rank!r}"
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        return f"adapter {directory}: adapter_config.json: lora_alpha must be a number, got {alpha!r}"
    for option, consequence in _UNSERVABLE_OPTIONS:
        if config.get(option):
            return f"adapter {directory}: {option} = {config[option]!r}: {consequence}"

    max_rank, server_modules = _server_limits(server_args)
    if max_rank is not None and rank > max_rank:
        return (f"adapter {directory}: rank {rank} is above the server's --max-lora-rank {max_rank}; "
                f"restart SGLang with --max-lora-rank >= {rank}, or train with lora_rank <= {max_rank}")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        if targets not in _ALL_MODULES:
            return (f"adapter {directory}: target_modules {targets!r}: SGLang takes a list of module names "
                    f"or one of {list(_ALL_MODULES)}")
        return None  # resolved by SGLang against the model; nothing to compare here
    if not isinstance(targets, list) or not targets:
        return f"adapter {directory}: adapter_config.json: target_modules must be a non-empty list, got {targets!r}"
    if server_modules is not None:
        missing = sorted(_fused_modules(targets) - server_modules)
        if missing:
            return (f"adapter {directory}: target modules {sorted(targets)} need {missing}, which the server's "
                    f"--lora-target-modules {sorted(server_modules)} lacks; restart SGLang with them added")
    return None


def load_adapter(base_url: str, name: str, adapter_dir: str | Path, *, api_key: str | None = None,
                 timeout_s: float = 60.0, pinned: bool = False) -> dict:
    """Load the adapter in ``adapter_dir`` into the server at ``base_url`` as ``name``.

    Returns SGLang's reply ({"success": true, "error_message": "", "loaded_adapters":
    {name: path, ...}, ...}). ``api_key``: SGLang's --admin-api-key if it has one, else its
    --api-key (``adapter_endpoint_key``). ``pinned`` keeps it from LRU eviction
    (--max-loaded-loras)."""
    if not name:
        raise AdapterServingError(f"SGLang at {base_url}: an adapter needs a non-empty name (adapter {adapter_dir})")
    # Absolute: SGLang resolves a relative path against its own working directory, and
    # takes a path that is not a directory for a Hugging Face repo id (a confusing error).
    path = str(Path(adapter_dir).resolve())
    body = {"lora_name": name, "lora_path": path, "pinned": pinned}
    return _post(base_url, "/load_lora_adapter", body, api_key, timeout_s,
                 f"load adapter {name!r} from {path}")


def unload_adapter(base_url: str, name: str, *, api_key: str | None = None, timeout_s: float = 60.0) -> dict:
    """Unload adapter ``name``; SGLang first waits for running requests that use it."""
    return _post(base_url, "/unload_lora_adapter", {"lora_name": name}, api_key, timeout_s,
                 f"unload adapter {name!r}")


def base_url_of(server_args: Any) -> str:
    """The URL a process on the server's machine reaches SGLang at (as ServerArgs.url())."""
    host = getattr(server_args, "host", None) or "127.0.0.1"
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)  # wildcard binds: reach them via loopback
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    scheme = "https" if getattr(server_args, "ssl_certfile", None) else "http"
    return f"{scheme}://{host}:{server_args.port}"


def adapter_endpoint_key(server_args: Any) -> str | None:
    """The key the adapter endpoints accept: they are ADMIN_OPTIONAL in SGLang 0.5.23, so
    with an --admin-api-key only that one, else --api-key, else none is needed."""
    return getattr(server_args, "admin_api_key", None) or getattr(server_args, "api_key", None)


def _post(base_url: str, route: str, body: dict, api_key: str | None, timeout_s: float, action: str) -> dict:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(base_url.rstrip("/") + route, data=json.dumps(body).encode(),
                                     headers=headers, method="POST")
    prefix = f"SGLang at {base_url}: {action}"
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status, text = response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
        raise AdapterServingError(f"{prefix}: HTTP {exc.code}: {_sglang_error_text(text)}") from None
    except TimeoutError:
        raise AdapterServingError(
            f"{prefix}: no answer within {timeout_s:g}s (the server may still finish it)") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise AdapterServingError(f"{prefix}: cannot reach the server: {reason}") from None
    try:
        reply = json.loads(text)
    except ValueError:
        raise AdapterServingError(f"{prefix}: HTTP {status} with a reply that is not JSON: {text[:500]!r}") from None
    if not isinstance(reply, dict) or reply.get("success") is not True:
        raise AdapterServingError(f"{prefix}: failed: {_sglang_error_text(text)}")
    return reply


def _sglang_error_text(text: str) -> str:
    """SGLang's own message out of its error replies: {"success": false, "error_message": ...}
    from the adapter endpoints, {"error": "Unauthorized"} from its auth middleware,
    {"error": {"message": ...}} and FastAPI's {"detail": ...} elsewhere."""
    try:
        reply = json.loads(text)
    except ValueError:
        return text.strip()[:500] or "(empty reply)"
    if isinstance(reply, dict):
        error = reply.get("error_message") or reply.get("error") or reply.get("detail")
        if isinstance(error, dict):
            error = error.get("message", error)
        if error:
            return str(error)
    return text.strip()[:500]


def _read_adapter_config(directory: Path) -> tuple[dict, str | None]:
    if not directory.is_dir():
        return {}, f"adapter {directory}: not a directory"
    config_path = directory / "adapter_config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        return {}, f"adapter {directory}: no adapter_config.json"
    except (OSError, ValueError) as exc:
        return {}, f"adapter {directory}: adapter_config.json unreadable: {exc}"
    if not isinstance(config, dict):
        return {}, f"adapter {directory}: adapter_config.json is not a JSON object"
    return config, None


def _fused_modules(names) -> set[str]:
    return {_FUSED_MODULE.get(name.split(".")[-1], name.split(".")[-1]) for name in names}


def _server_limits(server_args: Any) -> tuple[int | None, set[str] | None]:
    """The server's max rank and fused target modules; None where unknown ("all", or
    inferred from a --lora-paths adapter that is not a readable local directory)."""
    max_rank = getattr(server_args, "max_lora_rank", None)
    modules = getattr(server_args, "lora_target_modules", None)
    modules = None if modules and any(m in _ALL_MODULES for m in modules) else modules
    if max_rank is not None and modules:
        return max_rank, _fused_modules(modules)
    # SGLang infers what was not given from the adapters it loaded at start-up.
    startup = [_read_adapter_config(Path(path))[0] for path in _startup_adapter_paths(server_args)]
    known = bool(startup) and all(config.get("r") and isinstance(config.get("target_modules"), list)
                                  for config in startup)
    if max_rank is None and known:
        max_rank = max(config["r"] for config in startup)
    if not modules and getattr(server_args, "lora_target_modules", None) is None and known:
        modules = [name for config in startup for name in config["target_modules"]]
    return max_rank, _fused_modules(modules) if modules else None


def _startup_adapter_paths(server_args: Any) -> list[str]:
    """Paths of --lora-paths in each form SGLang takes: "path", "name=path", a dict or a
    LoRARef (after SGLang resolved its arguments), or a {name: path} dict."""
    entries = getattr(server_args, "lora_paths", None) or []
    if isinstance(entries, dict):
        return [str(path) for path in entries.values()]
    paths = []
    for entry in entries:
        if isinstance(entry, str):
            paths.append(entry.split("=", 1)[1] if "=" in entry else entry)
        elif isinstance(entry, dict):
            paths.append(str(entry.get("lora_path", "")))
        else:
            paths.append(str(getattr(entry, "lora_path", "")))
    return paths
