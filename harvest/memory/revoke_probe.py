"""Can the CUDA driver take access away from mapped memory (cuMemSetAccess with PROT_NONE),
does a kernel that writes there then fault, and what does a revoke and a grant cost?

The allocator's way under 2P + 3 driver calls per lend and reclaim (docs/design.md §1,
"the shadow mapping") waits on these answers: it is safe only if a revoked range faults.
``hvmm_cuda_probe_revoke`` (csrc/vmm_allocator/revoke_probe.cpp) asks the device; its
last question makes a kernel fault on purpose, which leaves the CUDA context unusable, so
:func:`probe_in_child` runs it in a process of its own.

    python -m harvest.memory.revoke_probe [--pages 64] [--repeats 20] [--no-fault]

prints one JSON object (the last stdout line); exit status 0 when the questions were
asked, 2 without a CUDA driver or GPU, 1 when a set-up call failed.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys

from harvest import native

HVMM_OK, HVMM_ERR_NO_DRIVER = 0, 2
NOT_REACHED = -1
DEFAULT_PAGES = 64  # one Llama-3-8B KV chunk: 32 layers x (K, V) pages of 2 MiB


class _Probe(ctypes.Structure):
    # Mirrors hvmm_revoke_probe_t in csrc/vmm_allocator/hvmm.h.
    _fields_ = [
        ("pages", ctypes.c_int32),
        ("page_bytes", ctypes.c_uint64),
        ("alias_reads_primary", ctypes.c_int32),
        ("revoke_result", ctypes.c_int32),
        ("first_revoke_us", ctypes.c_double),
        ("primary_works_after_revoke", ctypes.c_int32),
        ("regrant_result", ctypes.c_int32),
        ("alias_works_after_regrant", ctypes.c_int32),
        ("timed_repeats", ctypes.c_int32),
        ("revoke_us_median", ctypes.c_double),
        ("grant_us_median", ctypes.c_double),
        ("fault_tried", ctypes.c_int32),
        ("write_after_revoke_result", ctypes.c_int32),
    ]


class ProbeUnavailable(RuntimeError):
    """No CUDA driver or GPU to ask (the message says which)."""


def probe(device: int = 0, pages: int = DEFAULT_PAGES, repeats: int = 20, try_fault: bool = True) -> dict:
    """Ask the device, in this process (with ``try_fault`` this process's CUDA context is
    unusable afterwards). Raises ProbeUnavailable without a driver, RuntimeError naming
    the driver call when a set-up call failed."""
    lib = native.load("vmm")
    run = native.bind(lib, "hvmm_cuda_probe_revoke", ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.POINTER(_Probe))
    last_error = native.bind(lib, "hvmm_last_error", ctypes.c_char_p)
    error_name = native.bind(lib, "hvmm_cu_error_name", ctypes.c_char_p, ctypes.c_int)
    out = _Probe()
    status = run(device, pages, repeats, int(try_fault), ctypes.byref(out))
    if status == HVMM_ERR_NO_DRIVER:
        raise ProbeUnavailable(last_error().decode(errors="replace"))
    if status != HVMM_OK:
        raise RuntimeError(f"hvmm_cuda_probe_revoke: {last_error().decode(errors='replace')}")
    return describe({name: getattr(out, name) for name, _ in _Probe._fields_},
                    lambda code: error_name(code).decode(errors="replace"))


def describe(raw: dict, error_name) -> dict:
    """The probe's fields, with each driver result also by name, and the verdict:
    ``revoke_protects`` is True only when the revoke was accepted, the first mapping and
    the re-granted alias kept working, and the write through the revoked alias faulted;
    None when a question was not reached."""
    result = dict(raw)
    for field in ("revoke_result", "regrant_result", "write_after_revoke_result"):
        code = raw[field]
        reached = code != NOT_REACHED and (field != "write_after_revoke_result" or raw["fault_tried"])
        result[field.replace("_result", "")] = (error_name(code) if code else "CUDA_SUCCESS") if reached else None
    for field in ("first_revoke_us", "revoke_us_median", "grant_us_median"):
        result[field] = None if raw[field] < 0 else round(raw[field], 2)
    for field in ("alias_reads_primary", "primary_works_after_revoke", "alias_works_after_regrant"):
        result[field] = None if raw[field] == NOT_REACHED else bool(raw[field])
    result["revoke_accepted"] = None if raw["revoke_result"] == NOT_REACHED else raw["revoke_result"] == 0
    if result["revoke_accepted"] is False:
        result["revoke_protects"] = False
    elif not raw["fault_tried"] or result["alias_works_after_regrant"] is None:
        result["revoke_protects"] = None
    else:
        result["revoke_protects"] = bool(result["alias_reads_primary"] and result["primary_works_after_revoke"]
                                         and result["alias_works_after_regrant"]
                                         and raw["write_after_revoke_result"] != 0)
    return result


def probe_in_child(device: int = 0, pages: int = DEFAULT_PAGES, repeats: int = 20, timeout_s: float = 60.0) -> dict:
    """:func:`probe` with its fault, in a child interpreter: the caller's CUDA context
    stays usable. Never raises for what the child found: ``{"error": ...}`` says why there
    is no answer (no driver, a failed call, a timeout)."""
    command = [sys.executable, "-m", "harvest.memory.revoke_probe", "--device", str(device), "--pages", str(pages),
               "--repeats", str(repeats)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"the probe did not finish within {timeout_s:.0f} s"}
    lines = done.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"error": f"the probe exited with {done.returncode} and no result: {' | '.join(tail) or 'no output'}"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--pages", type=int, default=DEFAULT_PAGES, help="pages in the aliased run (default: a Llama-3-8B chunk's 64)")
    parser.add_argument("--repeats", type=int, default=20, help="timed revokes and grants")
    parser.add_argument("--no-fault", action="store_true", help="skip the write through the revoked range")
    args = parser.parse_args(argv)
    if args.pages < 1 or args.repeats < 0:
        parser.error(f"--pages must be >= 1 and --repeats >= 0 (got {args.pages}, {args.repeats})")
    try:
        result = probe(args.device, args.pages, args.repeats, try_fault=not args.no_fault)
    except ProbeUnavailable as exc:
        print(json.dumps({"error": f"no CUDA driver or GPU: {exc}"}))
        return 2
    except RuntimeError as exc:
        print(json.dumps({"error": str(exc)}))
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
