#!/usr/bin/env python3
"""Check that the CUDA stack of `scripts/setup_env.sh --cuda` resolves, and to what.

For each Python version (3.11 and 3.12 by default) this runs pip's resolver the way the
setup script installs, without installing anything:

    pip --isolated install --dry-run --ignore-installed --report R.json \
        --only-binary=:all: --platform manylinux_2_{5..35}_x86_64 ... --python-version X \
        -r requirements/cuda.txt -c requirements/lock-cuda.txt

and a second, --no-deps, run for llamafactory==0.9.5 (installed --no-deps by the setup
script), then checks the resolved set: sglang's pins (torch 2.14.1 CUDA 13.0 build,
transformers 5.19.0, sglang-kernel, flashinfer, ...), LlamaFactory's runtime set,
LlamaFactory's own requirements (only the known waivers may fail), every requirement of
every resolved package, harvest's pyproject.toml dependencies and the lock. It prints a
table and one JSON line, and exits 1 on any mismatch (2 when pip itself fails).

It needs the package registry, so it is not part of `make test`; the checking logic is
unit-tested offline (tests/test_cuda_resolution.py). Local pip configuration (find-links,
extra indexes, global constraints) is ignored (--isolated): the answer is what a GPU
server with only PyPI gets. pip evaluates environment markers with the interpreter that
runs it, not --python-version, so each version is resolved by a throwaway venv of a real
interpreter of that version when one is found (pyenv's included); otherwise the current
interpreter resolves with --python-version and the row `interpreter` says so.

    python3 scripts/check_cuda_resolution.py                # check (3.11 and 3.12)
    python3 scripts/check_cuda_resolution.py --write-lock   # re-resolve without the lock, rewrite it
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # pip always carries a copy
    from pip._vendor.packaging.markers import default_environment  # type: ignore[no-redef]
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.specifiers import SpecifierSet  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[no-redef]
    from pip._vendor.packaging.version import Version  # type: ignore[no-redef]

try:
    import tomllib
except ImportError:  # Python < 3.11
    from pip._vendor import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = ROOT / "requirements" / "cuda.txt"
LOCK = ROOT / "requirements" / "lock-cuda.txt"
PYPROJECT = ROOT / "pyproject.toml"
PYTHONS = ("3.11", "3.12")
# glibc of the oldest server we target (Ubuntu 22.04: 2.35); sglang 0.5.23 itself ships
# manylinux_2_34 wheels only, so nothing older than 2.34 can install it.
DEFAULT_GLIBC = "2.35"
LLAMAFACTORY = "llamafactory==0.9.5"

# What the resolution must produce: sglang 0.5.23's own pins (its METADATA Requires-Dist),
# the LlamaFactory runtime set of requirements/cuda.txt, and CUDA 13.0 for torch.
EXPECTED: dict[str, str] = {
    "sglang": "==0.5.23",
    "torch": "==2.14.1",
    "transformers": "==5.19.0",
    "tokenizers": "==0.23.2",
    "sglang-kernel": "==0.4.10",
    "flashinfer-python": "==0.7.2",
    "torchaudio": "==2.11.0",
    "torchvision": "==0.29.1",  # the CUDA 13.0 build (0.29.2 is CUDA 13.2)
    "cuda-toolkit": "==13.0.*",
    "nvidia-cuda-runtime": "==13.0.*",
    "cuda-python": ">=13.0",
    "peft": "==0.18.1",
    "datasets": "==4.0.0",
    "accelerate": "==1.11.0",
    "trl": "==0.24.0",
    "torchdata": "==0.11.0",
    "tyro": "<0.9",
    "omegaconf": "",
    "matplotlib": "",
    "scikit-learn": "",
}
# LlamaFactory 0.9.5 requirements that the stack does not satisfy, on purpose.
LLAMAFACTORY_WAIVED = {
    "transformers": "declares <=5.6.0; runs on sglang's 5.19.0 with DISABLE_VERSION_CHECK=1",
}
LLAMAFACTORY_OMITTED = {
    "gradio": "LlamaFactory's web UI",
    "av": "video datasets",
    "hf-transfer": "hub download accelerator",
}


@dataclass
class Check:
    name: str
    expected: str
    found: str
    ok: bool
    note: str = ""


@dataclass
class Resolution:
    """One Python version's resolver output, reduced to what the checks need."""

    python: str
    versions: dict[str, str]  # canonical name -> version
    requires: dict[str, list[str]]  # canonical name -> Requires-Dist lines
    extras: dict[str, list[str]]  # canonical name -> extras requested of it
    environment: dict[str, str]  # marker environment of the target
    llamafactory_requires: list[str] = field(default_factory=list)
    interpreter: str = ""


# ----------------------------------------------------------------------------- parsing


def target_environment(python: str, host: dict[str, str] | None = None) -> dict[str, str]:
    """Marker environment of CPython `python` on Linux x86-64 (the host's, re-aimed)."""
    env = dict(host or default_environment())
    env.update(
        python_version=python,
        python_full_version=env["python_full_version"]
        if env.get("python_version") == python
        else f"{python}.0",
        sys_platform="linux",
        platform_system="Linux",
        platform_machine="x86_64",
        os_name="posix",
        implementation_name="cpython",
        platform_python_implementation="CPython",
    )
    return env


def parse_report(report: dict, python: str, llamafactory_report: dict | None = None) -> Resolution:
    """A pip --report JSON (and the --no-deps one for LlamaFactory) -> Resolution."""
    versions: dict[str, str] = {}
    requires: dict[str, list[str]] = {}
    extras: dict[str, list[str]] = {}
    for item in report.get("install", []):
        meta = item["metadata"]
        name = canonicalize_name(meta["name"])
        versions[name] = meta["version"]
        requires[name] = list(meta.get("requires_dist") or [])
        extras[name] = list(item.get("requested_extras") or [])
    lf_requires: list[str] = []
    if llamafactory_report is not None:
        for item in llamafactory_report.get("install", []):
            if canonicalize_name(item["metadata"]["name"]) == "llamafactory":
                lf_requires = list(item["metadata"].get("requires_dist") or [])
    return Resolution(
        python=python,
        versions=versions,
        requires=requires,
        extras=extras,
        environment=target_environment(python, report.get("environment")),
        llamafactory_requires=lf_requires,
    )


def applies(req: Requirement, env: dict[str, str], extras: list[str] | None = None) -> bool:
    """Whether a Requires-Dist line applies to the target (with the given extras)."""
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": extra}) for extra in ([""] + list(extras or [])))


def unmet(lines: list[str], versions: dict[str, str], env: dict[str, str], extras: list[str] | None = None) -> list[tuple[str, str]]:
    """The requirements among `lines` that apply but the resolved `versions` do not meet:
    [(requirement, what was found)]."""
    bad = []
    for line in lines:
        req = Requirement(line)
        if not applies(req, env, extras):
            continue
        found = versions.get(canonicalize_name(req.name))
        if found is None:
            bad.append((line, "not installed"))
        elif not req.specifier.contains(Version(found), prereleases=True):
            bad.append((line, found))
    return bad


def read_lock(text: str, env: dict[str, str]) -> dict[str, str]:
    """name -> pinned version for the lines of a lock file that apply to `env`."""
    pins = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        if not applies(req, env):
            continue
        spec = str(req.specifier)
        if spec.startswith("=="):
            pins[canonicalize_name(req.name)] = spec[2:]
    return pins


def harvest_requirements(pyproject_text: str) -> list[str]:
    """pyproject.toml's [project] dependencies and every optional-dependency group."""
    project = tomllib.loads(pyproject_text)["project"]
    lines = list(project.get("dependencies", []))
    for group in project.get("optional-dependencies", {}).values():
        lines.extend(group)
    return lines


def write_lock(resolutions: list[Resolution]) -> str:
    """A constraints file pinning every resolved package; a version that differs between
    the Python versions gets one marker line per version."""
    names = sorted(set().union(*(r.versions for r in resolutions)) | {"llamafactory"})
    lines = [
        "# Generated by scripts/check_cuda_resolution.py --write-lock (pip's resolver for",
        "# requirements/cuda.txt, Linux x86-64 manylinux, Python "
        + " and ".join(r.python for r in resolutions) + ").",
        "# The constraints file of `scripts/setup_env.sh --cuda`: every version below is what",
        "# the resolver chose. llamafactory itself is installed with --no-deps.",
    ]
    for name in names:
        per_python = {r.python: (r.versions.get(name) if name != "llamafactory" else LLAMAFACTORY.split("==")[1]) for r in resolutions}
        distinct = {v for v in per_python.values() if v is not None}
        if len(distinct) == 1 and all(v is not None for v in per_python.values()):
            lines.append(f"{name}=={distinct.pop()}")
        else:
            for python, version in per_python.items():
                if version is not None:
                    lines.append(f'{name}=={version} ; python_version == "{python}"')
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ checks


def check_resolution(res: Resolution, pyproject_text: str, lock_text: str | None) -> list[Check]:
    """Every check for one Python version; a Check with ok=False is a mismatch."""
    checks: list[Check] = []
    env, versions = res.environment, res.versions

    for name, spec in EXPECTED.items():
        found = versions.get(name)
        ok = found is not None and SpecifierSet(spec).contains(Version(found), prereleases=True)
        checks.append(Check(name, spec or "installed", found or "missing", ok))

    # torch must be the CUDA build: no local tag such as +cpu, and its metadata requires
    # the CUDA 13.0 toolkit wheels.
    torch = versions.get("torch", "")
    cuda_pins = [
        Requirement(line) for line in res.requires.get("torch", [])
        if canonicalize_name(Requirement(line).name) == "cuda-toolkit" and applies(Requirement(line), env)
    ]
    cuda = str(cuda_pins[0].specifier) if cuda_pins else "none"
    torch_cuda_ok = bool(torch) and "+" not in torch and cuda.startswith("==13.0")
    checks.append(Check("torch CUDA build", "cuda-toolkit==13.0.*, no +cpu", f"{torch} needs cuda-toolkit{cuda}", torch_cuda_ok))

    # pip's own promise, re-checked: every requirement of every resolved package is met.
    broken = [
        f"{name}: {line} (found {found})"
        for name in sorted(versions)
        for line, found in unmet(res.requires.get(name, []), versions, env, res.extras.get(name))
    ]
    checks.append(Check(
        "requirements of resolved packages", "all met",
        f"{len(versions)} packages, {len(broken)} unmet", not broken, "; ".join(broken[:5]),
    ))

    # LlamaFactory 0.9.5, installed --no-deps: only the known waivers may fail.
    if res.llamafactory_requires:
        lf_unmet = unmet(res.llamafactory_requires, versions, env)
        known = set(LLAMAFACTORY_WAIVED) | set(LLAMAFACTORY_OMITTED)
        unexpected = [f"{line} (found {found})" for line, found in lf_unmet if canonicalize_name(Requirement(line).name) not in known]
        waived = sorted({canonicalize_name(Requirement(line).name) for line, _ in lf_unmet} & known)
        applicable = sum(1 for line in res.llamafactory_requires if applies(Requirement(line), env))
        checks.append(Check(
            "llamafactory 0.9.5 requirements", "met but " + ", ".join(sorted(known)),
            f"{applicable - len(lf_unmet)}/{applicable} met; not met: {', '.join(waived) or 'none'}",
            not unexpected, "; ".join(unexpected),
        ))
    else:
        checks.append(Check("llamafactory 0.9.5 requirements", "read from its metadata", "no metadata", False))

    # harvest's declared dependencies (core and every extra) hold in this environment
    # (llamafactory: the --no-deps install).
    with_lf = {**versions, "llamafactory": LLAMAFACTORY.split("==")[1]}
    declared = harvest_requirements(pyproject_text)
    h_unmet = [f"{line} (found {found})" for line, found in unmet(declared, with_lf, env)]
    checks.append(Check(
        "harvest pyproject.toml dependencies", "all met",
        f"{len(declared) - len(h_unmet)}/{len(declared)} met", not h_unmet, "; ".join(h_unmet),
    ))

    if lock_text is not None:
        pins = read_lock(lock_text, env)
        missing = sorted(n for n in versions if n not in pins)
        differ = sorted(f"{n} {versions[n]} vs lock {pins[n]}" for n in versions if n in pins and pins[n] != versions[n])
        checks.append(Check(
            "lock-cuda.txt pins every resolved package", "all pinned, same versions",
            f"{len(versions) - len(missing) - len(differ)}/{len(versions)}", not missing and not differ,
            "; ".join(([f"not in lock: {', '.join(missing)}"] if missing else []) + differ[:5]),
        ))
    return checks


def agreement(resolutions: list[Resolution]) -> Check:
    """The key pins are the same for every Python version."""
    differ = [
        name for name in EXPECTED
        if len({r.versions.get(name) for r in resolutions}) > 1
    ]
    return Check(
        "same key versions on " + " and ".join(r.python for r in resolutions),
        "identical", "identical" if not differ else "differ: " + ", ".join(differ), not differ,
    )


# ------------------------------------------------------------------------------ output


def render_table(rows: list[str], per_python: dict[str, list[Check]], extra: list[Check]) -> str:
    pythons = list(per_python)
    header = ["check", "expected", *[f"Python {p}" for p in pythons], "ok"]
    body = []
    for i, name in enumerate(rows):
        cells = [per_python[p][i] for p in pythons]
        body.append([name, cells[0].expected, *[c.found for c in cells], "yes" if all(c.ok for c in cells) else "NO"])
    for check in extra:
        body.append([check.name, check.expected, *([check.found] * len(pythons)), "yes" if check.ok else "NO"])
    widths = [max(len(str(r[i])) for r in [header, *body]) for i in range(len(header))]
    fmt = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    lines = [fmt(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(fmt, body)]
    notes = [f"  {p}: {c.name}: {c.note}" for p in pythons for c in per_python[p] if c.note]
    return "\n".join(lines + (["notes:"] + notes if notes else []))


# ------------------------------------------------------------------------ running pip


def platform_tags(glibc: str) -> list[str]:
    major, minor = (int(x) for x in glibc.split("."))
    if major != 2:
        raise ValueError(f"glibc {glibc}: only 2.x is known")
    tags = [f"manylinux_2_{m}_x86_64" for m in range(minor, 4, -1)]
    return tags + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]


def find_interpreter(python: str) -> str | None:
    """A runnable CPython `python` (PATH first, then pyenv's versions)."""
    candidates = [shutil.which(f"python{python}")]
    pyenv_root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates += sorted(glob.glob(f"{pyenv_root}/versions/{python}.*/bin/python{python}"), reverse=True)
    for candidate in filter(None, candidates):
        try:
            out = subprocess.run([candidate, "-c", "import sys, venv; print('%d.%d' % sys.version_info[:2])"],
                                 capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip() == python:
            return candidate
    return None


def pip_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def make_pip(interpreter: str, workdir: Path) -> list[str]:
    """A throwaway venv of `interpreter` with a current pip; returns its pip command."""
    venv = workdir / f"venv-{Path(interpreter).name}"
    subprocess.run([interpreter, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    subprocess.run([py, "-m", "pip", "--isolated", "install", "--quiet", "--upgrade", "pip"], check=True, env=pip_env())
    return [py, "-m", "pip", "--isolated", "--disable-pip-version-check"]


def dry_run(pip: list[str], python: str, glibc: str, args: list[str], report: Path) -> None:
    cmd = [*pip, "install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
           "--only-binary=:all:", "--python-version", python]
    for tag in platform_tags(glibc):
        cmd += ["--platform", tag]
    cmd += args
    out = subprocess.run(cmd, capture_output=True, text=True, env=pip_env())
    if out.returncode != 0:
        sys.stderr.write(out.stdout[-4000:] + out.stderr[-8000:])
        raise SystemExit(f"check_cuda_resolution: pip's resolver failed for Python {python} (exit {out.returncode}): see above")


def resolve(python: str, glibc: str, use_lock: bool, workdir: Path) -> Resolution:
    interpreter = find_interpreter(python)
    note = interpreter or f"{sys.executable} with --python-version (markers of Python {sys.version_info[0]}.{sys.version_info[1]})"
    pip = make_pip(interpreter or sys.executable, workdir)
    pip_version = subprocess.run([*pip, "--version"], capture_output=True, text=True, env=pip_env()).stdout.split()[1]
    main, lf = workdir / f"report-{python}.json", workdir / f"report-{python}-llamafactory.json"
    dry_run(pip, python, glibc, ["-r", str(REQUIREMENTS), *(["-c", str(LOCK)] if use_lock else [])], main)
    dry_run(pip, python, glibc, ["--no-deps", LLAMAFACTORY], lf)
    res = parse_report(json.loads(main.read_text()), python, json.loads(lf.read_text()))
    res.interpreter = f"{note} (pip {pip_version})"
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", nargs="+", default=list(PYTHONS), help="target Python versions (default: 3.11 3.12)")
    parser.add_argument("--glibc", default=DEFAULT_GLIBC, help=f"newest manylinux glibc accepted (default {DEFAULT_GLIBC})")
    parser.add_argument("--write-lock", action="store_true", help="resolve without the lock and rewrite requirements/lock-cuda.txt")
    parser.add_argument("--keep", type=Path, help="keep the pip reports in this folder")
    args = parser.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="harvest-cuda-resolve-"))
    try:
        resolutions = [resolve(p, args.glibc, not args.write_lock, workdir) for p in args.python]
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            for report in workdir.glob("report-*.json"):
                shutil.copy(report, args.keep / report.name)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    if args.write_lock:
        LOCK.write_text(write_lock(resolutions))
        print(f"check_cuda_resolution: wrote {LOCK.relative_to(ROOT)} ({sum(1 for _ in LOCK.open())} lines)")
    pyproject_text = PYPROJECT.read_text()
    lock_text = LOCK.read_text() if LOCK.is_file() else None
    per_python = {r.python: check_resolution(r, pyproject_text, lock_text) for r in resolutions}
    extra = [agreement(resolutions)] if len(resolutions) > 1 else []
    rows = [c.name for c in next(iter(per_python.values()))]
    print(f"requirements: {REQUIREMENTS.relative_to(ROOT)} + {LLAMAFACTORY} (--no-deps); "
          f"constraints: {LOCK.relative_to(ROOT) if not args.write_lock else 'none (--write-lock)'}; "
          f"platform: manylinux glibc <= {args.glibc}, x86_64")
    for r in resolutions:
        print(f"Python {r.python}: resolved by {r.interpreter}; {len(r.versions)} packages")
    print(render_table(rows, per_python, extra))
    failures = [f"{p}: {c.name}" for p, checks in per_python.items() for c in checks if not c.ok]
    failures += [c.name for c in extra if not c.ok]
    ok = not failures
    print(json.dumps({
        "check": "cuda-resolution",
        "ok": ok,
        "glibc": args.glibc,
        "pythons": {r.python: {"interpreter": r.interpreter, "packages": len(r.versions),
                               "pins": {n: r.versions.get(n) for n in EXPECTED}} for r in resolutions},
        "failures": failures,
    }, sort_keys=True))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
