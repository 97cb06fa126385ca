"""The composition root: a :class:`~harvest.colocate.colocation.Colocation` from a
``harvest.yaml`` and the serving engine's adapter.

Every entry point that co-locates (the SGLang runtime, scripts/colocate_gpu.py) builds the
system here, so that what is measured is what users run: the partitioner, the profile's
predictor with its online refinement (refit between trainer units and when idle, never on
a thread of its own), the QoS controller, the trainer host, KV lending, metrics, the step
timer. Nothing here knows the engine: :class:`EngineAdapter` says what it lends.

Anything wrong raises here, at start-up (a serving engine then refuses to start).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Callable

from harvest.logs import get_logger

logger = get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class KvPool:
    """The engine's KV cache, on harvest's unified allocator.

    ``lending_controller(policy, budget, memory, metrics)`` builds the engine's lending
    mechanism: it moves whole free chunks out of and back into the engine's free lists,
    as the ``memory`` settings say, and publishes what is lent and what it wants back on
    ``budget`` (harvest.memory.lent_budget), which the trainer's window follows. The
    allocator's fence streams are set here (:func:`kv_fence_streams`)."""

    allocator: Any  # harvest.memory.UnifiedAllocator backing the engine's K/V buffers
    num_tokens: int  # token slots in the engine's pool
    max_batch_size: int  # the engine's cap on running requests
    lending_controller: Callable[..., Any]
    # The engine's own streams whose queued kernels may touch KV memory (SGLang: its
    # forward and schedule streams), fenced besides the ladder's decode streams.
    engine_streams: tuple = ()


@dataclasses.dataclass(frozen=True)
class EngineAdapter:
    """What the serving engine gives harvest.

    ``build_trainer(job)`` runs on the trainer thread for each of ``jobs`` (default: the
    config's job files, taken through LlamaFactory into lent KV memory by
    :func:`job_file_builder`, on the weights ``weight_source_for(job)`` gives where it
    gives any). ``kv`` is None when harvest does not manage the engine's KV cache (nothing
    is lent)."""

    device: str  # "cpu", "cuda:N"
    model_path: str  # the served checkpoint (the profile must describe this model)
    model_dtype: str  # "float32", "bfloat16", ...
    kv: KvPool | None = None
    build_trainer: Callable[[Any], Any] | None = None
    weight_source_for: Callable[[Any], Any] | None = None
    jobs: tuple | None = None  # None: config.jobs
    # True: the engine hands each step's forward to Colocation.run_forward itself (its
    # scheduler moves the forward onto a stream of its own inside the step, as SGLang's
    # does); False: the whole step run_step is given is the forward.
    places_forward: bool = False
    # Tensor parallelism: this rank's end of the decode ranks' step agreement
    # (harvest.colocate.rank_sync.RankSync) and its place in the trainer's ranks
    # (harvest.train.tensor_parallel.TensorParallel). None: one rank.
    ranks: Any = None
    trainer_tp: Any = None
    # The served model's name (SGLang's --served-model-name): the model_name label of
    # every harvest series. None: the checkpoint's folder name.
    model_name: str | None = None
    # Serving finished jobs' adapters (harvest.colocate.job_control.AdapterServing); None:
    # the engine cannot load adapters.
    adapters: Any = None

    @property
    def tp_size(self) -> int:
        return 1 if self.ranks is None else self.ranks.size

    @property
    def tp_rank(self) -> int:
        return 0 if self.ranks is None else self.ranks.rank

    @property
    def device_type(self) -> str:
        return "cuda" if self.device.startswith("cuda") else "cpu"


def assemble(config, engine: EngineAdapter, *, partitioner=None):
    """The co-location system for ``engine`` under ``config`` (not started: call
    ``start()`` once the engine thread is ready). ``partitioner``: an already built SM
    ladder to use (a harness that runs several modes over one ladder); its caller closes
    it."""
    jobs = tuple(config.jobs) if engine.jobs is None else tuple(engine.jobs)
    if engine.jobs is None:
        # The launcher's pre-flight job check, again here: the files are read now, and a
        # server may be started without that launcher. The jobs are built later, on the
        # trainer thread.
        from harvest.preflight import LaunchInputs, check_job_files

        check_job_files(LaunchInputs(config, tp_size=engine.tp_size))
    if partitioner is not None:
        return _assemble(config, engine, partitioner, jobs)
    partitioner = build_partitioner(config, engine.device)
    try:
        return _assemble(config, engine, partitioner, jobs)
    except BaseException:
        partitioner.close()  # its green contexts and streams: nothing else holds them yet
        raise


def _assemble(config, engine: EngineAdapter, partitioner, jobs: tuple):
    from harvest.colocate.colocation import Colocation
    from harvest.colocate.lending_state import NoKvLending
    from harvest.colocate.step_controller import StepController
    from harvest.colocate.step_timer import make_step_timer
    from harvest.schedule import QoSController

    model_name = engine.model_name or Path(engine.model_path.rstrip("/")).name or engine.model_path
    metrics = _metrics(config, engine, model_name)
    refiner = corun_check = None
    if config.profile is not None and engine.tp_rank == 0:  # rank 0 decides for every rank
        from harvest.predict.compat import corun_units_mismatch

        refiner, profile = _refiner(config, engine, partitioner)
        # The jobs' units against those the profile's co-run stage ran beside decode.
        corun_check = functools.partial(corun_units_mismatch, profile)
    qos = QoSController(config.qos, partitioner.ladder)
    lending, budget = NoKvLending(), None
    if engine.kv is not None:
        from harvest.memory.lent_budget import LentMemoryBudget

        budget = LentMemoryBudget()
        policy = lending_policy(config, engine.kv)
        lending = engine.kv.lending_controller(policy, budget, config.memory, metrics)
        if config.memory.reserve_tokens is None and hasattr(lending, "reserve"):
            costs = chunk_costs(config, engine.kv)
            if costs.warning is not None:
                logger.warning("KV lending: %s", costs.warning)
            logger.info("KV lending: the auto reserve counts %.3g ms per chunk reclaimed (%s)",
                        costs.reclaim_ms_per_chunk, costs.detail)
            lending.reserve = demand_reserve(config, policy, engine.kv, costs)
        if metrics is not None:
            metrics.set_reserve(policy.reserve_tokens)
        # A lend hands a chunk's pages to the trainer only after the kernels queued on
        # these streams have passed (they may still write the chunk's slots).
        engine.kv.allocator.set_fence_streams(kv_fence_streams(partitioner.ladder, engine.device,
                                                              engine.kv.engine_streams))
    trainer_host = None
    # A server with a profile runs a job queue even when it starts with none: jobs can be
    # submitted at run time (harvest ctl submit).
    if jobs or (config.profile is not None and (engine.build_trainer is not None or engine.kv is not None)):
        from harvest.colocate.trainer_host import TrainerHost

        build = engine.build_trainer
        if build is None:
            from harvest.train.microbatch import decode_step_sizing

            if engine.kv is None:
                raise ValueError("assemble: finetune jobs need EngineAdapter.build_trainer, or the engine's KV "
                                 "pool (kv) to build job files into lent memory")
            build = job_file_builder(engine.kv.allocator, engine.device, budget, engine.weight_source_for,
                                     tp=engine.trainer_tp, compile_layers=config.trainer.compile,
                                     unit_sizing=decode_step_sizing(config.trainer.unit_step_fraction,
                                                                    config.qos.target_tpot_ms, partitioner.ladder))
        max_running = config.queue.max_running
        if engine.tp_size > 1 and max_running > 1:
            # Every rank must run the same job's units at once: the ranks would have to
            # agree on each slice. They run one job at a time, in order, instead.
            logger.info("tensor parallelism: jobs run one at a time, in order (queue.max_running %d -> 1)",
                        max_running)
            max_running = 1
        trainer_host = TrainerHost(job_specs(jobs) if engine.jobs is None else list(jobs), build=build,
                                   cpu_threads=config.trainer.cpu_threads, nice=config.trainer.nice,
                                   tp_rank=engine.tp_rank, max_running=max_running,
                                   quantum_s=config.queue.quantum_s, starvation_s=config.queue.starvation_s,
                                   corun_check=corun_check)
    step_controller = StepController(partitioner=partitioner, qos=qos, trainer_host=trainer_host,
                             predictor=None if refiner is None else refiner.predictor, refiner=refiner,
                             metrics=metrics, target_tpot_ms=config.qos.target_tpot_ms)
    if refiner is not None:
        import sklearn.linear_model  # noqa: F401 - pay the ~1 s import at start-up, not in the first refit
    colocation = Colocation(config=config, partitioner=partitioner, step_controller=step_controller, trainer_host=trainer_host,
                            lending=lending, timer=make_step_timer(engine.device_type), metrics=metrics,
                            refiner=refiner, gpu_sampler=_gpu_sampler(engine), device_type=engine.device_type,
                            refit_min_interval_s=config.online.refit_min_interval_s,
                            engine_places_forward=engine.places_forward, ranks=engine.ranks,
                            trainer_tp=engine.trainer_tp, adapters=engine.adapters)
    colocation.model_name = model_name
    if metrics is not None:  # known now: no zeros until the first decode step
        from harvest.colocate.job_control import current_settings

        settings = current_settings(colocation)
        metrics.set_settings(target_tpot_s=settings["target_tpot_ms"] / 1e3,
                             max_lend_fraction=settings["max_lend_fraction"])
        whole = partitioner.ladder.levels[partitioner.ladder.whole_device_index]
        metrics.set_level(decode_sms=whole.decode_sms, trainer_sms=0)
    return colocation


def build_partitioner(config, device: str):
    """The SM ladder of ``device`` (green contexts, or the whole-device fallback)."""
    from harvest.compute import create_partitioner

    levels = {} if config.ladder is None else {"levels": list(config.ladder)}
    return create_partitioner(device, **levels)


def running_identity(engine: EngineAdapter, ladder):
    """What a profile must match to be used for ``engine`` on ``ladder``."""
    from harvest.compute.device import device_identity
    from harvest.predict.compat import RuntimeIdentity, model_config_hash_of_path

    return RuntimeIdentity(device_name=device_identity(engine.device).name, sm_count=ladder.total_sms,
                           model_config_hash=model_config_hash_of_path(engine.model_path),
                           model_dtype=engine.model_dtype, ladder=ladder, tp_size=engine.tp_size)


def _refiner(config, engine: EngineAdapter, partitioner):
    """The online refiner of the profile, and the profile."""
    from harvest.predict.compat import load_for
    from harvest.predict.online import OnlineRefiner

    identity = running_identity(engine, partitioner.ladder)
    profile = load_for(config.profile, identity, allow_mismatch=config.allow_profile_mismatch)
    return OnlineRefiner.from_profile(profile, config.online), profile


def kv_fence_streams(ladder, device: str, engine_streams=()) -> list:
    """The streams whose queued kernels may touch the engine's KV memory, for the unified
    allocator's fences: every level's decode stream, the engine's own streams, and the
    engine thread's current stream (where it runs outside a level, and what a level
    without a stream of its own means). Empty on a CPU, where work is done when the call
    returns."""
    if not device.startswith("cuda"):
        return []
    import torch

    streams = [level.decode_stream for level in ladder.levels if level.decode_stream is not None]
    streams.extend(stream for stream in engine_streams if stream is not None)
    streams.append(torch.cuda.current_stream(torch.device(device)))
    return streams


def lending_policy(config, kv: KvPool):
    """When to lend and reclaim the engine's KV chunks (harvest.memory.lending_setup, as
    the replay builds it)."""
    from harvest.memory import lending_setup

    g = kv.allocator.geometry
    return lending_setup.lending_policy(
        tokens_per_chunk=g.tokens_per_chunk, num_chunks=lending_setup.pool_chunks(kv.num_tokens, g.tokens_per_chunk, g.num_chunks),
        pool_tokens=kv.num_tokens, max_batch_size=kv.max_batch_size, kv_bytes_per_token=g.kv_bytes_per_token,
        target_tpot_ms=config.qos.target_tpot_ms, memory=config.memory)


def chunk_costs(config, kv: KvPool):
    """What reclaiming (and lending) one of the engine's KV chunks costs
    (harvest.memory.lend_costs): harvest.yaml's ``memory.reclaim_ms_per_chunk`` when set,
    else the profile's measured ``memory`` section scaled to the engine's chunk, else the
    default (with a warning to log). A damaged memory section raises ProfileError."""
    from harvest.memory import lend_costs

    measured = None
    if config.profile is not None:
        from harvest.predict.schema import read_memory_section

        measured = read_memory_section(config.profile)
    return lend_costs.resolve(kv.allocator.geometry.chunk_bytes, measured=measured,
                              measured_where=None if config.profile is None else f"profile {config.profile}",
                              configured_reclaim_ms=config.memory.reclaim_ms_per_chunk,
                              configured_where="harvest.yaml's memory.reclaim_ms_per_chunk")


def demand_reserve(config, policy, kv: KvPool, costs=None):
    """The auto reserve (harvest.memory.lending_setup.demand_reserve, as the replay builds
    it), its reclaim horizon from ``costs`` (default: :func:`chunk_costs`)."""
    from harvest.memory import lending_setup

    costs = chunk_costs(config, kv) if costs is None else costs
    return lending_setup.demand_reserve(policy, pool_tokens=kv.num_tokens, target_tpot_ms=config.qos.target_tpot_ms,
                                        memory=config.memory, reclaim_ms_per_chunk=costs.reclaim_ms_per_chunk,
                                        cost_source=costs.label)


def job_file_builder(allocator, device: str, budget=None, weight_source_for: Callable | None = None, tp=None,
                     compile_layers: str = "auto", unit_sizing=None):
    """``build(job_path)`` for the trainer thread: the job file through LlamaFactory, its
    frozen-weight window in lent KV memory, sized by ``budget`` (the lent-memory budget
    the lending side publishes). ``weight_source_for(job)`` may return the
    frozen weights to train on in place (the served model's, when it is the same base);
    None or a refusal (WeightSourceError) falls back to a host copy. ``tp``: this rank's
    place in a tensor-parallel trainer (every rank builds the job and keeps its shard);
    ``compile_layers``: harvest.yaml's ``trainer.compile``; ``unit_sizing``
    (harvest.train.microbatch.UnitSizing): what units are sized for, for jobs whose
    ``unit_target_ms`` is auto."""

    def build(job_path):
        from harvest.train.job import generators_kept

        # The job's seed initialises its LoRA weights as `harvest train` would; serving's
        # generators (SGLang's sampling) come back as they were (generators_kept).
        with generators_kept():
            return build_with_the_jobs_seed(job_path)

    def build_with_the_jobs_seed(job_path):
        from harvest.train.arena_window import ArenaWindowAllocator
        from harvest.train.build import build_trainer
        from harvest.train.errors import WeightSourceError
        from harvest.train.job import load_job

        job = load_job(job_path, in_server=True)
        window = ArenaWindowAllocator(allocator, device, budget)
        if weight_source_for is not None:
            try:
                source = weight_source_for(job)
                if source is not None:
                    trainer = build_trainer(job, allocator=window, weight_source=source, tp=tp,
                                            compile_layers=compile_layers, unit_sizing=unit_sizing)
                    logger.info("job %s trains on the served weights in place (same base model: no second copy)",
                                job_path)
                    return trainer
            except WeightSourceError as exc:
                logger.warning("job %s: cannot share the served weights (%s); using a host copy", job_path, exc)
        return build_trainer(job, allocator=window, tp=tp, compile_layers=compile_layers, unit_sizing=unit_sizing)

    return build


def job_specs(paths) -> list:
    """The queue's view of harvest.yaml's job files (their name, weight, served name):
    two with one name or one output folder are refused here, at start-up."""
    from harvest.colocate.job_queue import JobRefused, JobSpec, spec_clash
    from harvest.train.job import job_identity

    specs = []
    for index, path in enumerate(paths):
        identity = job_identity(path)
        spec = JobSpec(identity.path, identity.name, identity.weight, identity.serve_as, identity.output_dir)
        for other in specs:
            if (clash := spec_clash(spec, other)) is not None:
                raise JobRefused(f"jobs[{index}] ({path}) has the {clash} of {other.path}: give each job its own "
                                 "(harvest: {name: ...}, output_dir)")
        specs.append(spec)
    return specs


def _metrics(config, engine: EngineAdapter, model_name: str):
    from harvest.metrics.registry import HarvestMetrics

    try:
        metrics = HarvestMetrics(constant_labels={"model_name": model_name, **dict(config.metrics.labels)})
    except ImportError:  # prometheus-client is the serve extra's; a bare harness runs without metrics
        logger.info("metrics off: prometheus-client is not installed")
        return None
    metrics.set_build_info(**_build_info(engine))
    return metrics


def _build_info(engine: EngineAdapter) -> dict:
    import harvest

    try:
        from importlib.metadata import version

        sglang_version = version("sglang")
    except Exception:  # noqa: BLE001 - not installed (a bare harness)
        sglang_version = "none"
    import torch

    return {"version": harvest.__version__, "sglang_version": sglang_version, "torch_version": torch.__version__,
            "device": engine.device}


def _gpu_sampler(engine: EngineAdapter):
    if engine.device_type != "cuda":
        return None
    from harvest.metrics.gpu_telemetry import cuda_device_pci_bus_id, open_sampler

    ordinal = int(engine.device.split(":")[1]) if ":" in engine.device else 0
    sampler, why_not = open_sampler(ordinal, cuda_device_pci_bus_id(ordinal))
    if sampler is None:
        logger.warning("GPU telemetry off: %s", why_not)
    return sampler
