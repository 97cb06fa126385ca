"""The PNG a profile comes with: measured vs predicted per level, and the error histogram.

Per level: step latency against Σctx, measured grid points as markers (one colour per
batch size; solo filled, co-run hollow) and the fitted model as lines. Then all grid
points' measured vs predicted latency against the diagonal, and a histogram of the
relative errors of both stages. matplotlib with the Agg backend (no display needed).
"""

from __future__ import annotations

import math
from pathlib import Path

from harvest.predict.schema import Profile

PHASE_MARKERS = {None: "o", "forward": "s", "backward": "^", "mixed": "D"}


def write_plot(profile: Profile, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    predictor = profile.predictor()
    levels = profile.ladder.num_levels
    num_panels = levels + 2
    cols = 2 if num_panels > 1 else 1
    rows = math.ceil(num_panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 4.2 * rows), squeeze=False)
    axes = [ax for row in axes for ax in row]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    batch_colour = {bs: colours[i % len(colours)] for i, bs in enumerate(sorted({r.batch_size for r in profile.samples}))}

    def predicted(record) -> float:
        if record.stage == "solo":
            return predictor.evaluate(record.level, record.batch_size, record.sum_context)
        return predictor.evaluate(record.level, record.batch_size, record.sum_context, predictor.phase_index(record.phase))

    for level in range(levels):
        ax = axes[level]
        lv = profile.ladder.levels[level]
        records = [r for r in profile.samples if r.level == level]
        for r in records:
            ax.scatter(
                r.sum_context, 1e3 * r.latency_s, s=28, color=batch_colour[r.batch_size],
                facecolors=batch_colour[r.batch_size] if r.stage == "solo" else "none",
                marker=PHASE_MARKERS.get(r.phase, "^"),
            )
        for bs in sorted({r.batch_size for r in records}):
            xs = sorted({r.sum_context for r in records if r.batch_size == bs})
            ax.plot(xs, [1e3 * predictor.evaluate(level, bs, x) for x in xs], color=batch_colour[bs], lw=1.2, label=f"bs {bs} solo")
            phases = sorted({r.phase for r in records if r.batch_size == bs and r.phase})
            for phase in phases:
                index = predictor.phase_index(phase)
                ax.plot(xs, [1e3 * predictor.evaluate(level, bs, x, index) for x in xs], color=batch_colour[bs], lw=1, ls="--")
        q = profile.stage1[level].quality
        ax.set_title(f"level {level}: decode {lv.decode_sms} / trainer {lv.trainer_sms} SMs (stage-1 MAPE {100 * q.mape:.1f}%)", fontsize=9)
        ax.set_xlabel("Σctx (tokens in the batch)")
        ax.set_ylabel("step latency (ms)")
        ax.legend(fontsize=7, title="lines: model (dashed: co-run)\nmarkers: measured; filled: solo,\nhollow: co-run (square fwd, triangle bwd)", title_fontsize=7)

    ax = axes[levels]
    for stage, marker in (("solo", "o"), ("corun", "^")):
        points = [(1e3 * r.latency_s, 1e3 * predicted(r)) for r in profile.samples if r.stage == stage]
        if points:
            ax.scatter(*zip(*points), s=16, marker=marker, label="stage 1 (solo)" if stage == "solo" else "stage 2 (co-run)")
    all_ms = [1e3 * r.latency_s for r in profile.samples]
    ax.plot([min(all_ms), max(all_ms)], [min(all_ms), max(all_ms)], color="grey", lw=1)
    ax.set_xlabel("measured (ms)")
    ax.set_ylabel("predicted (ms)")
    ax.set_title("measured vs predicted, all levels", fontsize=9)
    ax.legend(fontsize=8)

    ax = axes[levels + 1]
    for stage, label in (("solo", "stage 1"), ("corun", "stage 2")):
        errors = [100 * (predicted(r) - r.latency_s) / r.latency_s for r in profile.samples if r.stage == stage]
        if errors:
            ax.hist(errors, bins=20, alpha=0.6, label=f"{label}: mean |err| {sum(map(abs, errors)) / len(errors):.1f}%")
    ax.set_xlabel("prediction error (%)")
    ax.set_ylabel("grid points")
    ax.set_title("relative error histogram", fontsize=9)
    ax.legend(fontsize=8)
    for ax in axes[num_panels:]:
        ax.axis("off")

    prov = profile.provenance
    fig.suptitle(f"{prov.model.name} on {prov.device_name} ({prov.engine} engine, {prov.finetune.workload} co-run)", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
