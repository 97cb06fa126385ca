"""Locate and load harvest's native libraries (plain C ABI shared objects, via ctypes).

Search order for ``libharvest_<name>.so``:
  1. ``HARVEST_NATIVE_DIR`` (see :mod:`harvest.config_env`),
  2. ``_native/`` inside each directory of the ``harvest`` package (a wheel or editable
     install puts them in site-packages; a plain ``cmake --install build --prefix .``
     puts them in the source tree),
  3. the scikit-build-core build tree ``build/*/`` of a source checkout.

ctypes releases the GIL around every foreign call, so a blocking driver call in the
libraries never stalls other Python threads (the contract csrc/ relies on).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import harvest
from harvest import config_env

LIBRARY_NAMES = ("vmm", "greenctx")


class NativeLibraryNotFound(RuntimeError):
    """The shared library is not built or not where harvest looks for it."""


def _candidate_dirs() -> list[Path]:
    dirs: list[Path] = []
    explicit = config_env.native_lib_dir()
    if explicit is not None:
        dirs.append(explicit)
    for pkg_dir in harvest.__path__:
        dirs.append(Path(pkg_dir) / "_native")
    # Editable installs with scikit-build-core's redirect mode keep the package path at
    # the sources; the built libraries then live in the site-packages copy of _native.
    import sysconfig

    dirs.append(Path(sysconfig.get_paths()["platlib"]) / "harvest" / "_native")
    build_root = config_env.PROJECT_ROOT / "build"
    if build_root.is_dir():
        dirs.extend(sorted(p.parent for p in build_root.glob("*/csrc/*/libharvest_*.so")))
    return dirs


def library_path(name: str) -> Path:
    filename = f"libharvest_{name}.so"
    searched = _candidate_dirs()
    for directory in searched:
        candidate = directory / filename
        if candidate.is_file():
            return candidate
    raise NativeLibraryNotFound(
        f"{filename} not found (searched: {', '.join(str(d) for d in searched) or 'nothing'}). "
        "Build it with `make native` (or `pip install -e .`), or set HARVEST_NATIVE_DIR."
    )


@functools.lru_cache(maxsize=None)
def load(name: str) -> ctypes.CDLL:
    """Load ``libharvest_<name>.so`` once per process."""
    if name not in LIBRARY_NAMES:
        raise ValueError(f"unknown native library {name!r} (known: {', '.join(LIBRARY_NAMES)})")
    return ctypes.CDLL(str(library_path(name)))


def bind(lib: ctypes.CDLL, func: str, restype, *argtypes):
    """Declare a C function's signature once; returns the callable."""
    fn = getattr(lib, func)
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn
