"""harvest inside one SGLang scheduler process: SGLang's adapter to the co-location system.

Created by the ``Scheduler.__init__`` hook when harvest is enabled (``HARVEST_ENABLED``).
It describes SGLang to the composition root (:func:`harvest.colocate.assemble.assemble`):
the device and model, the KV pool on harvest's allocator with the lending mechanism for
SGLang's token allocator, the per-level decode graphs, and the trainer's builder. Then it
passes every decode step to :meth:`Colocation.run_step`, the step's forward straight to
:meth:`Colocation.run_forward`, each idle tick to ``on_idle``, and serves the control
endpoint, stop signals and shutdown. Anything wrong at start-up raises (SGLang then
refuses to start). Every hook: docs/sglang-integration.md, 'The hooks'.
"""

from __future__ import annotations

import atexit

from harvest import config_env
from harvest.colocate import StepLoad
from harvest.logs import get_logger

logger = get_logger(__name__)


def forward_mode_sets():
    """(modes run_step passes straight through, decode modes), by SGLang's own predicates,
    evaluated once: per step a set lookup instead of two or three method calls."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    passthrough = frozenset(mode for mode in ForwardMode if mode.is_idle() or mode.is_prebuilt())
    decode = frozenset(mode for mode in ForwardMode if mode.is_decode())
    return passthrough, decode


def observe(batch, decode_modes) -> StepLoad:
    """The StepLoad of an SGLang ScheduleBatch (``len(reqs)`` is ``batch_size()``)."""
    return StepLoad(len(batch.reqs), int(batch.seq_lens_sum or 0), batch.forward_mode in decode_modes)


class HarvestRuntime:
    def __init__(self, colocation):
        from harvest.colocate.status import StatusReporter

        self.colocation = colocation
        self.reporter = StatusReporter(colocation, interval_s=colocation.config.metrics.publish_interval_s)
        self.control_link = None  # harvest.colocate.control_link.ControlLink while the endpoint runs
        self.endpoint = None  # harvest.sglang.control_endpoint.EndpointProcess
        self._run_dir = None
        self.shutdown_signals = None
        self.level_graphs = None  # harvest.sglang.level_graphs.SglangLevelGraphs once captured
        self._passthrough_modes, self._decode_modes = forward_mode_sets()

    # -- start-up ---------------------------------------------------------------------
    @classmethod
    def attach(cls, scheduler) -> "HarvestRuntime":
        from harvest.colocate.assemble import assemble
        from harvest.config import HarvestConfig, load
        from harvest.sglang.refusals import UnsupportedServer, problems

        path = config_env.harvest_config_path()
        config = load(path) if path is not None else HarvestConfig()
        server_args = scheduler.server_args
        refused = problems(scheduler)  # before anything is built: nothing to undo
        if refused:
            raise UnsupportedServer("harvest cannot run on this server: " + "; ".join(refused))
        colocation = assemble(config, sglang_engine(scheduler, config))
        try:
            runtime = cls(colocation)
            from harvest.sglang.level_graphs import capture_level_graphs

            runtime.use_level_graphs(capture_level_graphs(scheduler.tp_worker.model_runner,
                                                          colocation.partitioner.ladder))
            if colocation.ranks is None or colocation.ranks.leader:  # rank 0 speaks for the instance
                runtime._start_control(config, server_args)
        except BaseException:
            colocation.partitioner.close()
            raise
        colocation.start()
        if colocation.trainer_host is not None:
            from harvest.sglang.shutdown import SignalCheckpoint

            peers_ended = None if colocation.ranks is None else lambda: colocation.every_ranks_trainer_ended
            runtime.shutdown_signals = SignalCheckpoint(colocation.trainer_host, colocation.request_attention,
                                                        peers_ended=peers_ended)
            runtime.shutdown_signals.install()
            colocation.attention_handlers.append(runtime._poll_shutdown_signal)
        atexit.register(runtime.close)
        lending = colocation.lending
        ranks = colocation.ranks
        where = "" if ranks is None else f" (tensor-parallel rank {ranks.rank} of {ranks.size})"
        logger.info("harvest co-location on %s%s: %s; KV %d chunks x %d tokens, reserve %d tokens; target TPOT %.1f ms; "
                    "jobs: %s", scheduler.token_to_kv_pool_allocator.get_kvcache().device, where,
                    colocation.partitioner.description, lending.policy.num_chunks, lending.tokens_per_chunk,
                    lending.policy.reserve_tokens, config.qos.target_tpot_ms, ", ".join(map(str, config.jobs)) or "none")
        return runtime

    def _start_control(self, config, server_args) -> None:
        """harvest's HTTP endpoint, in a process of its own (harvest.sglang.endpoint_server): this
        process only publishes a snapshot file and runs the commands between steps."""
        from pathlib import Path

        from harvest.colocate.control_link import ControlLink
        from harvest.sglang.control_endpoint import EndpointProcess, create_run_dir, endpoint_settings

        resolved = endpoint_settings(config.metrics, server_args.host, config.source)
        if resolved is None:
            return
        settings, where = resolved
        self._run_dir = create_run_dir()
        snapshot_path = Path(self._run_dir.name) / "snapshot.json"
        interval_s = config.metrics.publish_interval_s
        self.endpoint = EndpointProcess.start(settings, snapshot_path, api_key=server_args.api_key,
                                              admin_api_key=getattr(server_args, "admin_api_key", None),
                                              poll_interval_s=max(0.05, interval_s / 2), where=where,
                                              tp_size=server_args.tp_size)
        self.control_link = ControlLink(self.endpoint.commands, snapshot_path, self.colocation.command,
                                   self.colocation.request_attention)
        self.colocation.attention_handlers.append(self._serve_commands)
        self._publish()
        logger.info("harvest metrics and control on http://%s:%d (/metrics, /harvest/status; %s)", settings.host,
                    self.endpoint.port, where)

    # -- the scheduler's hooks ------------------------------------------------------------
    def run_step(self, original, scheduler, batch, *args, **kwargs):
        if batch.forward_mode in self._passthrough_modes:
            return original(scheduler, batch, *args, **kwargs)
        load = observe(batch, self._decode_modes)
        try:
            return self.colocation.run_step(load, original, scheduler, batch, *args, **kwargs)
        finally:
            if self.reporter.due():  # one clock read per step: a busy server has no idle ticks
                self._publish()

    def run_forward(self, original, worker, *args, **kwargs):
        """The step's forward, straight through: the Colocation runs it as the step's plan
        says (a forward outside a harvest step replays the whole-device level's graphs, on
        SGLang's stream)."""
        return self.colocation.run_forward(original, worker, *args, **kwargs)

    def use_level_graphs(self, graphs) -> None:
        """SGLang's decode graphs per SM level (None: none to select): the Colocation
        selects the plan's set before each step's forward."""
        self.level_graphs = graphs
        self.colocation.level_graphs = graphs

    def on_idle(self) -> None:
        self.colocation.on_idle()
        if self.reporter.due():
            self._publish()

    def _publish(self) -> None:
        """The gauges, and the endpoint's snapshot when it runs (at most every
        ``metrics.publish_interval_s``: about a millisecond on the engine thread)."""
        if self.control_link is None:
            self.reporter.maybe_publish()
            return
        try:
            self.control_link.publish(self.reporter.snapshot(decode_graphs=self._decode_graphs_status()))
        except OSError as exc:  # a full or vanished temp dir must not stop serving
            logger.warning("harvest: could not publish the control snapshot (%s)", exc)

    def _serve_commands(self) -> bool:
        if self.control_link.serve_commands():
            self._publish()  # the reply said the new state: the status says it too
        return False

    def _poll_shutdown_signal(self) -> bool:
        """Hand a stop signal on once the trainer has checkpointed; True while it waits."""
        signals = self.shutdown_signals
        if not signals.pending:
            return False
        signals.poll()
        return signals.pending

    def close(self) -> None:
        # The trainer checkpoints first; within SGLang's 15 s between ShutdownReq and SIGKILL.
        self.colocation.close(trainer_timeout_s=10.0)
        if self.control_link is not None:
            self.control_link.close()  # the endpoint process exits when its command socket closes
            self.control_link = None
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
        if self._run_dir is not None:
            self._run_dir.cleanup()
            self._run_dir = None

    def _decode_graphs_status(self) -> dict | None:
        graphs = self.level_graphs
        return None if graphs is None else {
            "per_level": True, "capture_s": round(graphs.capture_seconds, 2),
            "extra_bytes_by_level": [capture.extra_bytes for capture in graphs.captures]}


def sglang_engine(scheduler, config):
    """SGLang's scheduler as harvest's engine adapter."""
    from harvest.colocate.assemble import EngineAdapter, KvPool
    from harvest.sglang.kv_backing import allocator_of
    from harvest.sglang.kv_lending import KvLendingController

    token_allocator = scheduler.token_to_kv_pool_allocator
    pool = token_allocator.get_kvcache()
    allocator = allocator_of(pool)
    if allocator is None:
        raise RuntimeError("harvest: the KV cache is not on harvest's allocator (the KV hook did not run)")
    device = str(pool.device)
    model_path = scheduler.server_args.model_path

    def lending_controller(policy, budget, memory, metrics):
        # It sets itself on the token allocator, where the allocation hooks find it.
        return KvLendingController(token_allocator, allocator, policy, budget, memory, metrics=metrics)

    engine_streams = ()
    if device.startswith("cuda"):
        # SGLang's overlap scheduler prepares and consumes a step on these; a lend hands
        # pages to the trainer only after what they have queued.
        engine_streams = (scheduler.tp_worker.model_runner.forward_stream, scheduler.schedule_stream)
    kv = KvPool(allocator=allocator, num_tokens=token_allocator.size,
                max_batch_size=int(scheduler.max_running_requests), lending_controller=lending_controller,
                engine_streams=engine_streams)
    ranks, trainer_tp = tensor_parallel_groups(scheduler.server_args.tp_size, device)
    weight_source_for = None
    if config.share_served_weights:
        weight_source_for = _served_weights(model_path, scheduler.tp_worker.model_runner.model,
                                            scheduler.model_config.hf_config, 1 if ranks is None else ranks.size)
    server_args = scheduler.server_args
    return EngineAdapter(device=device, model_path=model_path,
                         model_dtype=str(scheduler.model_config.dtype).replace("torch.", ""), kv=kv,
                         weight_source_for=weight_source_for, places_forward=True, ranks=ranks,
                         trainer_tp=trainer_tp, model_name=getattr(server_args, "served_model_name", None),
                         # rank 0 asks SGLang, which loads an adapter on every rank
                         adapters=adapter_serving(server_args) if ranks is None or ranks.leader else None)


def adapter_serving(server_args):
    """Finished jobs' adapters into this server, through SGLang's own /load_lora_adapter
    (harvest.sglang.adapters): from a thread of harvest's, never the scheduler's (SGLang
    answers that request from the scheduler loop, which would wait for itself)."""
    from harvest.colocate.job_control import AdapterServing
    from harvest.sglang import adapters

    base_url, api_key = adapters.base_url_of(server_args), adapters.adapter_endpoint_key(server_args)

    def load(name, adapter_dir):
        problem = adapters.adapter_problem(adapter_dir, server_args)
        if problem is not None:
            raise adapters.AdapterServingError(f"{adapter_dir} cannot be served as {name!r}: {problem}")
        return adapters.load_adapter(base_url, name, adapter_dir, api_key=api_key)

    def unload(name):
        return adapters.unload_adapter(base_url, name, api_key=api_key)

    return AdapterServing(load, adapters.lora_serving_problem(server_args), unload)


# The trainer's collectives wait at unit boundaries for as long as a peer's gate stays
# closed (a busy decode server can keep it closed for minutes): its group must not time
# out. (Its waits poll, and give up when the ranks' agreement says a peer faulted.)
TRAINER_GROUP_TIMEOUT_DAYS = 30


def tensor_parallel_groups(tp_size: int, device: str):
    """(RankSync, TensorParallel) for this scheduler's rank, or (None, None) without tensor
    parallelism. Two process groups of harvest's own over SGLang's TP ranks (every rank
    creates them, in the same order, in Scheduler.__init__): gloo for the decode ranks'
    step agreement, and the trainer's (gloo on a CPU, NCCL on GPUs), so that neither
    interleaves with SGLang's collectives or the other's."""
    if tp_size == 1:
        return None, None
    import datetime

    import torch.distributed as dist

    from harvest.colocate.rank_sync import RankSync
    from harvest.train.tensor_parallel import TensorParallel

    if not dist.is_initialized() or dist.get_world_size() != tp_size:
        raise RuntimeError(f"harvest: expected SGLang's torch.distributed world to be its {tp_size} TP ranks "
                           f"(found {dist.get_world_size() if dist.is_initialized() else 'none'})")
    members = list(range(tp_size))
    rank = dist.get_rank()
    sync_group = dist.new_group(members, backend="gloo")
    long = datetime.timedelta(days=TRAINER_GROUP_TIMEOUT_DAYS)
    trainer_group = dist.new_group(members, backend="nccl" if device.startswith("cuda") else "gloo", timeout=long)
    # On GPUs the trainer's unit-boundary agreement (host values) needs a gloo group of its own.
    control_group = dist.new_group(members, backend="gloo", timeout=long) if device.startswith("cuda") else None
    return (RankSync(rank, tp_size, sync_group),
            TensorParallel(rank, tp_size, trainer_group, control_group=control_group))


def _served_weights(served_path, model, hf_config, tp_size: int = 1):
    """``weight_source_for(job)``: the served model's weights (this rank's shard), as the
    trainer names them, when the job's base model is the served checkpoint."""

    def weight_source_for(job):
        from harvest.sglang.served_weights import same_checkpoint, served_weight_tensors
        from harvest.train.weights import SharedTensorWeightSource

        if not same_checkpoint(job.llamafactory_args["model_name_or_path"], served_path):
            return None
        return SharedTensorWeightSource(served_weight_tensors(model, hf_config, tp_size))

    return weight_source_for
