"""Decode steps through SGLang's ModelRunner, in this process (sglang 0.5.23).

The served path minus the scheduler: the ModelRunner, model, attention backend, KV pool
and (on a GPU) decode CUDA graphs a ``launch_server`` decode instance builds, set up as
``sglang.benchmark.one_batch`` does. A step is what ``Scheduler.run_batch`` does for a
decode batch, timed from after ``ScheduleBatch.prepare_for_decode``: the span harvest's
per-step hook measures online, so offline and online samples are the same quantity.
SGLang keeps process-wide state, so one engine per process (`harvest profile` is a
command, not a library call); with ``tp_size`` N > 1 this engine is rank 0 and drives
ranks 1..N-1 (:mod:`.sglang_ranks`).
"""

from __future__ import annotations

import argparse
import os
import types
from array import array

from harvest.logs import get_logger
from harvest.predict.profiler.engines import BaseDecodeEngine, EngineConfig, EngineError, synthetic_token_ids

logger = get_logger(__name__)

_CREATED = False


class _NoPrefixCache(types.SimpleNamespace):
    """The radix cache's interface as far as allocation touches it, with nothing cached:
    every grid point starts from empty pools, so there is never anything to evict."""

    def supports_swa(self) -> bool:
        return False

    def supports_mamba(self) -> bool:
        return False

    def supports_prefix_sharing(self) -> bool:
        return False

    def evict(self, params):
        raise EngineError("SGLang asked to evict cached prefixes: the KV pool is too small for this grid point")

    evict_for_alloc = evict

    def maybe_hand_to_session(self, req) -> None:
        pass


def server_argv(config: EngineConfig, max_total_tokens: int) -> list[str]:
    argv = [
        "--model-path", config.model_path,
        "--device", config.device,
        "--dtype", config.dtype,
        "--skip-tokenizer-init",
        "--grammar-backend", "none",
        "--max-running-requests", str(config.max_batch_size),
        "--max-total-tokens", str(max_total_tokens),
        "--random-seed", str(config.seed),
        "--log-level", "warning",
    ]
    if config.tp_size > 1:
        argv += ["--tp-size", str(config.tp_size)]
    if config.device == "cpu":
        # SGLang's x86 default attention backend (intel_amx) needs AMX, which the CPUs
        # harvest tests on lack; no CUDA graphs on a CPU (docs/sglang-integration.md).
        argv += ["--attention-backend", "torch_native", "--disable-cuda-graph"]
    else:
        argv += ["--cuda-graph-max-bs-decode", str(config.max_batch_size)]
    if config.random_weights:
        argv += ["--load-format", "dummy"]
    return argv


class SglangDecodeEngine(BaseDecodeEngine):
    """TP rank ``tp_rank`` of a decode instance of ``config.tp_size`` ranks. Rank 0 (the
    default) parses the server arguments and starts the other ranks; a follower rank is
    given rank 0's ``server_args`` and ``port_args``, and ``before_rendezvous`` to tell
    rank 0 it is about to create the process groups (:func:`.sglang_ranks.follow`)."""

    name = "sglang"

    def __init__(self, config: EngineConfig, tp_rank: int = 0, server_args=None, port_args=None, before_rendezvous=None):
        global _CREATED
        if _CREATED:
            raise EngineError("SglangDecodeEngine: SGLang's process-wide state allows one engine per process")
        _CREATED = True
        if config.device == "cpu":
            os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        import torch
        from sglang.srt.entrypoints.engine import _set_envs_and_config
        from sglang.srt.server_args import PortArgs, ServerArgs

        self._torch = torch
        self.config = config
        self._followers = None
        self._batch = None
        # Room for every request's context plus the decoded tokens, padded to pages.
        self._max_total_tokens = config.max_batch_size * (config.max_context_tokens + 64)
        if server_args is None:
            parser = argparse.ArgumentParser()
            ServerArgs.add_cli_args(parser)
            server_args = ServerArgs.from_cli_args(parser.parse_args(server_argv(config, self._max_total_tokens)))
            server_args.resolve_once()
            _set_envs_and_config(server_args)  # environment the follower processes then inherit
            port_args = PortArgs.init_new(server_args)
        if tp_rank == 0 and config.tp_size > 1:
            from harvest.predict.profiler.sglang_ranks import RankFollowers

            self._followers = RankFollowers(type(self), config, server_args, port_args)
            before_rendezvous = self._followers.wait_at_rendezvous
        try:
            self._load(config, server_args, port_args, tp_rank, before_rendezvous)
        except BaseException as exc:
            failure = self._followers.failure() if self._followers is not None else None
            self.close()
            if failure is not None:
                raise EngineError(f"SGLang's tensor-parallel start-up failed: {failure}") from exc
            raise

    def _load(self, config: EngineConfig, server_args, port_args, tp_rank: int, before_rendezvous) -> None:
        """Rank ``tp_rank``'s ModelRunner, as sglang.benchmark.one_batch loads one;
        ``before_rendezvous`` (TP > 1) runs just before the process groups are created."""
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.distributed import bootstrap
        from sglang.srt.layers.moe import initialize_moe_config
        from sglang.srt.layers.quantization.fp4_utils import initialize_fp4_gemm_config
        from sglang.srt.layers.quantization.fp8_utils import initialize_fp8_gemm_config
        from sglang.srt.layers.quantization.unquant import initialize_bf16_gemm_config
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.srt.runtime_context import SpawnRanks, get_device, get_schedule, publish, spawn_world_rank

        gpu_id = tp_rank  # rank r on GPU r (CPU: the r-th SGLANG_CPU_OMP_THREADS_BIND group)
        world_rank = spawn_world_rank(server_args, tp_rank=tp_rank, pp_rank=0)
        publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=world_rank, gpu_id=gpu_id))
        for initialize in (initialize_moe_config, initialize_fp8_gemm_config, initialize_bf16_gemm_config, initialize_fp4_gemm_config):
            initialize()
        model_config = ModelConfig.from_server_args(server_args)
        if config.max_context_tokens > model_config.context_len:
            raise EngineError(
                f"context lengths up to {config.max_context_tokens} tokens (grid + steps) exceed the model's "
                f"context length {model_config.context_len}; lower --context-lengths"
            )
        if before_rendezvous is not None:
            before_rendezvous()
        bootstrap.init_parallel_runtime(server_args=server_args, device=get_device().device, dist_port=port_args.nccl_port)
        bootstrap.init_layer_runtime(model_config=model_config)
        runner = ModelRunner(
            model_config=model_config,
            mem_fraction_static=server_args.mem_fraction_static,
            gpu_id=gpu_id,
            nccl_port=port_args.nccl_port,
            server_args=server_args,
        )
        runner.alloc_memory_pool()
        runner.init_attention_backends()
        runner.init_cuda_graphs()
        self.runner = runner
        self.vocab_size = model_config.vocab_size
        self.model_dtype = str(model_config.dtype).removeprefix("torch.")
        self.batch_size_buckets = tuple(sorted(set(getattr(runner, "decode_cuda_graph_capture_bs", []) or [])))
        self._page_size = get_schedule().page_size
        self._next_token_ids = None
        self._request_serial = 0
        if runner.req_to_token_pool.size < config.max_batch_size:
            raise EngineError(
                f"SGLang's request pool holds {runner.req_to_token_pool.size} requests, the grid needs {config.max_batch_size}"
            )
        logger.info(
            "SGLang ModelRunner ready: %s on %s (TP rank %d of %d), %d KV tokens, CUDA-graph batch sizes %s",
            config.model_path, config.device, tp_rank, config.tp_size, runner.max_total_num_tokens,
            list(self.batch_size_buckets) or "none",
        )

    def _rank_failure(self, exc: BaseException) -> None:
        """``exc`` on rank 0 as the EngineError naming the follower whose failure caused it
        (a collective whose peer died fails on every other rank), if one did."""
        failure = self._followers.failure() if self._followers is not None else None
        if failure is not None:
            raise EngineError(failure) from exc

    def _requests(self, batch_size: int, context_length: int):
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        params = SamplingParams(temperature=0, max_new_tokens=1 << 20, ignore_eos=True)
        requests = []
        for _ in range(batch_size):
            self._request_serial += 1
            ids = synthetic_token_ids(context_length, self.vocab_size, self._request_serial)
            req = Req(rid=f"harvest-profile-{self._request_serial}", origin_input_text="", origin_input_ids=array("q", ids), sampling_params=params)
            req.full_untruncated_fill_ids = req.origin_input_ids
            req.logprob_start_len = -1
            req.extend_end = len(req.origin_input_ids)
            requests.append(req)
        return requests

    def _forward_and_sample(self, batch):
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch

        forward_batch = ForwardBatch.init_new(batch, self.runner, return_hidden_states_before_norm=False)
        logits = self.runner.forward(forward_batch).logits_output
        return self.runner.sample(logits, forward_batch)

    def prepare(self, batch_size: int, context_length: int) -> None:
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        self.release()
        if self._followers is not None:
            from harvest.predict.profiler.sglang_ranks import PREPARE

            self._followers.send(PREPARE, batch_size, context_length)
        runner = self.runner
        cache = _NoPrefixCache(page_size=self._page_size, device=runner.device, token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator)
        batch = ScheduleBatch.init_new(
            reqs=self._requests(batch_size, context_length),
            req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
            tree_cache=cache,
            model_config=runner.model_config,
            enable_overlap=False,
            spec_algorithm=SpeculativeAlgorithm.NONE,
        )
        try:
            with self._torch.inference_mode():
                batch.prepare_for_extend()
                if batch.input_ids is None and getattr(batch, "prefill_input_ids_cpu", None) is not None:
                    batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device)
                    batch.prefill_input_ids_cpu = None
                self._next_token_ids = self._forward_and_sample(batch)
        except Exception as exc:
            self._rank_failure(exc)
            raise
        self._batch = batch

    def begin_step(self) -> float:
        batch = self._batch
        if batch is None:
            raise EngineError("SglangDecodeEngine.begin_step before prepare")
        if self._followers is not None:  # they start the step now: the timed span holds no pipe traffic
            from harvest.predict.profiler.sglang_ranks import STEP

            self._followers.send(STEP)
        with self._torch.inference_mode():
            batch.input_ids = self._next_token_ids.to(self._torch.int64)
            batch.prepare_for_decode()
        # seq_lens_sum is left None here and summed in ForwardBatch.init_new; the host
        # copy gives the same number without a device sync.
        return float(batch.seq_lens_cpu.sum())

    def step(self) -> None:
        try:
            with self._torch.inference_mode():
                self._next_token_ids = self._forward_and_sample(self._batch)
        except Exception as exc:
            self._rank_failure(exc)
            raise

    def release(self) -> None:
        if self._batch is None:
            return
        self._batch = None
        self._next_token_ids = None
        if self._followers is not None:
            from harvest.predict.profiler.sglang_ranks import RELEASE

            self._followers.send(RELEASE)
        self.runner.req_to_token_pool.clear()
        self.runner.token_to_kv_pool_allocator.clear()

    def close(self) -> None:
        try:
            self.release()
        finally:
            if self._followers is not None:
                self._followers.close()
                self._followers = None
