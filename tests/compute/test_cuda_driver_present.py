"""compute.device.cuda_driver_present: whether a CUDA context could exist in this process at
all. SGLang's launcher runs the pre-flight job check itself where it says no, in a child
where it says yes (harvest/sglang/plugin.py)."""

from __future__ import annotations

import pytest

from harvest.compute import device
from tests import fake_cuda


def test_it_agrees_with_the_native_probe():
    gpus, reason, driver_version = device.probe_gpus()
    if reason is not None and reason.startswith("native libraries unavailable"):
        pytest.skip(reason)
    # The probe reports a driver version wherever it could open the driver (GPUs or not).
    assert device.cuda_driver_present() == (driver_version is not None), (reason, driver_version)


@fake_cuda.needs_fake_driver
def test_a_loadable_driver_is_present_and_asking_initializes_nothing(tmp_path):
    driver_dir = fake_cuda.build_fake_driver(tmp_path)
    out, lines = fake_cuda.run_with_fake_driver(driver_dir, tmp_path, """
        from harvest.compute import device
        print(json.dumps({"present": device.cuda_driver_present()}))
    """)
    assert out == {"present": True}
    assert lines == []  # the fake reports at exit only after cuInit: never called
