"""The checking logic of scripts/check_cuda_resolution.py on canned pip reports (offline:
the resolver run itself needs the registry and is recorded in docs/gpu-validation.md)."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("check_cuda_resolution", ROOT / "scripts" / "check_cuda_resolution.py")
ccr = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = ccr  # dataclasses look their module up there
_spec.loader.exec_module(ccr)

ENVIRONMENT = {
    "implementation_name": "cpython", "implementation_version": "3.12.1", "os_name": "posix",
    "platform_machine": "x86_64", "platform_release": "", "platform_system": "Linux", "platform_version": "",
    "python_full_version": "3.12.1", "platform_python_implementation": "CPython", "python_version": "3.12",
    "sys_platform": "linux",
}

# name -> (version, Requires-Dist): a miniature of what pip reports for requirements/cuda.txt.
PACKAGES = {
    "sglang": ("0.5.23", ["torch==2.14.1", "transformers==5.19.0", "tokenizers==0.23.2", "sglang-kernel==0.4.10",
                          "flashinfer_python[cu13]==0.7.2", "torchaudio==2.11.0", "torchvision", "cuda-python>=13.0",
                          'av==16.1.0; sys_platform == "linux" and platform_machine == "aarch64"',
                          'granian>=2.6.0; extra == "http2"']),
    "torch": ("2.14.1", ['cuda-toolkit[cudart]==13.0.3; platform_system == "Linux"', "filelock"]),
    "cuda-toolkit": ("13.0.3.0", ["nvidia-cuda-runtime==13.0.96.*; extra == 'cudart'"]),
    "nvidia-cuda-runtime": ("13.0.96", []),
    "cuda-python": ("13.4.4", []),
    "filelock": ("4.2.12", []),
    "transformers": ("5.19.0", ["tokenizers>=0.22"]),
    "tokenizers": ("0.23.2", []),
    "sglang-kernel": ("0.4.10", ["torch==2.14.1"]),
    "flashinfer-python": ("0.7.2", ["torch"]),
    "torchaudio": ("2.11.0", []),
    "torchvision": ("0.29.1", ["torch (>=2.14.0)"]),
    "peft": ("0.18.1", ["transformers"]),
    "datasets": ("4.0.0", []),
    "accelerate": ("1.11.0", []),
    "trl": ("0.24.0", ["datasets>=3.0.0"]),
    "torchdata": ("0.11.0", []),
    "tyro": ("0.8.14", []),
    "omegaconf": ("2.4.0", []),
    "matplotlib": ("3.11.2", []),
    "scikit-learn": ("1.9.1", []),
    "numpy": ("2.3.5", []),
}
LLAMAFACTORY_REQUIRES = [
    "accelerate<=1.11.0,>=1.3.0", "av<=16.0.0,>=10.0.0", "datasets<=4.0.0,>=2.16.0", "gradio<=5.50.0,>=4.38.0",
    "hf-transfer", "peft<=0.18.1,>=0.18.0", "torchdata<=0.11.0,>=0.10.0",
    "transformers!=4.52.0,!=4.57.0,<=5.6.0,>=4.55.0", "trl<=0.24.0,>=0.18.0", "tyro<0.9.0",
    'deepspeed; extra == "deepspeed"',
]
PYPROJECT = """
[project]
name = "harvest"
dependencies = ["torch>=2.4", "numpy", "scikit-learn", "matplotlib"]
[project.optional-dependencies]
serve = ["sglang==0.5.23"]
train = ["transformers", "peft", "omegaconf"]
llamafactory = ["llamafactory==0.9.5"]
"""


def _report(packages=PACKAGES) -> dict:
    return {
        "environment": ENVIRONMENT,
        "install": [
            {"metadata": {"name": name, "version": version, "requires_dist": requires}}
            for name, (version, requires) in packages.items()
        ],
    }


def _lf_report(requires=LLAMAFACTORY_REQUIRES) -> dict:
    return {"install": [{"metadata": {"name": "llamafactory", "version": "0.9.5", "requires_dist": requires}}]}


def _lock(packages=PACKAGES) -> str:
    return "# lock\n" + "".join(f"{name}=={version}\n" for name, (version, _) in packages.items())


def _checks(packages=PACKAGES, lf=LLAMAFACTORY_REQUIRES, pyproject=PYPROJECT, lock: str | None = "same"):
    res = ccr.parse_report(_report(packages), "3.12", _lf_report(lf))
    return ccr.check_resolution(res, pyproject, _lock(packages) if lock == "same" else lock)


def _failed(checks) -> dict[str, str]:
    return {c.name: c.found for c in checks if not c.ok}


def _with(name: str, version: str | None, requires: list[str] | None = None) -> dict:
    packages = copy.deepcopy(PACKAGES)
    if version is None:
        del packages[name]
    else:
        packages[name] = (version, requires if requires is not None else packages.get(name, ("", []))[1])
    return packages


def test_the_expected_resolution_passes_every_check():
    checks = _checks()
    assert _failed(checks) == {}
    lf = next(c for c in checks if c.name.startswith("llamafactory"))
    assert "not met: av, gradio, hf-transfer, transformers" in lf.found


def test_a_cpu_torch_is_refused():
    failed = _failed(_checks(_with("torch", "2.14.1+cpu", ["filelock"])))
    assert "torch CUDA build" in failed


def test_a_torch_for_another_cuda_is_refused():
    failed = _failed(_checks(_with("torch", "2.14.1", ['cuda-toolkit[cudart]==12.9.1; platform_system == "Linux"'])))
    assert "torch CUDA build" in failed


def test_a_wrong_pin_is_a_mismatch():
    failed = _failed(_checks(_with("transformers", "5.6.0")))
    assert failed["transformers"] == "5.6.0"
    # sglang's own ==5.19.0 is then unmet as well.
    assert "requirements of resolved packages" in failed


def test_a_missing_package_is_a_mismatch():
    failed = _failed(_checks(_with("omegaconf", None)))
    assert failed["omegaconf"] == "missing"
    assert "harvest pyproject.toml dependencies" in failed


def test_llamafactory_may_only_miss_the_known_waivers():
    failed = _failed(_checks(_with("peft", "0.19.0")))
    assert "llamafactory 0.9.5 requirements" in failed
    assert _failed(_checks(lf=[])) == {"llamafactory 0.9.5 requirements": "no metadata"}


def test_markers_and_extras_are_evaluated_for_the_target():
    res = ccr.parse_report(_report(), "3.12", _lf_report())
    lines = ['av==16.1.0; platform_machine == "aarch64"', 'x; python_version < "3.12"', 'y; extra == "dev"', "numpy>=3"]
    assert ccr.unmet(lines, res.versions, res.environment) == [("numpy>=3", "2.3.5")]
    assert ccr.unmet(['y; extra == "dev"'], res.versions, res.environment, ["dev"]) == [('y; extra == "dev"', "not installed")]
    assert ccr.target_environment("3.11", ENVIRONMENT)["python_full_version"] == "3.11.0"


def test_lock_must_pin_every_resolved_package_at_its_version():
    partial = "".join(f"{n}=={v}\n" for n, (v, _) in PACKAGES.items() if n != "tyro")
    assert "lock-cuda.txt pins every resolved package" in _failed(_checks(lock=partial))
    stale = _lock().replace("numpy==2.3.5", "numpy==2.4.6")
    assert "lock-cuda.txt pins every resolved package" in _failed(_checks(lock=stale))
    assert "lock-cuda.txt pins every resolved package" not in [c.name for c in _checks(lock=None)]


def test_written_lock_marks_versions_that_differ_between_pythons_and_reads_back():
    r311 = ccr.parse_report({**_report(), "environment": {**ENVIRONMENT, "python_version": "3.11"}}, "3.11")
    r312 = ccr.parse_report(_report(_with("numpy", "2.4.0")), "3.12")
    text = ccr.write_lock([r311, r312])
    assert 'numpy==2.3.5 ; python_version == "3.11"' in text and "llamafactory==0.9.5" in text
    assert ccr.read_lock(text, r312.environment)["numpy"] == "2.4.0"
    assert ccr.read_lock(text, r311.environment)["numpy"] == "2.3.5"
    assert ccr.agreement([r311, r312]).ok is True  # numpy is not a key pin
    r312_bad = ccr.parse_report(_report(_with("torch", "2.14.0")), "3.12")
    assert ccr.agreement([r311, r312_bad]).found == "differ: torch"


def test_table_and_platform_tags():
    checks = _checks()
    table = ccr.render_table([c.name for c in checks], {"3.11": checks, "3.12": checks}, [])
    assert table.splitlines()[0].startswith("| check ") and "| sglang " in table
    tags = ccr.platform_tags("2.35")
    assert tags[0] == "manylinux_2_35_x86_64" and "manylinux_2_34_x86_64" in tags and "manylinux2014_x86_64" in tags
    with pytest.raises(ValueError):
        ccr.platform_tags("3.1")


def test_the_repository_files_agree_with_the_checks():
    """requirements/cuda.txt, the lock and pyproject.toml as committed: the lock pins what
    cuda.txt pins, and pyproject.toml parses into requirements."""
    lock = ccr.read_lock((ROOT / "requirements" / "lock-cuda.txt").read_text(), ccr.target_environment("3.12", ENVIRONMENT))
    for name, spec in ccr.EXPECTED.items():
        assert name in lock, name
        if spec:
            assert ccr.SpecifierSet(spec).contains(ccr.Version(lock[name])), (name, lock[name])
    assert lock["llamafactory"] == "0.9.5"
    declared = {ccr.canonicalize_name(ccr.Requirement(r).name) for r in ccr.harvest_requirements((ROOT / "pyproject.toml").read_text())}
    assert {"sglang", "llamafactory", "torch"} <= declared
