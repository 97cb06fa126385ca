"""The replay's PNG plots: batch size over time, TPOT CDF against the target, and the SM
split over time; for a fleet (``--servers N``), finetune throughput and TPOT p99 per server. matplotlib's object API with the Agg canvas (no pyplot, no display, no
global state), so plotting works headless and from any thread.

Time series are binned (about 400 bins over the horizon, at least 1 s each) and
time-weighted: a step contributes its value times its duration to the bin it starts in.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from harvest.replay.comparison import Comparison
from harvest.replay.fleet import FleetComparison
from harvest.replay.policies import ALL_POLICIES, DECODE_ONLY, SEPARATE
from harvest.replay.profile_source import ReplayProfile
from harvest.replay.trainer_model import TrainerModel

NUM_BINS = 400
CDF_POINTS = 2000
MAX_BAR_SERVERS = 16  # a fleet plot draws bars per server up to this many servers, lines beyond


def _figure(width: float = 9.0, height: float = 4.5):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(figure)
    return figure


def _bins(horizon_s: float) -> tuple[np.ndarray, float]:
    width = max(1.0, horizon_s / NUM_BINS)
    return np.arange(0.0, horizon_s + width, width), width


def _binned(run, values: np.ndarray, edges: np.ndarray, width: float) -> np.ndarray:
    """Σ value × step duration per bin, divided by the bin width."""
    index = np.clip(np.searchsorted(edges, run.step_start_s, side="right") - 1, 0, len(edges) - 2)
    return np.bincount(index, weights=values * run.step_latency_s, minlength=len(edges) - 1) / width


def _ran(comparison: Comparison):
    """Results to draw; separate decodes exactly as decode-only, so it is drawn once."""
    results = {n: r for n, r in comparison.results.items() if r.refused is None}
    if DECODE_ONLY in results and SEPARATE in results:
        del results[SEPARATE]
    return results


def _label(name: str, comparison: Comparison) -> str:
    if name == DECODE_ONLY and SEPARATE in comparison.results and comparison.results[SEPARATE].refused is None:
        return "decode-only (= separate's decode GPU)"
    return name


def batch_size_plot(comparison: Comparison, path: Path) -> None:
    edges, width = _bins(comparison.horizon_s)
    figure = _figure()
    ax = figure.subplots()
    for name, result in _ran(comparison).items():
        run = result.run
        ax.plot(edges[:-1], _binned(run, run.step_batch_size.astype(float), edges, width), label=_label(name, comparison), lw=1)
    ax.set_xlabel("time (s)")
    ax.set_ylabel(f"decode batch size (mean per {width:.0f} s)")
    ax.set_title("Decode batch size over time")
    ax.legend()
    ax.grid(alpha=0.3)
    figure.savefig(path)


def latency_cdf_plot(comparison: Comparison, target_ms: float, path: Path) -> None:
    figure = _figure()
    ax = figure.subplots()
    for name, result in _ran(comparison).items():
        run = result.run
        if run.num_steps == 0:
            continue
        order = np.argsort(run.step_latency_s, kind="stable")
        latency = run.step_latency_s[order] * 1e3
        cumulative = np.cumsum(run.step_batch_size[order], dtype=float)
        cumulative /= cumulative[-1]
        keep = np.unique(np.linspace(0, len(latency) - 1, min(CDF_POINTS, len(latency))).astype(int))
        ax.step(latency[keep], cumulative[keep], where="post", label=_label(name, comparison), lw=1.2)
    ax.axvline(target_ms, color="red", ls="--", lw=1, label=f"target {target_ms:g} ms")
    ax.set_xlabel("TPOT (ms): latency of the decode step that produced the token")
    ax.set_ylabel("fraction of output tokens")
    ax.set_ylim(0, 1.01)
    ax.set_title("TPOT CDF against the QoS target")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    figure.savefig(path)


def sm_split_plot(comparison: Comparison, profile: ReplayProfile, path: Path) -> None:
    ladder = profile.ladder
    decode_fraction = np.array([ladder.decode_fraction(i) for i in range(ladder.num_levels)])
    edges, width = _bins(comparison.horizon_s)
    figure = _figure(9.0, 6.0)
    top, bottom = figure.subplots(2, 1, sharex=True)
    for name, result in _ran(comparison).items():
        if name == DECODE_ONLY:
            continue
        run = result.run
        busy = _binned(run, np.ones(run.num_steps), edges, width)
        with np.errstate(invalid="ignore", divide="ignore"):
            decode = _binned(run, decode_fraction[run.step_level], edges, width) / busy
        trainer = _binned(run, run.step_trainer_share, edges, width) + result.metrics["trainer_idle_share"] * np.clip(1.0 - busy, 0.0, 1.0)
        top.plot(edges[:-1], 100 * decode, label=name, lw=1)
        bottom.plot(edges[:-1], 100 * trainer, label=name, lw=1)
    top.set_ylabel("decode SMs while decoding (%)")
    top.set_ylim(0, 105)
    top.set_title("SM split over time")
    top.legend()
    top.grid(alpha=0.3)
    bottom.set_ylabel("trainer throughput (% of a GPU)")
    bottom.set_xlabel("time (s)")
    bottom.set_ylim(0, 105)
    bottom.grid(alpha=0.3)
    figure.savefig(path)


def write_all(comparison: Comparison, profile: ReplayProfile, target_ms: float, out_dir: Path) -> list[str]:
    """Write the three PNGs into ``out_dir`` (created); returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "batch_size.png", out_dir / "tpot_cdf.png", out_dir / "sm_split.png"]
    batch_size_plot(comparison, paths[0])
    latency_cdf_plot(comparison, target_ms, paths[1])
    sm_split_plot(comparison, profile, paths[2])
    return [str(p) for p in paths]


def fleet_plot(fleet: FleetComparison, trainer: TrainerModel, target_ms: float, path: Path) -> None:
    """One column per router: finetune throughput per server (a bar or line per policy;
    decode-only's is 0) over TPOT p99 per server against the target (separate decodes as
    decode-only does: drawn once)."""
    routers = list(fleet.routers.values())
    figure = _figure(max(9.0, 2.0 + 5.0 * len(routers)), 7.0)
    axes = figure.subplots(2, len(routers), sharex=True, sharey="row", squeeze=False)
    servers = np.arange(fleet.num_servers)
    scale = trainer.tokens_per_gpu_s or 1.0
    color = {name: f"C{i}" for i, name in enumerate(ALL_POLICIES)}  # one colour per policy in both rows
    for column, routed in enumerate(routers):
        top, bottom = axes[0][column], axes[1][column]
        ran = {name: result for name, result in routed.results.items() if result.refused is None}
        training = [name for name in ran if name != DECODE_ONLY]
        width = 0.8 / max(1, len(training))
        for i, name in enumerate(training):
            values = np.array([m["finetune_gpu_equivalents"] for m in ran[name].server_metrics]) * scale
            if fleet.num_servers <= MAX_BAR_SERVERS:
                top.bar(servers + (i - (len(training) - 1) / 2) * width, values, width, label=name, color=color[name])
            else:  # bars thinner than a pixel alias into stripes
                top.plot(servers, values, marker="o", ms=2, lw=1, label=name, color=color[name])
        for name, result in ran.items():
            if name == SEPARATE and DECODE_ONLY in ran:
                continue
            label = "decode-only (= separate's decode GPU)" if name == DECODE_ONLY and SEPARATE in ran else name
            p99 = [m["tpot_p99_ms"] for m in result.server_metrics]
            bottom.plot(servers, p99, marker="o", ms=3, lw=1, label=label, color=color[name])
        bottom.axhline(target_ms, color="black", ls="--", lw=1, label=f"target {target_ms:g} ms")
        top.set_title(f"{routed.router}: {fleet.num_servers} servers")
        bottom.set_xlabel("server")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"finetune per server ({trainer.unit})")
    axes[1][0].set_ylabel("TPOT p99 per server (ms)")
    figure.subplots_adjust(right=0.75)
    for row in axes:
        row[-1].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0))
    figure.savefig(path)


def write_fleet(fleet: FleetComparison, trainer: TrainerModel, target_ms: float, out_dir: Path) -> list[str]:
    """Write the fleet's PNG into ``out_dir`` (created); returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "fleet.png"
    fleet_plot(fleet, trainer, target_ms, path)
    return [str(path)]
