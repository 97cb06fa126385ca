"""SGLang's decode CUDA graphs are captured once per SM level, each on the level's decode
stream, and the chosen level's graphs are the ones replayed (harvest.sglang.level_graphs
through HarvestRuntime.run_forward). SGLang's graph runner and pdmux context are faked
here with the behaviour harvest relies on in SGLang 0.5.23: capture keys one set of
graphs per stream group by its index, and replay picks the set of
``get_current_stream_idx()``. The real attributes are resolved by the plugin (last test)."""

from __future__ import annotations

import types

import pytest

from harvest.colocate.colocation import Colocation, NoKvLending
from harvest.colocate.step_controller import StepController, StepLoad
from harvest.colocate.step_timer import CudaStepTimer
from harvest.compute.partitioner import BasePartitioner
from harvest.ladder import GREEN_CONTEXTS, Ladder, Level
from harvest.schedule import QoSController, SchedulerConfig
from harvest.sglang.level_graphs import SGLANG_ATTRIBUTES, capture_level_graphs
from tests.colocate.test_step_pairing import FakeCuda, FakeStream

BATCH_SIZES = (1, 2, 4)


class FakePdmux(types.SimpleNamespace):
    def __init__(self):
        super().__init__(STREAM_GROUPS=[], CURRENT_STREAM_IDX=0)

    def set_current_stream_idx(self, idx):
        if not 0 <= idx < len(self.STREAM_GROUPS):
            raise ValueError(f"Invalid stream index: {idx}")
        self.CURRENT_STREAM_IDX = idx

    def get_current_stream_idx(self):
        return self.CURRENT_STREAM_IDX

    def get_stream_groups(self):
        return self.STREAM_GROUPS


class FakeSetup(types.SimpleNamespace):
    def __init__(self):
        super().__init__(built=[])

    @staticmethod
    def ResolvedAttentionBackendStr(*, prefill, decode):  # noqa: N802 - SGLang's name
        return types.SimpleNamespace(prefill=prefill, decode=decode)

    def _build_resolved_backend(self, *, model_runner, resolved, init_new_workspace):
        backend = types.SimpleNamespace(resolved=resolved, graph_state=None, index=len(self.built),
                                        init_cuda_graph_state=None)
        backend.init_cuda_graph_state = lambda max_bs, max_tokens, b=backend: setattr(b, "graph_state", (max_bs, max_tokens))
        self.built.append(backend)
        return backend


class FakeDecodeGraphRunner:
    """SGLang's DecodeCudaGraphRunner as far as harvest relies on it."""

    def __init__(self, model_runner, pdmux, cuda):
        self.model_runner, self.pdmux, self.cuda = model_runner, pdmux, cuda
        self.enable_pdmux = False
        self.stream_groups = None
        self.graphs = {(bs, None): "capture-stream" for bs in BATCH_SIZES}  # SGLang's own set
        self.replayed = []

    def maybe_init_pdmux(self):
        if self.enable_pdmux:
            self.stream_groups = self.pdmux.get_stream_groups()
            for backend in self.model_runner.decode_attn_backend_group:
                backend.init_cuda_graph_state(max(BATCH_SIZES), 4 * max(BATCH_SIZES))

    def capture(self):
        assert self.enable_pdmux
        for index, group in enumerate(self.stream_groups):
            for bs in BATCH_SIZES:
                self.graphs[(bs, index)] = group[1].name  # captured on the group's decode stream
        self.model_runner.memory_in_use += 100 * len(self.stream_groups)

    def execute(self, bs):
        index = self.pdmux.get_current_stream_idx() if self.enable_pdmux else None
        backend = self.model_runner.decode_attn_backend_group[index] if self.enable_pdmux else None
        self.replayed.append((self.graphs[(bs, index)], self.cuda.current_stream().name, backend.index))


def model_runner(cuda):
    runner = types.SimpleNamespace(device="cuda", prefill_attention_backend_str="fa3", decode_attention_backend_str="fa3",
                                   decode_attn_backend_group=[], eager_runner=object(), memory_in_use=1000)
    pdmux = FakePdmux()
    runner.decode_cuda_graph_runner = FakeDecodeGraphRunner(runner, pdmux, cuda)
    return runner, pdmux


class StreamLadderPartitioner(BasePartitioner):
    description = "three levels on fake streams"

    def _release(self):
        pass


def ladder(cuda):
    levels = (Level(32, 100, FakeStream("green-32", cuda), FakeStream("trainer-100", cuda)),
              Level(64, 68, FakeStream("green-64", cuda), FakeStream("trainer-68", cuda)),
              Level(132, 0, FakeStream("whole", cuda), None))
    return Ladder(132, levels, GREEN_CONTEXTS)


def capture(cuda):
    runner, pdmux = model_runner(cuda)
    setup = FakeSetup()
    modules = {"sglang.srt.multiplex.pdmux_context": pdmux,
               "sglang.srt.model_executor.model_runner_components.attention_backend_setup": setup}
    graphs = capture_level_graphs(runner, ladder(cuda), memory_in_use=lambda: runner.memory_in_use,
                                  sglang=modules.__getitem__)
    return graphs, runner, pdmux, setup


def test_one_graph_set_per_level_captured_on_the_levels_decode_stream():
    cuda = FakeCuda()
    graphs, runner, pdmux, setup = capture(cuda)
    graph_runner = runner.decode_cuda_graph_runner
    assert {key: stream for key, stream in graph_runner.graphs.items() if key[1] is not None} == {
        (bs, index): name for bs in BATCH_SIZES for index, name in enumerate(["green-32", "green-64", "whole"])}
    # One attention backend per level (the graphs' metadata), each with its graph state.
    assert runner.decode_attn_backend_group == setup.built and len(setup.built) == 3
    assert all(backend.graph_state == (4, 16) for backend in setup.built)
    assert [c.decode_sms for c in graphs.captures] == [32, 64, 132]
    assert graphs.extra_bytes == 300 and "level 0 (32 SMs)" in graphs.describe()
    assert pdmux.get_current_stream_idx() == 2  # the whole-device level until a step chooses


def test_the_chosen_levels_graph_is_the_one_replayed_on_its_stream():
    from harvest.sglang.runtime import HarvestRuntime

    cuda = FakeCuda()
    graphs, runner, pdmux, _ = capture(cuda)
    partitioner = StreamLadderPartitioner(ladder(cuda))  # same stream names as the captures'
    qos = QoSController(SchedulerConfig(target_tpot_ms=50.0), partitioner.ladder)
    control = StepController(partitioner=partitioner, qos=qos, trainer_host=None, target_tpot_ms=50.0)
    config = types.SimpleNamespace(qos=types.SimpleNamespace(target_tpot_ms=50.0),
                                   metrics=types.SimpleNamespace(publish_interval_s=1.0),
                                   trainer=types.SimpleNamespace(cpu_threads=1, nice=2))
    colocation = Colocation(config=config, partitioner=partitioner, step_controller=control, trainer_host=None,
                            lending=NoKvLending(), timer=CudaStepTimer(cuda=cuda), metrics=None, refiner=None,
                            engine_places_forward=True)
    runtime = HarvestRuntime(colocation)
    runtime.use_level_graphs(graphs)
    graph_runner = runner.decode_cuda_graph_runner

    def forward(worker, bs):  # TpModelWorker.forward_batch_generation -> the graph runner
        graph_runner.execute(bs)

    chosen = []

    def before_step(load, level_index):  # the QoS decision, forced to a level
        plan = StepController.before_step(control, load)
        partitioner.select(level_index)
        control.level = partitioner.current
        chosen.append(level_index)
        return plan._replace(level=level_index, stream=control.level.decode_stream)

    control.before_step = lambda load: before_step(load, next(levels))
    levels = iter([0, 1, 2, 0])
    for _ in range(4):
        colocation.run_step(StepLoad(2, 100, True), lambda: runtime.run_forward(forward, "worker", 2))
    assert graph_runner.replayed == [(name, name, index) for index, name in
                                     zip(chosen, ["green-32", "green-64", "whole", "green-32"])]
    # A forward outside a harvest step replays the whole-device level's set, where SGLang put it.
    runtime.run_forward(forward, "worker", 4)
    assert graph_runner.replayed[-1] == ("whole", "engine", 2)


def test_nothing_to_recapture_without_graphs_on_cpu_or_on_a_one_level_ladder():
    cuda = FakeCuda()
    runner, _ = model_runner(cuda)
    one_level = Ladder.whole_device(132, decode_stream=FakeStream("whole", cuda))
    assert capture_level_graphs(runner, one_level, memory_in_use=lambda: 0, sglang=None) is None
    runner.decode_cuda_graph_runner = None  # --disable-cuda-graph: eager decode on the level's stream
    assert capture_level_graphs(runner, ladder(cuda), memory_in_use=lambda: 0, sglang=None) is None
    runner.decode_cuda_graph_runner = runner.eager_runner
    assert capture_level_graphs(runner, ladder(cuda), memory_in_use=lambda: 0, sglang=None) is None
    runner, _ = model_runner(cuda)
    runner.device = "cpu"
    assert capture_level_graphs(runner, ladder(cuda), memory_in_use=lambda: 0, sglang=None) is None


def test_sglangs_own_pd_multiplexing_is_refused_at_start_up():
    cuda = FakeCuda()
    runner, _ = model_runner(cuda)
    runner.decode_cuda_graph_runner.enable_pdmux = True
    with pytest.raises(RuntimeError, match="PD multiplexing"):
        capture_level_graphs(runner, ladder(cuda), memory_in_use=lambda: 0, sglang=None)


@pytest.mark.sglang
def test_the_sglang_attributes_resolve_in_the_pinned_version():
    from harvest.sglang.plugin import unresolvable_targets

    assert unresolvable_targets(SGLANG_ATTRIBUTES) == []
