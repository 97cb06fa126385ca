"""Tensor-parallel ranks 1..N-1 of the profiler's SGLang engine, one process each.

Rank 0 is the :class:`SglangDecodeEngine` in the profiling process (it times the steps,
beside the co-run trainer); :class:`RankFollowers` starts the others and sends each of
them every prepare, decode step and release before rank 0 runs it, outside the timed span,
so every rank runs the same batches in the same order. Invariants: a follower's failure
makes rank 0 raise naming it, never hang (rank 0 enters the rendezvous only once every
follower is entering it); followers send nothing back on the hot path.

Rules: profiles/README.md, 'Tensor parallelism'.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import traceback

from harvest.predict.profiler.engines import EngineConfig, EngineError

PREPARE, STEP, RELEASE, CLOSE = "prepare", "step", "release", "close"  # rank 0 -> followers
AT_RENDEZVOUS, FAILED = "at-rendezvous", "failed"  # followers -> rank 0
# A follower closes in milliseconds; one stuck in a collective rank 0 abandoned (Ctrl-C
# mid-step) never reads CLOSE and is killed after this long.
CLOSE_TIMEOUT_S = 3.0


def follow(engine_class, config: EngineConfig, server_args, port_args, tp_rank: int, cores: tuple[int, ...], conn) -> None:
    """A follower process: build rank ``tp_rank``'s engine (``engine_class``: the
    SglangDecodeEngine, passed in so that this module does not import it), then run rank
    0's commands."""
    # Ctrl-C reaches the whole process group; rank 0 handles it and closes the followers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if cores:  # a CPU rank decodes on its SGLANG_CPU_OMP_THREADS_BIND group, one torch thread per core
            os.sched_setaffinity(0, cores)
            import torch

            torch.set_num_threads(len(cores))
        engine = engine_class(
            config, tp_rank=tp_rank, server_args=server_args, port_args=port_args, before_rendezvous=lambda: conn.send((AT_RENDEZVOUS,))
        )
        while True:
            try:
                command, *values = conn.recv()
            except EOFError:  # rank 0's process is gone
                break
            if command == PREPARE:
                engine.prepare(*values)
            elif command == STEP:
                engine.begin_step()
                engine.step()
            elif command == RELEASE:
                engine.release()
            elif command == CLOSE:
                break
        engine.close()
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, which names this rank
        try:
            conn.send((FAILED, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        except OSError:
            pass
        raise


class RankFollowers:
    """Ranks 1..N-1, started at construction (they build their runners while rank 0
    builds its own: SGLang's start-up collectives need every rank)."""

    def __init__(self, engine_class, config: EngineConfig, server_args, port_args):
        context = multiprocessing.get_context("spawn")
        self._ranks = []
        self._failure: str | None = None
        for tp_rank in range(1, config.tp_size):
            cores = config.rank_cores[tp_rank] if config.rank_cores else ()
            parent, child = context.Pipe()
            process = context.Process(
                target=follow, args=(engine_class, config, server_args, port_args, tp_rank, cores, child), name=f"harvest-profile-tp{tp_rank}"
            )
            process.start()
            child.close()
            self._ranks.append((tp_rank, process, parent))

    def send(self, command: str, *values) -> None:
        """``command`` to every follower; EngineError naming a follower that has failed."""
        for tp_rank, _, conn in self._ranks:
            try:
                conn.send((command, *values))
            except OSError:
                raise EngineError(self.failure() or f"TP rank {tp_rank} is gone (its pipe is closed)") from None

    def wait_at_rendezvous(self) -> None:
        """Return once every follower is entering SGLang's rendezvous; EngineError naming
        one that failed or exited before it."""
        for tp_rank, process, conn in self._ranks:
            while not conn.poll(0.5):
                if not process.is_alive() and not conn.poll():
                    raise EngineError(self.failure() or f"TP rank {tp_rank} exited while starting")
            try:
                message = conn.recv()
            except EOFError:
                message = (None,)
            if message[0] != AT_RENDEZVOUS:
                if message[0] == FAILED:
                    self._failure = f"TP rank {tp_rank} failed: {message[1]}\n{message[2]}"
                raise EngineError(self.failure() or f"TP rank {tp_rank} exited while starting")

    def failure(self) -> str | None:
        """What the first failed follower reported, or how it exited; None while all run."""
        for tp_rank, process, conn in self._ranks:
            if self._failure is not None:
                break
            try:
                if conn.poll():
                    message = conn.recv()
                    if message[0] == FAILED:
                        self._failure = f"TP rank {tp_rank} failed: {message[1]}\n{message[2]}"
            except (OSError, EOFError):
                pass
            if self._failure is None and process.exitcode is not None:
                code = process.exitcode
                how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
                self._failure = f"TP rank {tp_rank} {how}"
        return self._failure

    def close(self) -> None:
        for _, process, conn in self._ranks:
            try:
                conn.send((CLOSE,))
            except OSError:
                pass
        for _, process, conn in self._ranks:
            process.join(CLOSE_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join()
            conn.close()
        self._ranks = []
