"""`harvest doctor`: what this machine offers harvest (versions, GPU, VMM, green contexts,
whether CUDA_DEVICE_MAX_CONNECTIONS gives harvest's streams their own hardware queues).

Everything is probed through harvest's own native libraries (the driver API, opened at run
time), so the answer is what harvest itself will see. Without a driver or GPU it says
so plainly; that is a valid configuration (CPU development), not an error. Given a
profile (``--profile``, or ``--config`` naming harvest.yaml and so its profile), it shows
the lend/reclaim costs the profile measured and which figure a server's auto reserve
counts (harvest.memory.lend_costs); a profile or config it cannot read exits 1.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.metadata
import platform
import sys
from typing import Any

import harvest
from harvest import native
from harvest.compute import device
from harvest.compute.device import GpuInfo, probe_gpus


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _native_libraries() -> dict[str, dict[str, Any]]:
    result: dict[str, dict[str, Any]] = {}
    for name, version_fn in (("vmm", "hvmm_version"), ("greenctx", "hgc_version")):
        try:
            lib = native.load(name)
            version = native.bind(lib, version_fn, ctypes.c_char_p)().decode()
            result[name] = {"path": str(native.library_path(name)), "version": version}
        except (native.NativeLibraryNotFound, OSError) as exc:
            result[name] = {"path": None, "error": str(exc)}
    return result


def collect(profile=None, config=None) -> dict[str, Any]:
    """The full report as a JSON-able dict (the schema of `harvest doctor --json`);
    ``profile`` / ``config``: paths given with --profile / --config (see :func:`lend_costs`)."""
    import torch

    gpus, no_gpu_reason, driver_version = probe_gpus()
    ladder = _ladder(gpus)
    extra = {} if profile is None and config is None else {"lend_costs": lend_costs(profile, config)}
    return {**extra, 
        # A source checkout on PYTHONPATH (the GPU validation) has no distribution metadata.
        "harvest": _version("harvest") or harvest.__version__,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "packages": {
            "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "sglang": _version("sglang"),
            "llamafactory": _version("llamafactory"),
            "transformers": _version("transformers"),
            "peft": _version("peft"),
            "scikit-learn": _version("scikit-learn"),
            "prometheus-client": _version("prometheus-client"),
            "nvidia-ml-py": _version("nvidia-ml-py"),
            "cuda-python": _version("cuda-python"),
        },
        "cuda_driver": {
            "present": driver_version is not None,
            "version": _format_driver_version(driver_version),
        },
        "gpu_present": bool(gpus),
        "no_gpu_reason": no_gpu_reason,
        "gpus": [dataclasses.asdict(g) for g in gpus],
        "native_libraries": _native_libraries(),
        "ladder": ladder,
        "cuda_connections": cuda_connections(ladder if gpus else None),
    }


def lend_costs(profile=None, config=None) -> dict[str, Any]:
    """What a lend and a reclaim of one KV chunk cost as ``profile`` measured them (its
    ``memory`` section; with ``config``, harvest.yaml's profile and its own
    ``memory.reclaim_ms_per_chunk``, which wins), and the figure a server's auto reserve
    counts. ``error`` says why a file could not be read."""
    from harvest.memory import lend_costs as costs_mod

    report: dict[str, Any] = {"profile": None if profile is None else str(profile), "config": None,
                              "configured_reclaim_ms_per_chunk": None, "memory": None, "reserve_counts": None,
                              "error": None}
    if config is not None:
        from harvest.config import ConfigError, load

        report["config"] = str(config)
        try:
            loaded = load(config)
        except ConfigError as exc:
            return {**report, "error": str(exc)}
        report["configured_reclaim_ms_per_chunk"] = loaded.memory.reclaim_ms_per_chunk
        if profile is None and loaded.profile is not None:
            profile = loaded.profile
            report["profile"] = str(profile)
    section = None
    if profile is not None:
        from harvest.predict.schema import ProfileError, read_memory_section

        try:
            section = read_memory_section(profile)
        except ProfileError as exc:
            return {**report, "error": str(exc)}
    if section is not None:
        report["memory"] = {**dataclasses.asdict(section), "lend_ms_per_page": section.ms_per_page(section.lend_ms_per_chunk),
                            "reclaim_ms_per_page": section.ms_per_page(section.reclaim_ms_per_chunk)}
    chunk_bytes = section.chunk_bytes if section is not None else costs_mod.DEFAULT_FIGURE_CHUNK_BYTES
    resolved = costs_mod.resolve(chunk_bytes, measured=section, measured_where=None if profile is None else f"profile {profile}",
                                 configured_reclaim_ms=report["configured_reclaim_ms_per_chunk"],
                                 configured_where="harvest.yaml's memory.reclaim_ms_per_chunk")
    report["reserve_counts"] = {"reclaim_ms_per_chunk": resolved.reclaim_ms_per_chunk, "source": resolved.source,
                                "detail": resolved.detail, "warning": resolved.warning}
    return report


def cuda_connections(ladder: dict[str, Any] | None, environ=None) -> dict[str, Any]:
    """CUDA_DEVICE_MAX_CONNECTIONS as this shell has it (harvest launch and harvest's
    scripts set it to 32 when unset) against the streams ``ladder`` (the doctor's ladder
    report; None without a GPU: no streams) makes harvest use."""
    import os

    environ = os.environ if environ is None else environ
    streams = 0
    if ladder is not None:
        streams = device.ladder_streams(len(ladder["levels"]), ladder["spatial"])
    return {
        "env": environ.get(device.CUDA_CONNECTIONS_VAR),
        "connections": device.cuda_connections(environ),
        "harvest_streams": streams,
        "warning": device.connections_problem(streams, environ) if streams else None,
    }


def _ladder(gpus: list[GpuInfo]) -> dict[str, Any]:
    """The SM ladder harvest would build here (GPU 0), or the one shared level on CPU."""
    from harvest.compute.factory import ladder_report

    return ladder_report("cuda:0" if gpus else "cpu")


def _format_driver_version(version: int | None) -> str | None:
    if version is None:
        return None
    return f"{version // 1000}.{(version % 1000) // 10}"


def render_text(report: dict[str, Any]) -> str:
    lines = [f"harvest {report['harvest']}  (Python {report['python']}, {report['platform']})"]
    pkgs = report["packages"]
    shown = {**pkgs, "torch_cuda": pkgs["torch_cuda"] or "none (CPU build)"}
    lines.append(
        "packages: " + ", ".join(f"{k} {v if v is not None else '(not installed)'}" for k, v in shown.items())
    )
    for name, lib in report["native_libraries"].items():
        lines.append(f"native {name}: " + (f"{lib['version']} at {lib['path']}" if lib.get("path") else lib["error"]))
    driver = report["cuda_driver"]
    lines.append(f"CUDA driver: {driver['version'] if driver['present'] else 'none'}")
    if not report["gpu_present"]:
        lines.append(f"GPU: none ({report['no_gpu_reason']})")
        lines.append("harvest runs here in CPU mode: host VMM backend, one SM level (no spatial partitioning).")
    for gpu in report["gpus"]:
        constraints = (
            f"min partition {gpu['min_sm_partition_size']} SMs, alignment {gpu['sm_coscheduled_alignment']}"
            if gpu["min_sm_partition_size"]
            else "partition constraints not reported by the driver (arch rules apply)"
        )
        lines.append(
            f"GPU {gpu['ordinal']}: {gpu['name']}, {gpu['sm_count']} SMs, cc {gpu['compute_capability']}, "
            f"{gpu['total_memory_bytes'] / 2**30:.1f} GiB; VMM {'yes' if gpu['vmm_supported'] else 'NO'}"
            f" (page {gpu['vmm_granularity_bytes'] // 2**20} MiB); green contexts "
            f"{'yes' if gpu['green_contexts_supported'] else 'NO'} ({constraints})"
        )
    ladder = report.get("ladder")
    if ladder is not None:
        if ladder["spatial"]:
            pairs = ", ".join(f"{lv['decode_sms']}/{lv['trainer_sms']}" for lv in ladder["levels"])
            lines.append(
                f"SM ladder (decode/trainer SMs): {pairs}; constraints: {ladder['constraints']['source']}"
            )
            lines.extend(f"  note: {note}" for note in ladder["preview_notes"])
        else:
            lines.append(f"SM ladder: 1 level, no spatial partitioning ({ladder['note']})")
    lines.extend(_lend_cost_lines(report.get("lend_costs")))
    connections = report.get("cuda_connections")
    if connections is not None:
        value = connections["env"] if connections["env"] is not None else "unset"
        line = f"{device.CUDA_CONNECTIONS_VAR}: {value} ({connections['connections']} hardware queues"
        line += f" for {connections['harvest_streams']} harvest streams)" if connections["harvest_streams"] else ")"
        lines.append(line)
        if connections["warning"]:
            lines.append(f"  WARNING: {connections['warning']}")
    return "\n".join(lines)


def _lend_cost_lines(costs: dict[str, Any] | None) -> list[str]:
    if costs is None:
        return []
    if costs["error"] is not None:
        return [f"lend/reclaim costs: cannot read them: {costs['error']}"]
    lines = []
    memory, counts = costs["memory"], costs["reserve_counts"]
    if costs["profile"] is None:
        lines.append("lend/reclaim costs: no profile given or configured")
    elif memory is None:
        lines.append(f"lend/reclaim costs: profile {costs['profile']} has no memory section (not measured; re-run "
                     "`harvest profile` to measure them)")
    else:
        pages = memory["pages_per_chunk"]
        per_page = ("" if pages is None else f" ({pages} pages: {memory['lend_ms_per_page'] * 1e3:.3g} / "
                    f"{memory['reclaim_ms_per_page'] * 1e3:.3g} us per page)")
        lines.append(f"lend/reclaim costs: profile {costs['profile']}: a lend {memory['lend_ms_per_chunk']:.3g} ms, a "
                     f"reclaim {memory['reclaim_ms_per_chunk']:.3g} ms per chunk of {memory['chunk_bytes'] / 2**20:.4g} "
                     f"MiB{per_page}")
    lines.append(f"  the auto reserve counts {counts['reclaim_ms_per_chunk']:.3g} ms per chunk reclaimed: {counts['detail']}"
                 + ("" if memory is None or counts["source"] != "profile" else " (a server scales it to its own chunk's bytes)"))
    if counts["warning"]:
        lines.append(f"  WARNING: {counts['warning']}")
    return lines


HELP = "report versions, GPU, VMM and green-context support (and a profile's lend/reclaim costs)"


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--profile", default=None, help="a calibration profile: show the lend/reclaim costs it measured")
    parser.add_argument("--config", default=None, help="a harvest.yaml: show the lend/reclaim costs of its profile and "
                        "its memory.reclaim_ms_per_chunk")


def run(args) -> int:
    import json

    report = collect(getattr(args, "profile", None), getattr(args, "config", None))
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(render_text(report))
    return 1 if report.get("lend_costs", {}).get("error") else 0
