"""Calibration profiles: the versioned JSON file `harvest profile` writes (profiles/*.json).

A profile holds its provenance, the ladder and batch-size buckets it was measured on,
every raw step latency, and both stages' fitted coefficients and error. Loading validates
every field (:mod:`harvest.predict.strict_json`) and the cross-field invariants, among them
that the coefficients are physically possible, so a profile that loads is one the
predictor can use; every refusal is a :class:`ProfileError` naming the file and the JSON
path. A profile without ``stage2`` is a :class:`Stage1Profile` (``harvest replay``'s
baselines). Older versions load and save back as the version they were read as; whether a
profile matches the running GPU, model and ladder is :mod:`harvest.predict.compat`'s job.

Fields, versions and rules: profiles/README.md, 'Schema (version 3)'.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import tempfile
from pathlib import Path

from harvest.predict import strict_json
from harvest.predict.buckets import BatchSizeBuckets
from harvest.predict.fit import FitQuality, LatencySample
from harvest.ladder import Ladder
from harvest.predict.latency_model import CoRunCoefficients, LatencyPredictor, ProfiledRange, SoloCoefficients

SCHEMA_NAME = "harvest-latency-profile"
SCHEMA_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)  # version 1: no `trainer` section; versions 1 and 2: no `provenance.tp_size`
FIRST_VERSION_WITH_TP_SIZE = 3
STAGES = ("solo", "corun")
# The largest CUDA-graph capture size a profile may name: SGLang captures a few hundred at
# most, and BatchSizeBuckets builds a table this long.
MAX_BATCH_SIZE_BUCKET = 1 << 16


class ProfileError(ValueError):
    """A profile file is unreadable, corrupt, of another schema version, or inconsistent."""


@dataclasses.dataclass(frozen=True)
class ModelIdentity:
    path: str
    name: str
    config_hash: str  # compat.model_config_hash of the latency-relevant config fields
    dtype: str
    random_weights: bool


@dataclasses.dataclass(frozen=True)
class FinetuneIdentity:
    workload: str  # "harvest-trainer" or "peft-lora": what ran beside decode in the co-run stage
    base_model: str
    description: str  # the job in words (rank, targets, micro-batch, sequence length)
    config_hash: str | None  # of the finetune base model's config, as ModelIdentity.config_hash
    # Mean non-padding tokens per micro-batch of that workload: the size of the units the
    # co-run slow-down was measured beside (a server compares its jobs' with it,
    # harvest.predict.compat.corun_units_mismatch). Optional in every version: None (absent)
    # in a profile written before it was recorded.
    micro_batch_tokens: float | None = None

    def __post_init__(self) -> None:
        tokens = self.micro_batch_tokens
        if tokens is not None and not (math.isfinite(tokens) and tokens > 0):
            raise ValueError(f"provenance.finetune.micro_batch_tokens={tokens!r}: must be a finite number > 0")


@dataclasses.dataclass(frozen=True)
class MeasurementSettings:
    timer: str  # "cuda-events" or "perf_counter_ns"
    warmup_steps: int
    timed_steps: int
    trim_fraction: float  # cut from each end of the sorted step latencies before averaging
    switch_interval_s: float  # sys.getswitchinterval() during the run (GIL hand-over period)
    torch_threads: int  # torch.get_num_threads() (intra-op threads; decisive on a CPU)

    def __post_init__(self) -> None:
        # The ranges the profiler's own options allow (harvest.predict.profiler.measure).
        for name, ok, need in (
            ("warmup_steps", self.warmup_steps >= 0, ">= 0"),
            ("timed_steps", self.timed_steps >= 1, ">= 1"),
            ("trim_fraction", 0.0 <= self.trim_fraction < 0.5, "in [0, 0.5)"),
            ("switch_interval_s", self.switch_interval_s > 0, "> 0"),
            ("torch_threads", self.torch_threads >= 1, ">= 1"),
        ):
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be {need}")


@dataclasses.dataclass(frozen=True)
class Provenance:
    device_kind: str  # "cuda" or "cpu"
    device_name: str
    sm_count: int  # streaming multiprocessors; logical cores on a CPU
    compute_capability: str | None
    driver_version: str | None
    torch_version: str
    sglang_version: str | None
    transformers_version: str | None
    peft_version: str | None
    harvest_version: str
    python_version: str
    platform: str
    engine: str  # "sglang" or "transformers"
    model: ModelIdentity
    finetune: FinetuneIdentity
    measurement: MeasurementSettings
    created_utc: str
    command_line: str
    # Tensor-parallel ranks of the measured decode instance (`harvest profile --tp`); the
    # device fields describe rank 0's device, every rank has one like it.
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.sm_count < 1:
            raise ValueError(f"sm_count={self.sm_count}: must be >= 1 (a CPU counts as 1)")
        if self.tp_size < 1:
            raise ValueError(f"tp_size={self.tp_size}: must be >= 1 (tensor-parallel ranks)")


@dataclasses.dataclass(frozen=True)
class Grid:
    batch_sizes: tuple[int, ...]
    context_lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.batch_sizes or not self.context_lengths:
            raise ValueError("batch_sizes and context_lengths must be non-empty")
        for name in ("batch_sizes", "context_lengths"):
            for index, value in enumerate(getattr(self, name)):
                if value <= 0:
                    raise ValueError(f"{name}[{index}]={value}: must be > 0")


@dataclasses.dataclass(frozen=True)
class GridPointRecord:
    """All timed decode steps at one (level, stage, phase, batch size, context length)."""

    level: int
    stage: str  # "solo" or "corun"
    phase: str | None  # trainer phase during a co-run point; None for solo
    batch_size: int
    context_length: int  # tokens per request at the first timed step
    sum_context: float  # mean Σctx over the kept steps (the fit's feature)
    latency_s: float  # trimmed mean of step_latencies_s (the fit's target)
    step_latencies_s: tuple[float, ...]
    step_sum_contexts: tuple[float, ...]
    trainer_units: int | None  # trainer units completed during the timed steps (co-run)
    # Wall seconds over which trainer_units were counted (the timed steps and the host work
    # between them). Optional in every version: None (absent) in profiles written before it
    # was recorded, where the replay falls back to the steps' summed latencies.
    trainer_window_s: float | None = None

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"stage={self.stage!r}: one of {', '.join(STAGES)}")
        if (self.stage == "corun") != (self.phase is not None):
            raise ValueError(f"phase={self.phase!r}: co-run points name a trainer phase, solo points none")
        if not self.step_latencies_s or len(self.step_latencies_s) != len(self.step_sum_contexts):
            raise ValueError("step_latencies_s and step_sum_contexts: equal, non-zero lengths")
        if self.latency_s <= 0:
            raise ValueError(f"latency_s={self.latency_s}: latencies must be > 0")
        for name, unit in (("step_latencies_s", "seconds"), ("step_sum_contexts", "tokens, the one decoded included")):
            for index, value in enumerate(getattr(self, name)):
                if value <= 0:
                    raise ValueError(f"{name}[{index}]={value}: must be > 0 ({unit})")
        if self.sum_context <= 0:
            raise ValueError(f"sum_context={self.sum_context}: must be > 0 (tokens, the one decoded included)")
        for name, low in (("level", 0), ("batch_size", 1), ("context_length", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= {low}")
        if self.trainer_units is not None and self.trainer_units < 0:
            raise ValueError(f"trainer_units={self.trainer_units}: must be >= 0")
        if self.trainer_window_s is not None and not (math.isfinite(self.trainer_window_s) and self.trainer_window_s > 0):
            raise ValueError(f"trainer_window_s={self.trainer_window_s}: must be a finite number of seconds > 0")

    def as_sample(self) -> LatencySample:
        return LatencySample(self.level, self.batch_size, self.sum_context, self.latency_s, self.phase)


@dataclasses.dataclass(frozen=True)
class TrainerAloneRecord:
    """The co-run workload running alone, held in one phase, for ``seconds``."""

    level: int | None  # ladder level whose trainer SMs it ran on; None: the whole device outside any partition
    phase: str
    units: int
    seconds: float

    def __post_init__(self) -> None:
        if self.units < 0 or self.seconds <= 0 or (self.level is not None and self.level < 0):
            raise ValueError(f"units={self.units}, seconds={self.seconds}, level={self.level}: need >= 0, > 0, >= 0")

    @property
    def units_per_s(self) -> float:
        return self.units / self.seconds


@dataclasses.dataclass(frozen=True)
class TrainerSection:
    """What the finetune workload does with no decode running: ``alone`` holds one record
    per (trainer level, phase) plus the whole device's (``whole_device_level``: the level
    that gives the trainer every SM, or None when it was measured outside the ladder)."""

    tokens_per_unit: float  # mean training tokens per unit of the workload
    seconds_per_phase: float  # how long each alone measurement was asked to run
    whole_device_level: int | None
    alone: tuple[TrainerAloneRecord, ...]

    def __post_init__(self) -> None:
        if self.tokens_per_unit <= 0 or self.seconds_per_phase <= 0:
            raise ValueError(f"tokens_per_unit={self.tokens_per_unit}, seconds_per_phase={self.seconds_per_phase}: must be > 0")

    def records(self, level: int | None) -> list[TrainerAloneRecord]:
        return [r for r in self.alone if r.level == level]


@dataclasses.dataclass(frozen=True)
class MemorySection:
    """What moving one KV chunk between decode and the trainer costs on the device: the
    median time of one lend (``lend_ms_per_chunk``) and one reclaim
    (``reclaim_ms_per_chunk``) of a chunk of ``chunk_bytes`` (``pages_per_chunk`` pages;
    None in a section written before `harvest profile` measured it), through the unified
    allocator while decode-like kernels run (harvest.memory.lend_timing; 5-7 ms per 128
    MiB chunk on an H100). The server's auto reserve and `harvest replay` charge
    reclaims this time (harvest.memory.lend_costs)."""

    chunk_bytes: int
    lend_ms_per_chunk: float
    reclaim_ms_per_chunk: float
    pages_per_chunk: int | None = None

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1:
            raise ValueError(f"profile.memory.chunk_bytes={self.chunk_bytes!r}: must be >= 1 (the bytes of the KV chunk timed)")
        for name in ("lend_ms_per_chunk", "reclaim_ms_per_chunk"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"profile.memory.{name}={value!r}: must be a finite number of ms >= 0 (driver time per chunk)")
        pages = self.pages_per_chunk
        if pages is not None and (pages < 1 or self.chunk_bytes % pages):
            raise ValueError(f"profile.memory.pages_per_chunk={pages!r}: must be >= 1 and divide chunk_bytes={self.chunk_bytes}")

    def ms_per_page(self, ms_per_chunk: float) -> float | None:
        """A per-chunk figure per page (None when the pages are not recorded)."""
        return None if self.pages_per_chunk is None else ms_per_chunk / self.pages_per_chunk


@dataclasses.dataclass(frozen=True)
class Stage1Fit:
    b0: float
    c0: float
    k0: float
    quality: FitQuality


@dataclasses.dataclass(frozen=True)
class Stage2Fit:
    b1: float
    k1: float
    identifiable: bool
    quality: FitQuality


@dataclasses.dataclass(frozen=True)
class Stage2:
    combined: Stage2Fit
    by_phase: dict[str, Stage2Fit]
    use_phase_models: bool  # True: the predictor uses by_phase models when told the phase


@dataclasses.dataclass(frozen=True)
class Profile:
    schema: str
    schema_version: int
    provenance: Provenance
    ladder: Ladder
    batch_size_buckets: tuple[int, ...]
    grid: Grid
    profiled_range: ProfiledRange
    samples: tuple[GridPointRecord, ...]
    stage1: tuple[Stage1Fit, ...]
    stage2: Stage2
    trainer: TrainerSection | None = None  # schema version >= 2, when `harvest profile` measured it
    memory: MemorySection | None = None  # optional in every version (module doc); None: not measured

    def __post_init__(self) -> None:
        _check_consistency(self)

    # -- views --------------------------------------------------------------------------
    @property
    def buckets(self) -> BatchSizeBuckets:
        return BatchSizeBuckets(self.batch_size_buckets)

    def solo_samples(self) -> list[LatencySample]:
        return [r.as_sample() for r in self.samples if r.stage == "solo"]

    def corun_samples(self) -> list[LatencySample]:
        return [r.as_sample() for r in self.samples if r.stage == "corun"]

    def predictor(self) -> LatencyPredictor:
        solo = [SoloCoefficients(f.b0, f.c0, f.k0) for f in self.stage1]
        combined = CoRunCoefficients(self.stage2.combined.b1, self.stage2.combined.k1)
        by_phase = None
        if self.stage2.use_phase_models:
            by_phase = {name: CoRunCoefficients(f.b1, f.k1) for name, f in self.stage2.by_phase.items()}
        return LatencyPredictor(self.ladder, self.buckets, solo, combined, self.profiled_range, by_phase)

    # -- I/O ----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        data = {f.name: strict_json.to_jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}
        return _as_written_in_version(data, self.schema_version)

    def to_json(self) -> str:
        return strict_json.dumps(self.to_dict(), indent=1) + "\n"

    def save(self, path: str | Path) -> None:
        """Write atomically: a reader never sees half a profile."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as out:
                out.write(self.to_json())
            os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a profile is meant to be shared
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def from_dict(cls, data) -> "Profile":
        try:
            return strict_json.dataclass_from_dict(cls, _readable(data), "profile")
        except strict_json.StrictJsonError as exc:
            raise ProfileError(str(exc)) from exc

    @classmethod
    def from_json(cls, text: str) -> "Profile":
        return cls.from_dict(_parse(text))

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        data = read_profile_json(path)
        try:
            return cls.from_dict(data)
        except ProfileError as exc:
            raise ProfileError(f"{path}: {exc}") from exc


@dataclasses.dataclass(frozen=True)
class Stage1Profile:
    """A profile whose co-run stage was never measured: ``stage2`` absent or null. Every
    field it has is checked as :class:`Profile` checks it; only stage 2 may be missing."""

    schema: str
    schema_version: int
    provenance: Provenance
    ladder: Ladder
    batch_size_buckets: tuple[int, ...]
    grid: Grid
    profiled_range: ProfiledRange
    samples: tuple[GridPointRecord, ...]
    stage1: tuple[Stage1Fit, ...]
    trainer: TrainerSection | None = None
    memory: MemorySection | None = None

    def __post_init__(self) -> None:
        _check_all_but_stage2(self)

    @property
    def buckets(self) -> BatchSizeBuckets:
        return BatchSizeBuckets(self.batch_size_buckets)

    @classmethod
    def from_dict(cls, data) -> "Stage1Profile":
        data = _readable(data)
        if data.get("stage2") is not None:
            raise ProfileError("profile.stage2: present; load the profile as a Profile")
        data = {k: v for k, v in data.items() if k != "stage2"}
        try:
            return strict_json.dataclass_from_dict(cls, data, "profile")
        except strict_json.StrictJsonError as exc:
            raise ProfileError(str(exc)) from exc


def read_profile_json(path: str | Path):
    """The JSON value in the profile file ``path`` (UTF-8; a byte-order mark, which
    Windows editors add, is allowed), or a ProfileError naming the file and where in it
    the damage is (line and column, or the JSON path of a NaN/Infinity token)."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ProfileError(f"cannot read profile {path}: {exc.strerror or exc}") from exc
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ProfileError(
            f"{path}: line {line} column {column}: byte 0x{raw[exc.start]:02x} is not UTF-8 (a profile is UTF-8 JSON)"
        ) from exc
    try:
        return _parse(text)
    except ProfileError as exc:
        raise ProfileError(f"{path}: {exc}") from exc


def _parse(text: str):
    try:
        return strict_json.loads(text, root="profile")
    except strict_json.StrictJsonError as exc:
        raise ProfileError(str(exc)) from exc
    except ValueError as exc:
        raise ProfileError(f"profile is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise ProfileError("profile is not valid JSON: nested too deeply") from exc


# Fields optional in every version, as paths ("*": every item of a list): absent reads as
# None, and None is written back absent, so a profile that lacks them saves as it was read.
OPTIONAL_FIELDS = (
    ("memory",),  # not measured (module doc)
    ("memory", "pages_per_chunk"),  # a section written before it was recorded (MemorySection)
    ("provenance", "finetune", "micro_batch_tokens"),  # FinetuneIdentity
    ("samples", "*", "trainer_window_s"),  # GridPointRecord
)


def _holders(node, path: tuple[str, ...]):
    """The objects (dicts) that hold the last key of ``path`` in ``node``."""
    if len(path) == 1:
        if isinstance(node, dict):
            yield node
        return
    head, rest = path[0], path[1:]
    if head == "*":
        for item in node if isinstance(node, list) else ():
            yield from _holders(item, rest)
    elif isinstance(node, dict) and head in node:
        yield from _holders(node[head], rest)


def grid_point_from_dict(value, path: str) -> GridPointRecord:
    """One grid point (a profile's sample, or a line of an interrupted run's file written
    by any version), its absent optional fields read as None; StrictJsonError names the
    field at ``path``."""
    if isinstance(value, dict):
        value = dict(value)
        for field_path in OPTIONAL_FIELDS:
            if field_path[:2] == ("samples", "*"):
                for holder in _holders(value, field_path[2:]):
                    holder.setdefault(field_path[-1], None)
    return strict_json.dataclass_from_dict(GridPointRecord, value, path)


def _as_written_in_version(data: dict, version: int) -> dict:
    """``data`` without the fields schema ``version`` does not have: a profile read from
    an older version is written back as read."""
    if version == 1:
        del data["trainer"]
    if version < FIRST_VERSION_WITH_TP_SIZE:
        data["provenance"] = {k: v for k, v in data["provenance"].items() if k != "tp_size"}
    for path in reversed(OPTIONAL_FIELDS):  # deepest first: a None parent holds nothing
        for holder in _holders(data, path):
            if path[-1] in holder and holder[path[-1]] is None:
                del holder[path[-1]]
    return data


def _readable(data) -> dict:
    """``data`` if it is a profile of a schema version this harvest reads (a version-1
    profile given its ``trainer`` None, a version-1 or -2 profile its ``provenance.tp_size``
    1, every absent optional field None), else a ProfileError. ``data`` is not changed."""
    if not isinstance(data, dict):
        raise ProfileError(f"profile: expected a JSON object, got {type(data).__name__}")
    if data.get("schema") != SCHEMA_NAME:
        raise ProfileError(f"profile.schema={data.get('schema')!r}: not a harvest latency profile ({SCHEMA_NAME!r})")
    version = data.get("schema_version")
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        raise ProfileError(
            f"profile.schema_version={version!r}: this harvest reads versions {', '.join(map(str, READABLE_VERSIONS))}; "
            f"re-run `harvest profile` to produce a compatible profile"
        )
    data = copy.deepcopy(data)
    if version == 1:
        if "trainer" in data:
            raise ProfileError("profile.trainer: not a field of schema version 1 (a version-2 profile with the wrong version?)")
        data["trainer"] = None
    provenance = data.get("provenance")
    if version < FIRST_VERSION_WITH_TP_SIZE and isinstance(provenance, dict):  # not an object: strict_json says so
        if "tp_size" in provenance:
            raise ProfileError(
                f"profile.provenance.tp_size: not a field of schema version {version} "
                f"(a version-{FIRST_VERSION_WITH_TP_SIZE} profile with the wrong version?)"
            )
        provenance["tp_size"] = 1  # measured on one rank: --tp came later
    for path in OPTIONAL_FIELDS:  # shallowest first: a filled-in None parent holds nothing
        for holder in _holders(data, path):
            holder.setdefault(path[-1], None)
    return data


def read_memory_section(path: str | Path) -> MemorySection | None:
    """The measured lend/reclaim costs of the profile at ``path``, read and checked
    without the rest of it (the server's auto reserve; every tensor-parallel rank reads
    it). None when the profile has none (an older profile). ProfileError naming the file
    and the field for a damaged one."""
    data = read_profile_json(path)
    try:
        section = _readable(data)["memory"]
        if section is None:
            return None
        return strict_json.dataclass_from_dict(MemorySection, section, "profile.memory")
    except (strict_json.StrictJsonError, ProfileError) as exc:
        raise ProfileError(f"{path}: {exc}") from exc


def _check_consistency(p: Profile) -> None:
    """Invariants across fields (each field's own type is checked on construction)."""
    _check_all_but_stage2(p)
    if not any(r.stage == "corun" for r in p.samples):
        raise ProfileError("profile.samples: no co-run samples (stage 2 cannot have been fitted)")
    _check_stage2(p)


def _check_all_but_stage2(p: Profile | Stage1Profile) -> None:
    if p.schema != SCHEMA_NAME or p.schema_version not in READABLE_VERSIONS:
        raise ProfileError(f"profile: schema {p.schema!r} version {p.schema_version}, expected {SCHEMA_NAME!r} {READABLE_VERSIONS}")
    if p.schema_version < FIRST_VERSION_WITH_TP_SIZE and p.provenance.tp_size != 1:
        # Such a file cannot say its tp_size: saved, it would read back as tp 1.
        raise ProfileError(
            f"profile.provenance.tp_size={p.provenance.tp_size}: schema version {p.schema_version} has no tp_size "
            f"(measured on one rank); a tensor-parallel profile is version {FIRST_VERSION_WITH_TP_SIZE} or later"
        )
    if not isinstance(p.ladder, Ladder):
        raise ProfileError("profile.ladder: expected a Ladder")
    if p.trainer is not None:
        _check_trainer(p)
    for index, size in enumerate(p.batch_size_buckets):
        if size > MAX_BATCH_SIZE_BUCKET:
            raise ProfileError(
                f"profile.batch_size_buckets[{index}]={size}: larger than any CUDA-graph capture size (at most {MAX_BATCH_SIZE_BUCKET})"
            )
    try:
        BatchSizeBuckets(p.batch_size_buckets)
    except ValueError as exc:
        raise ProfileError(f"profile.batch_size_buckets: {exc}") from exc
    _check_stage1(p)
    levels_with_solo = set()
    for index, record in enumerate(p.samples):
        if record.level >= p.ladder.num_levels:
            raise ProfileError(f"profile.samples[{index}].level={record.level}: the ladder has {p.ladder.num_levels} levels")
        if record.stage == "solo":
            levels_with_solo.add(record.level)
        elif not p.ladder.levels[record.level].runs_trainer:
            raise ProfileError(
                f"profile.samples[{index}]: a co-run sample at level {record.level}, where the trainer has no SMs"
            )
    missing = sorted(set(range(p.ladder.num_levels)) - levels_with_solo)
    if missing:
        raise ProfileError(f"profile.samples: no solo samples for level(s) {missing}")


def _check_stage1(p: Profile | Stage1Profile) -> None:
    """``L_solo = b0·bs + c0 + k0·Σctx`` must be a latency: never falling as the batch or
    its context grows (b0, k0 >= 0, as the fit constrains them), and > 0 for the smallest
    step there is (one request, one context token; a negative c0 is a fitted intercept and
    allowed while that holds). Otherwise the scheduler would take a level for free."""
    if len(p.stage1) != p.ladder.num_levels:
        raise ProfileError(f"profile.stage1: {len(p.stage1)} entries for a ladder of {p.ladder.num_levels} levels")
    smallest_batch = p.buckets.padded(1)
    for index, fit in enumerate(p.stage1):
        where = f"profile.stage1[{index}]"
        if fit.b0 < 0:
            raise ProfileError(f"{where}.b0={fit.b0!r}: seconds per request must be >= 0 (a step cannot get faster as its batch grows)")
        if fit.k0 < 0:
            raise ProfileError(f"{where}.k0={fit.k0!r}: seconds per context token must be >= 0 (a step cannot get faster as its context grows)")
        smallest = SoloCoefficients(fit.b0, fit.c0, fit.k0).predict(smallest_batch, 1.0)
        if not smallest > 0:
            raise ProfileError(
                f"{where}.c0={fit.c0!r}: predicts {smallest:.3g} s for the smallest decode step (1 request, 1 context token); "
                "a step takes > 0 s"
            )
        _check_quality(fit.quality, f"{where}.quality")


def _check_stage2(p: Profile) -> None:
    """``L_colo = (SM_infer·b1 + SM_ft·k1)·L_solo``: b1 and k1 are the slowdown each SM
    share brings, so neither may be negative (more trainer SMs cannot speed decode up: a
    negative k1 predicts latency falling as the trainer grows, and below zero beyond), and
    the factor must be > 0 on every level or co-located latency is zero or negative."""
    fits = [("combined", p.stage2.combined)] + [(f"by_phase.{name}", fit) for name, fit in sorted(p.stage2.by_phase.items())]
    for name, fit in fits:
        where = f"profile.stage2.{name}"
        for coefficient, meaning in (("b1", "decode's"), ("k1", "the trainer's")):
            value = getattr(fit, coefficient)
            if value < 0:
                raise ProfileError(
                    f"{where}.{coefficient}={value!r}: must be >= 0 (the slowdown per unit of {meaning} SM share; "
                    "co-location cannot speed decode up)"
                )
        for level in range(p.ladder.num_levels):
            factor = CoRunCoefficients(fit.b1, fit.k1).factor(p.ladder.decode_fraction(level), p.ladder.trainer_fraction(level))
            if not factor > 0:
                raise ProfileError(
                    f"{where}: b1={fit.b1!r}, k1={fit.k1!r} give level {level} a co-located latency factor of {factor!r}; must be > 0"
                )
        _check_quality(fit.quality, f"{where}.quality")
    if p.stage2.use_phase_models and len(p.stage2.by_phase) < 2:
        raise ProfileError("profile.stage2.use_phase_models is true but by_phase has fewer than 2 phases")


def _check_trainer(p: Profile | Stage1Profile) -> None:
    """Every level that gives the trainer SMs, and the whole device, measured in the same phases."""
    section, levels = p.trainer, p.ladder.levels
    if p.schema_version < 2:
        raise ProfileError(f"profile.trainer: needs schema version 2, the file says {p.schema_version}")
    where = section.whole_device_level
    if where is not None and not (0 <= where < len(levels) and levels[where].trainer_sms == p.ladder.total_sms):
        raise ProfileError(f"profile.trainer.whole_device_level={where}: not a level giving the trainer all {p.ladder.total_sms} SMs")
    expected = {i for i, level in enumerate(levels) if level.trainer_sms > 0} | {where}
    phases_by_level: dict = {}
    for index, record in enumerate(section.alone):
        if record.level not in expected:
            raise ProfileError(f"profile.trainer.alone[{index}].level={record.level}: expected one of {sorted(expected, key=str)}")
        phases = phases_by_level.setdefault(record.level, [])
        if record.phase in phases:
            raise ProfileError(f"profile.trainer.alone[{index}]: level {record.level} phase {record.phase!r} measured twice")
        phases.append(record.phase)
    if set(phases_by_level) != expected or len({frozenset(v) for v in phases_by_level.values()}) != 1:
        raise ProfileError(
            f"profile.trainer.alone: expected the same phases on every level in {sorted(expected, key=str)}, got {phases_by_level}"
        )
    for index, record in enumerate(section.alone):
        if record.level == where and record.units == 0:
            # The rate alone is that of a trainer alternating the phases: one that never
            # finishes leaves it zero, and every rate relative to it undefined.
            raise ProfileError(
                f"profile.trainer.alone[{index}].units=0: no {record.phase!r} unit finished on the whole device, "
                "so the trainer's rate alone is unknown"
            )


def _check_quality(quality: FitQuality, path: str) -> None:
    values = [quality.mape, quality.max_error] + ([quality.cv_mape] if quality.cv_mape is not None else [])
    if quality.num_samples <= 0 or any(not math.isfinite(v) or v < 0 for v in values):
        raise ProfileError(f"{path}: num_samples > 0 and finite, non-negative errors required, got {quality}")
