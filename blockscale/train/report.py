"""Reports of a comparison: a Markdown page, its PNG plots, and the same table as JSON.

From the runs in `OUT/NAME` (their `config.json`, `summary.json`, `metrics.jsonl`; a comparison
begun before runs sat directly in OUT keeps them all in `OUT/runs/NAME`, see `variant_dir`):

- `report.md`: the table (final held-out loss, relative gap to BF16, bits per byte, tokens/s,
  speed relative to BF16, peak GPU memory), the plots, and the numerics telemetry: for each
  quantized run, the layer/operand pairs with the lowest SQNR; for an MoE model, how its
  routers spread tokens over experts (and the load-balancing loss), and the quantized experts
  with the lowest SQNR;
- `loss_curves.png`: training and held-out loss over steps;
- `gap_to_bf16.png`: (loss - loss_bf16) / loss_bf16 over steps, held-out and training loss;
- `telemetry_NAME.png`: per run, one heatmap per quantized operand, layer x step, of the SQNR;
- `report.json`: the table, for docs and scripts.

A speed is only as good as the machine that gave it: a run whose threads waited for a free CPU
core (train/machine.py, recorded by `compare`) or whose speed moved by more than SPREAD between
logging intervals is marked *unreliable* in both speed columns, with one sentence a run saying
why under the table.

The relative gap compares losses at the same step, so every run must share the batches (which
`compare` guarantees). matplotlib is imported only here, and only when plotting.
"""

from __future__ import annotations

import datetime
import json
import math
import statistics
from pathlib import Path

import torch

from blockscale import recipes
from blockscale.models import SIZES
from blockscale.train import machine
from blockscale.train.loop import read_metrics

BASELINE = "bf16"
# panel order: the recipe's operand order (forward, then the two backward GEMMs)
OPERANDS = tuple(name for name, _ in recipes.get(BASELINE).operands())


def variant_dir(out: Path, name: str) -> Path:
    """Where a comparison keeps its run `name`: `OUT/NAME`, or `OUT/runs/NAME` in a comparison
    begun before runs sat directly in OUT (one that has `OUT/runs/`), so that all of one
    comparison's runs stay side by side."""
    legacy = Path(out) / "runs"
    return legacy / name if legacy.is_dir() else Path(out) / name


def load_run(run_dir: Path) -> dict:
    """A run's config, summary and metric rows. A run still in progress (no summary yet) gets
    a partial summary from its metrics, marked with the step it reached."""
    rows = read_metrics(run_dir)
    summary_path = run_dir / "summary.json"
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
    else:
        evals = [r for r in rows if r["kind"] == "eval"]
        rates = [r["tokens_per_s"] for r in rows if r["kind"] == "train"][1:]
        summary = {
            "status": f"unfinished (step {max((r['step'] for r in rows), default=0)})",
            "val_loss": evals[-1]["val_loss"] if evals else None,
            "val_bpb": evals[-1]["val_bpb"] if evals else None,
            "tokens_per_s": statistics.median(rates) if rates else None,
        }
    config = json.loads((run_dir / "config.json").read_text())
    return {
        "name": run_dir.name,
        "config": config,
        "summary": summary,
        "rows": rows,
        "machine": machine.summarize(machine.read(run_dir)),
    }


def _gap(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or not math.isfinite(value):
        return None
    return 100.0 * (value - base) / base


def _ema(values: list[float], alpha: float = 0.3) -> list[float]:
    out, acc = [], None
    for v in values:
        acc = v if acc is None else alpha * v + (1 - alpha) * acc
        out.append(acc)
    return out


def _series(run: dict, kind: str, key: str) -> tuple[list[int], list[float]]:
    rows = [r for r in run["rows"] if r["kind"] == kind]
    return [r["step"] for r in rows], [r[key] for r in rows]


# A run that trained this share of its time beside another run on its device: its speed is
# not compared with BF16's. Below it, a few seconds where one run starts as another ends.
SHARED_PCT = 5.0


def _training_intervals(run: dict) -> list[tuple[float, float]]:
    """Wall-clock spans between consecutive training rows (Unix seconds, sorted). A gap much
    longer than the run's usual one (a pause and its resume) is not training time."""
    times = [r["time"] for r in run["rows"] if r["kind"] == "train" and "time" in r]
    spans = list(zip(times, times[1:]))
    if not spans:
        return []
    longest = max(10 * statistics.median(b - a for a, b in spans), 60.0)
    return [(a, b) for a, b in spans if 0 <= b - a <= longest]


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def shared_pct(run: dict, runs: list[dict]) -> float | None:
    """Percent of `run`'s training time during which another of `runs` trained on the same
    device (same `device_id` in their summaries), or None where the metrics carry no times."""
    device = run["summary"].get("device_id")
    own = _training_intervals(run)
    if device is None or not own:
        return None
    others = _merged(
        [
            span
            for other in runs
            if other is not run and other["summary"].get("device_id") == device
            for span in _training_intervals(other)
        ]
    )
    overlap, j = 0.0, 0
    for a, b in own:  # both sorted: one sweep
        while j < len(others) and others[j][1] <= a:
            j += 1
        k = j
        while k < len(others) and others[k][0] < b:
            overlap += min(b, others[k][1]) - max(a, others[k][0])
            k += 1
    total = sum(b - a for a, b in own)
    return 100.0 * overlap / total if total > 0 else None


# A run's intervals after the first (which holds warm-up) run the same steps, so speeds that
# span more than this factor mean something else slowed part of the run: a load that came or
# went mid-run, which the run's mean wait for a core (train/machine.py) can average away.
SPREAD = 2.0


def speed_spread(run: dict) -> tuple[float, float] | None:
    """(slowest, fastest) tokens/s of a run's logging intervals after the first, or None
    with fewer than two."""
    rates = [r.get("tokens_per_s") for r in run["rows"] if r["kind"] == "train"][1:]
    rates = [r for r in rates if r is not None and r > 0]
    return (min(rates), max(rates)) if len(rates) >= 2 else None


def unreliable(run: dict) -> str | None:
    """Why a run's speed is distorted (the end of a sentence), or None."""
    reasons = []
    waited = machine.withheld(run.get("machine"))
    if waited:
        reasons.append(waited)
    spread = speed_spread(run)
    if spread and spread[1] > SPREAD * spread[0]:
        reasons.append(
            f"its speed moved {spread[1] / spread[0]:.1f}x between logging intervals "
            f"({spread[0]:,.0f} to {spread[1]:,.0f} tokens/s)"
        )
    return "; ".join(reasons) or None


def table(runs: list[dict]) -> list[dict]:
    base = next((r["summary"] for r in runs if r["name"] == BASELINE), {})
    shared_of = {run["name"]: shared_pct(run, runs) for run in runs}
    why_of = {run["name"]: unreliable(run) for run in runs}
    rows = []
    for run in runs:
        s = run["summary"]
        speed = s.get("tokens_per_s")
        shared = shared_of[run["name"]]
        measured = run.get("machine") or {}
        # Only speeds known to be measured alone compare: a run without timestamps may have
        # shared the device, and so may a BF16 baseline without them.
        alone = all(p is not None and p < SHARED_PCT for p in (shared, shared_of.get(BASELINE)))
        rows.append(
            {
                "run": run["name"],
                "val_loss": s.get("val_loss"),
                "gap_pct": _gap(s.get("val_loss"), base.get("val_loss")),
                "val_bpb": s.get("val_bpb"),
                "tokens_per_s": speed,
                "shared_pct": shared,
                "speed_vs_bf16": speed / base["tokens_per_s"]
                if speed and base.get("tokens_per_s") and alone
                else None,
                # What the machine gave the run (None: not recorded), and why its speed is
                # distorted; a ratio is as unreliable as either of its speeds.
                "waited_pct": measured.get("waited_pct"),
                "others_cores": measured.get("others_cores"),
                "unreliable": why_of[run["name"]],
                "ratio_unreliable": bool(why_of[run["name"]] or why_of.get(BASELINE)),
                "peak_memory_gib": s.get("peak_memory_gib"),
                # Train rows carry the training steps' own peak; before they did, the summary
                # held the process's peak since its last start, evaluation and probes included.
                "peak_of_training": any(
                    "peak_gib" in r for r in run["rows"] if r["kind"] == "train"
                ),
                "status": s.get("status", "unfinished"),
            }
        )
    return rows


def _fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _cells(row: dict) -> list[str]:
    return [
        row["run"],
        _fmt(row["val_loss"], ".4f"),
        _fmt(row["gap_pct"], "+.2f") + ("%" if row["gap_pct"] is not None else ""),
        _fmt(row["val_bpb"], ".3f"),
        _fmt(row["tokens_per_s"], ",.0f")
        + (
            f" (shared {row['shared_pct']:.0f}%)"
            if row.get("shared_pct") is not None and row["shared_pct"] >= SHARED_PCT
            else ""
        )
        + (" (unreliable)" if row.get("unreliable") and row["tokens_per_s"] else ""),
        _fmt(row["speed_vs_bf16"], ".2f")
        + ("x" if row["speed_vs_bf16"] is not None else "")
        + (" (unreliable)" if row.get("ratio_unreliable") and row["speed_vs_bf16"] else ""),
        _fmt(row["peak_memory_gib"], ".2f", "n/a (CPU)"),
        row["status"],
    ]


HEADER = [
    "run",
    "val loss",
    "gap to BF16",
    "bits/byte",
    "tokens/s",
    "speed vs BF16",
    "peak GiB",
    "status",
]


def format_table(rows: list[dict]) -> str:
    """The table as aligned plain text, for the terminal."""
    cells = [HEADER] + [_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADER))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in cells)


def _speed_note(rows: list[dict]) -> str:
    note = (
        "A run marked *shared N%* trained N% of its time while another run of this report "
        "trained on the same device, so its speed is not compared with BF16's."
    )
    unknown = [r["run"] for r in rows if r.get("shared_pct") is None]
    if unknown:
        note += (
            " These runs predate the timestamps that tell whether a run had the device to "
            "itself, so their speeds (and every speed, where it is BF16's) are not compared: "
            + ", ".join(f"`{n}`" for n in unknown)
            + "."
        )
    return note


def reliability_lines(rows: list[dict]) -> list[str]:
    """Under the table: one sentence a run whose speed is distorted, and the runs nobody
    checked."""
    distorted = [r for r in rows if r.get("unreliable")]
    lines = []
    if distorted:
        lines += [
            "**Unreliable speeds**: these runs did not have the machine to themselves, so their "
            "tokens/s and every ratio to them measure the machine more than the recipe (rerun "
            "on an idle machine to compare speeds):",
            "",
            *[f"- `{r['run']}`: {r['unreliable']}." for r in distorted],
        ]
    unchecked = [r["run"] for r in rows if r.get("waited_pct") is None]
    if unchecked:
        lines += [
            "",
            "Not checked for other processes' load (no record of what the machine gave them: "
            "runs from before that record, or not on Linux): "
            + ", ".join(f"`{n}`" for n in unchecked)
            + ".",
        ]
    return [*lines, ""] if lines else []


def _memory_note(rows: list[dict]) -> str:
    note = " Peak GiB: the training steps' peak allocation (evaluation and telemetry excluded)."
    old = [r["run"] for r in rows if r["peak_memory_gib"] is not None and not r["peak_of_training"]]
    if old:
        note += (
            " These runs predate that measure, so theirs is the peak of the run's last "
            "(resumed) segment with evaluation and telemetry probes in it, and does not "
            "compare: " + ", ".join(f"`{n}`" for n in old) + "."
        )
    return note


def _markdown_table(header: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(line) + " |" for line in lines]
    return "\n".join(out)


def telemetry_grid(run: dict) -> tuple[list[int], dict[str, dict[str, list[float]]]]:
    """(steps, {operand: {layer: [sqnr_db per step]}}) of one run's telemetry rows."""
    rows = [r for r in run["rows"] if r["kind"] == "telemetry" and r["layers"]]
    steps = [r["step"] for r in rows]
    grid: dict[str, dict[str, list[float]]] = {operand: {} for operand in OPERANDS}
    for i, row in enumerate(rows):
        for layer, operands in row["layers"].items():
            for operand, stats in operands.items():
                series = grid.setdefault(operand, {}).setdefault(layer, [math.nan] * len(rows))
                series[i] = stats["sqnr_db"]
    return steps, {operand: by_layer for operand, by_layer in grid.items() if by_layer}


def worst_operands(run: dict, count: int = 5) -> list[list[str]]:
    """The (layer, operand) pairs of lowest mean SQNR, with their zero fraction and amax."""
    rows = [r for r in run["rows"] if r["kind"] == "telemetry" and r["layers"]]
    acc: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        for layer, operands in row["layers"].items():
            for operand, stats in operands.items():
                acc.setdefault((layer, operand), []).append(stats)
    ranked = sorted(acc.items(), key=lambda kv: sum(s["sqnr_db"] for s in kv[1]) / len(kv[1]))
    lines = []
    for (layer, operand), stats in ranked[:count]:
        n = len(stats)
        lines.append(
            [
                layer,
                operand,
                f"{sum(s['sqnr_db'] for s in stats) / n:.1f}",
                f"{min(s['sqnr_db'] for s in stats):.1f}",
                f"{100 * sum(s['zero_frac'] for s in stats) / n:.2f}%",
                f"{max(s['amax'] for s in stats):.3g}",
            ]
        )
    return lines


def expert_load(run: dict) -> list[list[str]]:
    """Per MoE layer: each expert's share of the run's token-expert assignments, the busiest
    expert's share over the mean share (1.00 = balanced; E = all tokens on one expert) for
    the whole run and for its last logging interval."""
    rows = [r for r in run["rows"] if r["kind"] == "train" and "expert_tokens" in r]
    if not rows:
        return []
    lines = []
    for layer in rows[-1]["expert_tokens"]:
        total = [sum(col) for col in zip(*(r["expert_tokens"][layer] for r in rows))]
        last = rows[-1]["expert_tokens"][layer]
        lines.append(
            [
                layer,
                " ".join(f"{100 * t / max(sum(total), 1):.1f}" for t in total),
                f"{_imbalance(total):.2f}",
                f"{_imbalance(last):.2f}",
            ]
        )
    return lines


def _imbalance(tokens: list[int]) -> float:
    return max(tokens) * len(tokens) / max(sum(tokens), 1)


def worst_experts(run: dict, count: int = 5) -> list[list[str]]:
    """The (layer, operand, expert) triples of lowest mean SQNR over the probes, with their
    zero fraction and the tokens the expert got in the probes."""
    rows = [r for r in run["rows"] if r["kind"] == "telemetry" and r.get("experts")]
    acc: dict[tuple[str, str, int], list[tuple[float, float, int]]] = {}
    for row in rows:
        for layer, entry in row["experts"].items():
            for operand, stats in entry.items():
                if operand == "tokens":
                    continue
                for e, (sqnr, zero) in enumerate(zip(stats["sqnr_db"], stats["zero_frac"])):
                    if sqnr is not None:
                        acc.setdefault((layer, operand, e), []).append(
                            (sqnr, zero, entry["tokens"][e])
                        )
    ranked = sorted(acc.items(), key=lambda kv: statistics.fmean(s for s, _, _ in kv[1]))
    return [
        [
            layer,
            operand,
            str(e),
            f"{statistics.fmean(s for s, _, _ in seen):.1f}",
            f"{min(s for s, _, _ in seen):.1f}",
            f"{100 * statistics.fmean(z for _, z, _ in seen):.2f}%",
            f"{statistics.fmean(t for _, _, t in seen):,.0f}",
        ]
        for (layer, operand, e), seen in ranked[:count]
    ]


def _moe_section(runs: list[dict]) -> list[str]:
    lines = []
    for run in runs:
        load = expert_load(run)
        if not load:
            continue
        aux = [r["aux_loss"] for r in run["rows"] if r["kind"] == "train" and "aux_loss" in r]
        lines += [
            f"### {run['name']}",
            "",
            f"Load-balancing loss: {aux[0]:.4f} in the first logged interval, {aux[-1]:.4f} in "
            "the last (1 = uniform routing).",
            "",
            _markdown_table(
                ["MoE layer", "tokens per expert (% of assignments)", "max/mean", "max/mean, last"],
                load,
            ),
            "",
        ]
        worst = worst_experts(run)
        if worst:
            lines += [
                _markdown_table(
                    [
                        "layer",
                        "operand",
                        "expert",
                        "mean SQNR dB",
                        "min SQNR dB",
                        "zero fraction",
                        "tokens (probe)",
                    ],
                    worst,
                ),
                "",
            ]
    if not lines:
        return []
    return [
        "## Mixture of experts: routing and the experts' numerics",
        "",
        "Tokens per expert: each expert's share of the token-expert assignments over the whole "
        "run (top-k routing gives each token k). Max/mean: the busiest expert's share over the "
        "mean share, for the whole run and for its last logging interval (1.00 = balanced, E = "
        "every token on one expert). The second table, for quantized runs: the experts whose "
        "quantized operands have the lowest mean SQNR in the telemetry probes (each expert is "
        "quantized with its own scale), with the tokens they got in the probe's batch: an "
        "expert that gets few tokens has few values to set its activation scales from.",
        "",
        *lines,
    ]


# The narrowest SQNR span a heatmap's colours cover. Stretching a narrower spread over the whole
# colour map paints noise as structure: an MXFP8 run's operands all sit within a dB of 31 dB,
# and a 0.6 dB colour range made them look as different as NVFP4's best and worst layers.
# 6 dB is a factor of 4 in noise power.
MIN_SPAN_DB = 6.0


def heatmap_range(values: list[float]) -> tuple[float, float]:
    """(vmin, vmax) of a telemetry heatmap: the 2nd to 98th percentile of the finite SQNRs, so
    that one outlier (an operand quantized without error reads hundreds of dB) does not wash
    out the rest, widened about its middle to at least MIN_SPAN_DB."""
    finite = sorted(v for v in values if math.isfinite(v))
    if not finite:
        return 0.0, MIN_SPAN_DB
    lo = finite[round(0.02 * (len(finite) - 1))]
    hi = finite[round(0.98 * (len(finite) - 1))]
    if hi - lo < MIN_SPAN_DB:
        mid = (lo + hi) / 2
        lo, hi = mid - MIN_SPAN_DB / 2, mid + MIN_SPAN_DB / 2
    return lo, hi


def plot(out: Path, runs: list[dict]) -> list[tuple[str, str]]:
    """Write the PNGs; returns (caption, file name) pairs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in runs:
        steps, loss = _series(run, "train", "loss")
        ax_train.plot(steps, _ema(loss), label=run["name"], linewidth=1.2)
        steps, val = _series(run, "eval", "val_loss")
        ax_val.plot(steps, val, marker="o", markersize=3, label=run["name"])
    for ax, title in ((ax_train, "training loss (EMA)"), (ax_val, "held-out loss")):
        ax.set(title=title, xlabel="step", ylabel="loss (nats/byte)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "loss_curves.png", dpi=110)
    plt.close(fig)
    made.append(("Loss curves", "loss_curves.png"))

    base = next((r for r in runs if r["name"] == BASELINE), None)
    if base is not None and len(runs) > 1:
        fig, (ax_val, ax_train) = plt.subplots(1, 2, figsize=(12, 4.5))
        for kind, key, ax, smooth in (
            ("eval", "val_loss", ax_val, False),
            ("train", "loss", ax_train, True),
        ):
            base_steps, base_loss = _series(base, kind, key)
            reference = dict(zip(base_steps, _ema(base_loss) if smooth else base_loss))
            for run in runs:
                if run is base:
                    continue
                steps, loss = _series(run, kind, key)
                loss = _ema(loss) if smooth else loss
                pairs = [(s, _gap(v, reference[s])) for s, v in zip(steps, loss) if s in reference]
                pairs = [(s, g) for s, g in pairs if g is not None]
                style = (
                    {"linestyle": "--", "color": "gray"} if run["name"].startswith(BASELINE) else {}
                )
                ax.plot(
                    [s for s, _ in pairs],
                    [g for _, g in pairs],
                    label=run["name"],
                    marker="o" if not smooth else None,
                    markersize=3,
                    **style,
                )
            ax.axhline(0.0, color="black", linewidth=0.8)
            ax.set(
                xlabel="step",
                ylabel="relative gap to BF16 (%)",
                title=f"{'held-out' if kind == 'eval' else 'training (EMA)'} loss vs BF16",
            )
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "gap_to_bf16.png", dpi=110)
        plt.close(fig)
        made.append(("Relative gap to BF16", "gap_to_bf16.png"))

    for run in runs:
        steps, grid = telemetry_grid(run)
        if not grid:
            continue
        layers = list(next(iter(grid.values())))
        values = [v for by_layer in grid.values() for series in by_layer.values() for v in series]
        # One color scale for every panel, so operands compare with each other too.
        vmin, vmax = heatmap_range(values)
        scale = {"vmin": vmin, "vmax": vmax}
        cols = min(3, len(grid))
        nrows = -(-len(grid) // cols)
        fig, axes = plt.subplots(
            nrows,
            cols,
            figsize=(4.6 * cols + 1, 0.9 + nrows * (0.6 + 0.22 * len(layers))),
            squeeze=False,
        )
        for ax in axes.flat[len(grid) :]:
            ax.axis("off")
        for ax, (operand, by_layer) in zip(axes.flat, grid.items()):
            names = list(by_layer)
            image = ax.imshow(
                torch.tensor([by_layer[n] for n in names]).numpy(),
                aspect="auto",
                cmap="viridis",
                interpolation="nearest",
                **scale,
            )
            ax.set_title(operand, fontsize=9)
            ax.set_yticks(range(len(names)), [n.removeprefix("layers.") for n in names], fontsize=7)
            ticks = list(range(0, len(steps), max(1, len(steps) // 6)))
            ax.set_xticks(ticks, [str(steps[i]) for i in ticks], fontsize=7)
            ax.set_xlabel("step", fontsize=8)
        fig.tight_layout(rect=(0, 0, 0.92, 0.94))
        finite = [v for v in values if math.isfinite(v)]
        beyond = (min(finite, default=vmin) < vmin, max(finite, default=vmax) > vmax)
        extend = {(0, 0): "neither", (1, 0): "min", (0, 1): "max", (1, 1): "both"}[beyond]
        fig.colorbar(
            image,
            ax=list(axes.flat),
            label="SQNR (dB)",
            fraction=0.02,
            pad=0.02,
            extend=extend,
        )
        fig.suptitle(
            f"{run['name']}: SQNR of each quantized operand against BF16 (low = hurts)", fontsize=10
        )
        name = f"telemetry_{run['name']}.png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        made.append((f"Telemetry: {run['name']}", name))
    return made


def write_report(out: Path, names: list[str]) -> Path:
    """Write report.md, report.json and the plots for the runs `names` in `out`."""
    out = Path(out)
    dirs = [variant_dir(out, n) for n in names]
    runs = [load_run(d) for d in dirs if (d / "config.json").exists()]
    rows = table(runs)
    try:
        plots = plot(out, runs)
        plot_note = ""
    except ImportError:
        plots, plot_note = [], "Plots skipped: matplotlib is not installed.\n"
    cfg = _as_used(runs[0]["config"])
    tokens_per_step = cfg["batch_size"] * cfg["grad_accum"] * cfg["seq_len"]
    devices = sorted({r["summary"].get("device", "?") for r in runs})
    # The runs' own torch (a report may be written on another machine than the one that trained).
    versions = sorted({r["summary"]["torch"] for r in runs if "torch" in r["summary"]})
    lines = [
        f"# blockscale compare: `{cfg['model']}` on `{cfg['data']}`",
        "",
        f"{datetime.date.today().isoformat()}, {', '.join(devices)}, "
        + (f"torch {', '.join(versions)}. " if versions else "torch version not recorded. ")
        + f"{cfg['steps']} steps of {tokens_per_step:,} tokens (bytes), seed {cfg['seed']}: the "
        "same batches for every run of that seed. Gap to BF16: (loss - loss_bf16) / loss_bf16 "
        "of the final held-out loss. Tokens/s: each run's median training throughput. "
        + _speed_note(rows)
        + _memory_note(rows),
        "",
        _markdown_table(HEADER, [_cells(r) for r in rows]),
        "",
        *reliability_lines(rows),
        *[
            f"Noise floor: `{r['run']}` ends {r['gap_pct']:+.2f}% from `bf16` with nothing but "
            "another seed. That is one sample of the seed-to-seed spread: a recipe's gap of "
            "similar size is no evidence of a difference.\n"
            for r in rows
            if r["run"].startswith(BASELINE + "-seed") and r["gap_pct"] is not None
        ],
        plot_note,
    ]
    for caption, file in plots:
        if not file.startswith("telemetry_"):
            lines += [f"## {caption}", "", f"![{caption}]({file})", ""]
    lines += [
        "## Numerics telemetry: which layers hurt?",
        "",
        "SQNR in dB of each quantized operand against its BF16 value (higher is better; an NVFP4 "
        "operand of Gaussian values sits near 20 dB, MXFP8 near 31 dB); zero fraction: nonzero values "
        "that quantize to zero; amax: the largest magnitude seen. Lowest mean SQNR first.",
        "",
    ]
    for run in runs:
        worst = worst_operands(run)
        if not worst:
            continue
        lines += [f"### {run['name']}", ""]
        lines += [
            _markdown_table(
                ["layer", "operand", "mean SQNR dB", "min SQNR dB", "zero fraction", "max amax"],
                worst,
            ),
            "",
        ]
        lines += [f"![telemetry {run['name']}](telemetry_{run['name']}.png)", ""] if plots else []
    lines += _moe_section(runs)
    lines += ["## Runs", ""]
    for run in runs:
        differs = {k: v for k, v in _as_used(run["config"]).items() if v != cfg.get(k)}
        detail = run["summary"].get("recipe_detail", run["config"]["recipe"])
        lines += [
            f"- `{run['name']}`: {json.dumps(differs) if differs else 'the first run'}",
            "",
            "```",
            detail,
            "```",
            "",
        ]
    lines += [
        "Shared configuration (`seq_len` as used: a config's 0 is the model's own):",
        "",
        "```json",
        json.dumps(cfg, indent=2),
        "```",
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))
    (out / "report.json").write_text(json.dumps({"config": cfg, "table": rows}, indent=2) + "\n")
    return out / "report.md"


def _as_used(config: dict) -> dict:
    """A run's config with the values it ran with: `seq_len` 0 means the model's own."""
    return {**config, "seq_len": config.get("seq_len") or SIZES[config["model"]].seq_len}
