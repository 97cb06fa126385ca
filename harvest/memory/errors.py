"""Exceptions raised by harvest.memory, one per failure kind of libharvest_vmm.

Misconfiguration and bad input raise; a pool that is exhausted *right now* is not an
exception but a value (``None``) the caller backs off on (docs/design.md, "Code-level
decisions": two kinds of failure). Every message comes from the C++ side and names the call or the argument.
"""

from __future__ import annotations


class VmmError(RuntimeError):
    """A libharvest_vmm call failed; ``status`` is its hvmm_status code."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class VmmInvalidArgument(VmmError, ValueError):
    """Bad argument or state (double free, unknown pointer, live slots, ...); nothing changed."""


class VmmNoDriver(VmmError):
    """The cuda backend was asked for but no usable CUDA driver is present."""


class VmmDriverError(VmmError):
    """A CUDA driver call failed (the message names the call and the CUresult)."""


class VmmOsError(VmmError):
    """A syscall of the host backend failed (the message names it and errno)."""


class VmmExhausted(VmmError):
    """No free memory right now (only raised where returning None is not possible)."""


class VmmIntegrityError(VmmError):
    """An allocator invariant is broken (check_integrity) or bookkeeping memory ran out."""


STATUS_TO_ERROR: dict[int, type[VmmError]] = {
    1: VmmInvalidArgument,
    2: VmmNoDriver,
    3: VmmDriverError,
    4: VmmOsError,
    5: VmmExhausted,
    6: VmmIntegrityError,
}
