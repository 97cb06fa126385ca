"""Randomized operation sequences against a UnifiedAllocator, checked after every step.

Used by tests/memory/test_fuzz.py and scripts/bench_vmm.py. An independent shadow model in
plain Python predicts every operation's outcome and the statistics after it; the library's
check_integrity verifies its internal invariants. With `write_data` (host backend) every
allocation and live KV slot carries a tag byte that must survive until freed, so an overlap
or a wrong mapping shows as a changed byte. Fences are part of the run: non-blocking lends,
their completion and cancellation, fenced small-pool frees; on the host backend the run
holds a registered fence stream's fences now and then, as a busy GPU stream does. A
violation is recorded, not raised, so a run reports how many steps went wrong.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import random
import time
from typing import Callable

from harvest.memory.allocator import ARENA, SMALL, UnifiedAllocator
from harvest.memory.errors import VmmError, VmmInvalidArgument

BLOCK_BYTES = 2048  # the small pool's granularity

OPS = (
    ("mark_live", 10),
    ("mark_free", 12),
    ("lend", 10),
    ("reclaim", 9),
    ("arena_alloc", 14),
    ("arena_free", 12),
    ("small_alloc", 14),
    ("small_free", 12),
    ("lend_nowait", 6),
    ("finish_lends", 5),
    ("cancel_lends", 3),
    ("hold_fences", 3),
    ("bad_input", 3),
)
FUZZ_STREAM = 1  # the host backend's fences ignore the value


@dataclasses.dataclass
class FuzzReport:
    ops: int
    violations: int
    first_violation: str | None
    op_counts: dict[str, int]
    outcomes: dict[str, int]  # successes and refusals, to show the run exercised both
    peak_fragmentation_bytes: int
    leak_free_at_end: bool


class _Shadow:
    def __init__(self, alloc: UnifiedAllocator):
        g = alloc.geometry
        self.g = g
        self.lent: set[int] = set()
        self.lending: set[int] = set()  # lends waiting for their fences
        self.fences_passed: set[int] = set()  # ... of which the fences were let pass since (host)
        self.live: dict[int, set[int]] = {c: set() for c in range(g.num_chunks)}
        self.arena: dict[int, tuple[int, int]] = {}  # address -> (first page slot, pages)
        self.small: dict[int, int] = {}  # address -> rounded bytes
        self.small_tag_sites: dict[int, list[int]] = {}  # address -> tagged bytes inside
        self.tags: dict[int, int] = {}  # address -> tag byte expected there

    def arena_used(self, chunk: int) -> int:
        p = self.g.pages_per_chunk
        return sum(
            max(0, min(first + n, (chunk + 1) * p) - max(first, chunk * p)) for first, n in self.arena.values()
        )

    def longest_free_run(self) -> int:
        p = self.g.pages_per_chunk
        taken = set()
        for first, n in self.arena.values():
            taken.update(range(first, first + n))
        best = run = 0
        for s in range(self.g.num_chunks * p):
            run = run + 1 if (s // p in self.lent and s not in taken) else 0
            best = max(best, run)
        return best


class _Fuzzer:
    def __init__(self, alloc: UnifiedAllocator, rng: random.Random, write_data: bool):
        self.alloc = alloc
        self.rng = rng
        self.write_data = write_data
        self.shadow = _Shadow(alloc)
        self.violations = 0
        self.first_violation: str | None = None
        self.step = 0
        self.outcomes: dict[str, int] = {}
        # Host: fences can be held, so the model knows when a lend completes. A GPU's
        # fences pass when the device gets there: the model accepts either outcome.
        self.host = alloc.geometry.backend == "host"
        self.held = False
        if self.host:
            alloc.set_fence_streams([FUZZ_STREAM])

    def count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    # -- helpers ------------------------------------------------------------------
    def violation(self, message: str) -> None:
        self.violations += 1
        if self.first_violation is None:
            self.first_violation = f"step {self.step}: {message}"

    def tag(self, address: int) -> None:
        if self.write_data:
            value = self.rng.randrange(1, 256)
            ctypes.c_ubyte.from_address(address).value = value
            self.shadow.tags[address] = value

    def verify_tag(self, address: int, what: str) -> None:
        if self.write_data:
            expected = self.shadow.tags.pop(address)
            found = ctypes.c_ubyte.from_address(address).value
            if found != expected:
                self.violation(f"{what} at {address:#x}: tag {expected} became {found}")

    def kv_tag_addresses(self, slot: int) -> list[int]:
        g = self.shadow.g
        offset = slot * g.bytes_per_token
        return [g.kv_range_address(0, "k") + offset, g.kv_range_address(g.num_layers - 1, "v") + offset]

    def expect_refusal(self, what: str, call: Callable[[], object]) -> None:
        self.count("refusals_checked")
        before = (self.alloc.stats(), self.alloc.counters(), self.alloc.chunk_table())
        try:
            call()
        except VmmInvalidArgument:
            after = (self.alloc.stats(), self.alloc.counters(), self.alloc.chunk_table())
            if after != before:
                self.violation(f"{what}: refused but the allocator state changed")
            return
        except VmmError as exc:
            self.violation(f"{what}: wrong error type {type(exc).__name__}: {exc}")
            return
        self.violation(f"{what}: accepted, expected a VmmInvalidArgument")

    # -- operations ---------------------------------------------------------------
    def release_fences(self) -> None:
        """Before a call that waits on fences: let them pass (nothing else would)."""
        if self.held:
            self.hold_fences()

    def mark_live(self) -> None:
        g, s = self.shadow.g, self.shadow
        mapped = [c for c in range(g.num_chunks) if c not in s.lent and c not in s.lending]
        if not mapped:
            return
        chunk = self.rng.choice(mapped)
        free = [t for t in self.rng.sample(g.chunk_slots(chunk), min(8, g.tokens_per_chunk)) if t not in s.live[chunk]]
        if not free:
            return
        self.alloc.mark_slots_live(free)
        s.live[chunk].update(free)
        for slot in free:
            for address in self.kv_tag_addresses(slot):
                self.tag(address)

    def mark_free(self) -> None:
        s = self.shadow
        busy = [c for c, slots in s.live.items() if slots]
        if not busy:
            return
        chunk = self.rng.choice(busy)
        live = sorted(s.live[chunk])
        chosen = live if self.rng.random() < 0.5 else self.rng.sample(live, self.rng.randint(1, len(live)))
        for slot in chosen:
            for address in self.kv_tag_addresses(slot):
                self.verify_tag(address, f"KV of live slot {slot}")
        self.alloc.mark_slots_free(chosen)
        s.live[chunk].difference_update(chosen)

    def pick_chunks(self) -> list[int]:
        g = self.shadow.g
        first = self.rng.randrange(g.num_chunks)
        count = self.rng.choice((1, 1, 1, 2, 3))
        return list(range(first, min(g.num_chunks, first + count)))

    def lend(self, wait: bool = True) -> None:
        s = self.shadow
        chunks = self.pick_chunks()
        ok = all(c not in s.lent and c not in s.lending and not s.live[c] for c in chunks)
        if len(chunks) == 1 and self.alloc.can_lend(chunks[0]) != ok:
            self.violation(f"can_lend({chunks[0]}) disagrees with the model ({ok})")
        self.count("lend_ok" if ok else "lend_refused")
        if not ok:
            self.expect_refusal(f"lend {chunks}", lambda: self.alloc.lend(chunks, wait=wait))
            return
        if wait:
            self.release_fences()
        lent_now = self.alloc.lend(chunks, wait=wait)
        if self.host and lent_now == self.held:
            fences = "held" if self.held else "passing"
            self.violation(f"lend({chunks}, wait={wait}) returned {lent_now} with fences {fences}")
        if lent_now:
            s.lent.update(chunks)
        else:
            self.count("lend_pending")
            s.lending.update(chunks)

    def lend_nowait(self) -> None:
        self.lend(wait=False)

    def finish_lends(self) -> None:
        s = self.shadow
        done = self.alloc.finish_lends()
        if (self.host and done != sorted(s.fences_passed)) or not set(done) <= s.lending:
            self.violation(f"finish_lends() = {done}, model: pending {sorted(s.lending)}, held {self.held}")
        if done:
            self.count("lend_finished")
        s.lending.difference_update(done)
        s.fences_passed.difference_update(done)
        s.lent.update(done)

    def cancel_lends(self) -> None:
        g, s = self.shadow.g, self.shadow
        if not s.lending:
            chunk = self.rng.randrange(g.num_chunks)
            self.expect_refusal(f"cancel_lends([{chunk}]) of a chunk not being lent",
                                lambda: self.alloc.cancel_lends([chunk]))
            return
        pending = sorted(s.lending)
        chosen = self.rng.sample(pending, self.rng.randint(1, len(pending)))
        self.alloc.cancel_lends(chosen)
        self.count("lend_cancelled")
        s.lending.difference_update(chosen)
        s.fences_passed.difference_update(chosen)

    def hold_fences(self) -> None:
        """Host: fences recorded from now on stay pending (hold), or every pending one
        passes (release)."""
        if self.host:
            self.held = not self.held
            self.alloc.hold_fences(self.held)
            if not self.held:
                self.shadow.fences_passed.update(self.shadow.lending)

    def reclaim(self) -> None:
        s = self.shadow
        chunks = self.pick_chunks()
        ok = all(c in s.lent and s.arena_used(c) == 0 for c in chunks)  # a chunk being lent is not lent
        if len(chunks) == 1 and self.alloc.can_reclaim(chunks[0]) != ok:
            self.violation(f"can_reclaim({chunks[0]}) disagrees with the model ({ok})")
        self.count("reclaim_ok" if ok else "reclaim_refused")
        if not ok:
            self.expect_refusal(f"reclaim {chunks}", lambda: self.alloc.reclaim(chunks))
            return
        self.release_fences()
        self.alloc.reclaim(chunks)
        s.lent.difference_update(chunks)

    def arena_alloc(self) -> None:
        g, s = self.shadow.g, self.shadow
        pages = self.rng.randint(1, 2 * g.pages_per_chunk)
        num_bytes = pages * g.page_bytes - self.rng.randrange(g.page_bytes)
        possible = s.longest_free_run() >= pages
        block = self.alloc.arena_allocate(num_bytes)
        self.count("arena_alloc_exhausted" if block is None else "arena_alloc_ok")
        if block is None:
            if possible:
                self.violation(f"arena_allocate({pages} pages) returned None but a free run exists")
            return
        if not possible:
            self.violation(f"arena_allocate({pages} pages) succeeded but no free run exists in the model")
        first = (block.address - g.arena_base) // g.page_bytes
        taken = {p for f, n in s.arena.values() for p in range(f, f + n)}
        span = range(first, first + pages)
        if (block.address - g.arena_base) % g.page_bytes or any(
            p in taken or p // g.pages_per_chunk not in s.lent for p in span
        ):
            self.violation(f"arena block at {block.address:#x} overlaps another or an unlent chunk")
        s.arena[block.address] = (first, pages)
        self.tag(block.address)
        self.tag(block.address + pages * g.page_bytes - 1)  # pages >= 1: a distinct byte

    def arena_free(self) -> None:
        g, s = self.shadow.g, self.shadow
        if not s.arena:
            return
        address = self.rng.choice(list(s.arena))
        _, pages = s.arena.pop(address)
        self.verify_tag(address, "arena block start")
        self.verify_tag(address + pages * g.page_bytes - 1, "arena block end")
        self.alloc.free_address(address, ARENA)  # cuda: fenced on the current stream

    def small_alloc(self) -> None:
        g, s = self.shadow.g, self.shadow
        if not g.small_pages:
            return
        num_bytes = min(g.page_bytes - 1, int(math.exp(self.rng.uniform(0, math.log(g.page_bytes - 1)))))
        blocks = -(-num_bytes // BLOCK_BYTES)
        rounded = BLOCK_BYTES << (blocks - 1).bit_length()  # the buddy block it must get
        largest = self.alloc.stats().small_largest_free_bytes
        block = self.alloc.small_allocate(num_bytes)
        self.count("small_alloc_exhausted" if block is None else "small_alloc_ok")
        if block is None:
            if largest >= rounded:
                self.violation(f"small_allocate({num_bytes}) returned None with a {largest}-byte block free")
            return
        offset = block.address - g.small_base
        overlap = any(a < block.address + rounded and block.address < a + r for a, r in s.small.items())
        if offset < 0 or offset + rounded > g.small_bytes or offset % rounded or overlap:
            self.violation(f"small block at {block.address:#x} ({rounded} B) is misplaced or overlaps")
        s.small[block.address] = rounded
        sites = sorted({block.address, block.address + num_bytes - 1})
        s.small_tag_sites[block.address] = sites
        for site in sites:
            self.tag(site)

    def small_free(self) -> None:
        s = self.shadow
        if not s.small:
            return
        address = self.rng.choice(list(s.small))
        del s.small[address]
        for tagged in s.small_tag_sites.pop(address):
            self.verify_tag(tagged, "small block")
        # Host: fenced on a stream half the time (reused once its fence passes); a GPU
        # fences on the current stream (the default).
        fenced = self.host and self.rng.random() < 0.5
        self.alloc.free_address(address, SMALL, [FUZZ_STREAM] if fenced else None)

    def bad_input(self) -> None:
        g, s = self.shadow.g, self.shadow
        choice = self.rng.randrange(7)
        if choice == 0 and s.arena:
            address = self.rng.choice(list(s.arena)) + g.page_bytes // 2
            self.expect_refusal("arena free inside a block", lambda: self.alloc.free_address(address, ARENA, []))
        elif choice == 1:
            address = g.arena_base + self.rng.randrange(g.num_chunks * g.pages_per_chunk) * g.page_bytes
            if address not in s.arena:
                self.expect_refusal("arena free of a free page", lambda: self.alloc.free_address(address, ARENA, []))
        elif choice == 2 and g.small_pages:
            address = g.small_base + self.rng.randrange(g.small_bytes // BLOCK_BYTES) * BLOCK_BYTES
            if address not in s.small:
                self.expect_refusal("small free of a free block", lambda: self.alloc.free_address(address, SMALL))
        elif choice == 3:
            num_bytes = self.rng.choice((0, -1, -(2**40)))
            self.expect_refusal(f"arena_allocate({num_bytes})", lambda: self.alloc.arena_allocate(num_bytes))
        elif choice == 4:
            chunk = self.rng.randrange(g.num_chunks)
            slot = self.rng.choice(g.chunk_slots(chunk))
            if slot not in s.live[chunk]:
                self.expect_refusal(f"mark_slots_free([{slot}])", lambda: self.alloc.mark_slots_free([slot]))
        elif choice == 5 and s.lent:
            slot = self.rng.choice(g.chunk_slots(self.rng.choice(sorted(s.lent))))
            self.expect_refusal(f"mark_slots_live([{slot}]) in a lent chunk",
                                lambda: self.alloc.mark_slots_live([slot]))
        else:
            chunk = self.rng.randrange(g.num_chunks)
            if chunk in s.lent and s.arena_used(chunk):
                self.expect_refusal(f"reclaim busy chunk {chunk}", lambda: self.alloc.reclaim([chunk]))

    # -- checks -------------------------------------------------------------------
    def compare_stats(self) -> int:
        s = self.shadow
        st = self.alloc.stats()
        used = sum(n for _, n in s.arena.values())
        expected = {
            "chunks_lent": len(s.lent),
            "chunks_lending": len(s.lending),
            "chunks_mapped": s.g.num_chunks - len(s.lent) - len(s.lending),
            "live_slots": sum(len(v) for v in s.live.values()),
            "arena_allocations": len(s.arena),
            "pages_lent_used": used,
            "small_allocations": len(s.small),
            "small_used_bytes": sum(s.small.values()),
            "chunks_busy": 0,
            "chunks_broken": 0,
        }
        for name, want in expected.items():
            if getattr(st, name) != want:
                self.violation(f"stats.{name} = {getattr(st, name)}, model says {want}")
        return st.fragmentation_bytes


def run_fuzz(
    alloc: UnifiedAllocator,
    *,
    ops: int,
    seed: int = 0,
    write_data: bool | None = None,
    progress: Callable[[int], None] | None = None,
) -> FuzzReport:
    """Run `ops` random operations on a fresh allocator, checking after each one."""
    if write_data is None:
        write_data = alloc.geometry.backend == "host"
    fuzzer = _Fuzzer(alloc, random.Random(seed), write_data)
    names = [name for name, _ in OPS]
    weights = [weight for _, weight in OPS]
    counts = dict.fromkeys(names, 0)
    peak_fragmentation = 0
    for step in range(ops):
        fuzzer.step = step
        name = fuzzer.rng.choices(names, weights)[0]
        counts[name] += 1
        try:
            getattr(fuzzer, name)()
        except VmmError as exc:
            fuzzer.violation(f"{name} raised {type(exc).__name__}: {exc}")
        try:
            alloc.check_integrity()
        except VmmError as exc:
            fuzzer.violation(f"after {name}: {exc}")
        peak_fragmentation = max(peak_fragmentation, fuzzer.compare_stats())
        if progress is not None and step % 1000 == 999:
            progress(1000)
    try:
        leak_free = _drain(fuzzer)
    except VmmError as exc:
        fuzzer.violation(f"draining at the end: {type(exc).__name__}: {exc}")
        leak_free = False
    return FuzzReport(
        ops, fuzzer.violations, fuzzer.first_violation, counts, fuzzer.outcomes, peak_fragmentation, leak_free
    )


def _collect_small_frees(alloc: UnifiedAllocator, timeout_s: float = 5.0) -> None:
    """Every fenced small-pool free made allocatable; on a GPU their events pass once the
    device has processed them, so this polls (briefly) instead of assuming."""
    deadline = time.monotonic() + timeout_s
    while True:
        alloc.collect_small_frees()
        if not alloc.stats().small_pending_frees or time.monotonic() > deadline:
            return
        time.sleep(0.001)


def _drain(fuzzer: _Fuzzer) -> bool:
    """Free everything, reclaim every chunk; True when nothing is left over."""
    s = fuzzer.shadow
    fuzzer.release_fences()
    while s.arena:
        fuzzer.arena_free()
    while s.small:
        fuzzer.small_free()
    if s.lending:
        fuzzer.alloc.cancel_lends(sorted(s.lending))
        s.lending.clear()
        s.fences_passed.clear()
    _collect_small_frees(fuzzer.alloc)
    for chunk, slots in s.live.items():
        if slots:
            fuzzer.alloc.mark_slots_free(sorted(slots))
            slots.clear()
    if s.lent:
        fuzzer.alloc.reclaim(sorted(s.lent))
        s.lent.clear()
    fuzzer.alloc.check_integrity()
    st = fuzzer.alloc.stats()
    counters = fuzzer.alloc.counters()
    clean = (
        st.chunks_mapped == st.num_chunks
        and st.live_slots == st.arena_allocations == st.small_allocations == st.small_used_bytes == 0
        and st.chunks_lending == st.small_pending_frees == 0
        and st.small_largest_free_bytes == (fuzzer.shadow.g.page_bytes if fuzzer.shadow.g.small_pages else 0)
        and counters.create_calls_after_init == 0
        and counters.release == 0
    )
    if not clean:
        fuzzer.violation(f"leak at the end: {st}, {counters}")
    return clean
