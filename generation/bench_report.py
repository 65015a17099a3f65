"""What `domino-spec bench` writes: the results JSON, a markdown report and its figures."""

import json
import math
import os

from .bench import Setting


def column_label(row: dict) -> str:
    """The setting and timing a results row was measured in: "B=4, greedy, warm"."""
    return f"{Setting.of_row(row).label()}, {row.get('timing', 'warm')}"


def _number(value: float | None, format_spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{format_spec}}{suffix}"


def markdown_table(results: list[dict]) -> str:
    """Every results row: tau, drafts per round, tokens/s, the time's prefill share, the speedups and the output
    check."""
    lines = [
        "| eval set | method | setting | tau (mean acceptance) | drafts verified per round | rounds looked up "
        "| tokens/s | prefill share | speedup (same engine) | speedup over eager generate | identical to plain |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results:
        identical = "-" if row.get("identical") is None else f"{row['identical']}/{row['prompts']}"
        prefill = row.get("prefill_seconds")
        lines.append(
            f"| {row['eval_set']} | {row['method']} | {column_label(row)} | {row['mean_acceptance_length']:.2f} | "
            f"{_number(row['drafts_per_round'], '.2f')} | {_number(row.get('looked_up_fraction'), '.0%')} | "
            f"{_number(row['tokens_per_s'], '.2f')} | {_number(prefill and prefill / row['seconds'], '.0%')} | "
            f"{_number(row['speedup'], '.2f', 'x')} | "
            f"{_number(row['speedup_over_eager'], '.2f', 'x')} | {identical} |"
        )
    return "\n".join(lines)


def speedup_matrix(results: list[dict]) -> tuple[list[tuple[str, str]], list[str], dict]:
    """The matrix of the drafting methods' rows: `(rows, columns, cells)`, rows `(eval_set, method)`, columns the
    settings and timings (`column_label`) in the order measured, `cells[(row, column)]` the results row."""
    drafting = [row for row in results if not row["method"].startswith("plain")]
    rows = list(dict.fromkeys((row["eval_set"], row["method"]) for row in drafting))
    columns = list(dict.fromkeys(column_label(row) for row in drafting))
    cells = {((row["eval_set"], row["method"]), column_label(row)): row for row in drafting}
    return rows, columns, cells


def matrix_table(results: list[dict]) -> str:
    """Each drafting method's speedup over plain decoding in the same engine and setting, and its tau, per setting."""
    rows, columns, cells = speedup_matrix(results)
    lines = ["| eval set | method | " + " | ".join(columns) + " |", "|---|---|" + "---:|" * len(columns)]
    for eval_set, method in rows:
        values = []
        for column in columns:
            row = cells.get(((eval_set, method), column))
            speedup = None if row is None else _number(row["speedup"], ".2f", "x")
            values.append("-" if row is None else f"{speedup} (tau {row['mean_acceptance_length']:.2f})")
        lines.append(f"| {eval_set} | {method} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def cost_model_table(cost_model: dict) -> str:
    """The cost model of each draft (`cost_model`): decode step, verify of k drafts, drafting round."""
    lines = ["| draft | decode step ms | verify ms, k = 0..S drafts | draft round ms |", "|---|---:|---|---:|"]
    for name, terms in cost_model.items():
        verify = ", ".join(f"{ms:.1f}" for ms in terms["verify_ms"])
        lines.append(f"| {name} | {terms['decode_ms']:.1f} | {verify} | {terms['draft_round_ms']:.1f} |")
    return "\n".join(lines)


def quality_table(quality: dict) -> str:
    """`report["quality"]` (`quality.score_report`) as markdown: plain's and the drafts' scores side by side, which
    must agree for lossless decoding. Open-ended sets (MT-Bench) have no metric and show "-"."""
    lines = ["| eval set | method | metric | score | outputs |", "|---|---|---|---|---|"]
    for eval_set, scores_by_method in quality.items():
        for method, scores in scores_by_method.items():
            score = "-" if scores["score"] is None else f"{scores['score']:.3f}"
            lines.append(f"| {eval_set} | {method} | {scores['metric'] or '-'} | {score} | {scores['count']} |")
    return "\n".join(lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_acceptance(results: list[dict], path: str) -> None:
    """Acceptance-length histogram and per-position acceptance curve per method (and setting, where several were
    measured warm), one row of panels per eval set."""
    plt = _pyplot()
    warm = [row for row in results if row.get("timing", "warm") == "warm"]
    several_settings = len({column_label(row) for row in warm}) > 1
    eval_sets = list(dict.fromkeys(row["eval_set"] for row in warm))
    figure, axes = plt.subplots(len(eval_sets), 2, figsize=(11, 3.4 * len(eval_sets)), squeeze=False)
    for row_axes, name in zip(axes, eval_sets):
        for row in (r for r in warm if r["eval_set"] == name and r["acceptance_histogram"]):
            label = f"{row['method']} ({Setting.of_row(row).label()})" if several_settings else row["method"]
            histogram = {int(k): v for k, v in row["acceptance_histogram"].items()}
            total = sum(histogram.values())
            lengths = sorted(histogram)
            row_axes[0].plot(lengths, [histogram[n] / total for n in lengths], marker="o", label=label)
            rates = [float("nan") if rate is None else rate for rate in row["position_acceptance"]]
            row_axes[1].plot(range(1, len(rates) + 1), rates, marker="o", label=label)
        row_axes[0].set(title=f"{name}: tokens committed per round", xlabel="acceptance length", ylabel="fraction")
        row_axes[1].set(title=f"{name}: k-th draft accepted", xlabel="k", ylabel="fraction of rounds", ylim=(0, 1))
        for axis in row_axes:
            axis.grid(alpha=0.3)
            axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_matrix(results: list[dict], path: str) -> None:
    """A heatmap of the drafting methods' speedups: a row per eval set and method, a column per setting and timing,
    each cell annotated with its speedup and tau; 1x (plain decoding's speed) is white, faster green, slower red."""
    plt = _pyplot()
    rows, columns, cells = speedup_matrix(results)
    speedups = [
        [cells[(row, column)]["speedup"] if (row, column) in cells else None for column in columns] for row in rows
    ]
    values = [[float("nan") if speedup is None else speedup for speedup in line] for line in speedups]
    figure, axis = plt.subplots(figsize=(2.0 + 1.6 * max(len(columns), 1), 1.2 + 0.45 * max(len(rows), 1)))
    if rows:
        finite = [value for line in values for value in line if not math.isnan(value)]
        spread = max([abs(value - 1.0) for value in finite] + [0.1])
        image = axis.imshow(values, cmap="RdYlGn", vmin=1.0 - spread, vmax=1.0 + spread, aspect="auto")
        figure.colorbar(image, ax=axis, label="speedup over plain decoding, same engine and setting")
        for i, row in enumerate(rows):
            for j, column in enumerate(columns):
                cell = cells.get((row, column))
                text = (
                    "-"
                    if cell is None or cell["speedup"] is None
                    else (f"{cell['speedup']:.2f}x\ntau {cell['mean_acceptance_length']:.2f}")
                )
                axis.text(j, i, text, ha="center", va="center", fontsize=8)
    axis.set_xticks(range(len(columns)), columns, rotation=30, ha="right", fontsize=8)
    axis.set_yticks(range(len(rows)), [f"{eval_set}: {method}" for eval_set, method in rows], fontsize=8)
    axis.set_title("Speedup (tau) per setting")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def header(report: dict) -> str:
    """The report's first paragraph: what was measured, on what."""
    config, machine, versions = report["config"], report["machine"], report["versions"]
    decoding = "Greedy" if config.get("greedy", True) else "Greedy and sampled"
    load = ", beside a low-priority CPU-bound process (--background-load)" if config.get("background_load") else ""
    repeats = config.get("repeats", 1)
    cold_repeats = config.get("cold_repeats", repeats) if config.get("cold") else repeats
    if cold_repeats != repeats:
        load += f", every batch decoded {repeats} times and every cold call run in {cold_repeats} processes per method"
    elif repeats > 1:
        load += f", every batch (and cold call) decoded {repeats} times per method, in turn"
    return (
        f"{decoding}, {config['dtype']}, max_new_tokens={config['max_new_tokens']}, prompts per set: "
        f"{config['prompts']}, {'with' if config.get('cpu_optimization') else 'without'} `optimize_for_cpu`{load}. "
        f"Machine: {machine['processor']}, {machine['cpu_threads']} threads, {machine['device']}; "
        f"torch {versions['torch']}, transformers {versions['transformers']}.\n\n"
    )


def write_results(report: dict, output_dir: str) -> dict[str, str]:
    """`bench_results.json`, `bench_results.md` (the speedup matrix first when several settings or timings were
    measured, a quality table after `bench --quality`), `bench_acceptance.png` and `bench_matrix.png` in
    `output_dir`; returns their paths."""
    os.makedirs(output_dir, exist_ok=True)
    names = ("results.json", "results.md", "acceptance.png", "matrix.png")
    paths = {name: os.path.join(output_dir, f"bench_{name}") for name in names}
    with open(paths["results.json"], "w", encoding="utf-8") as file:
        json.dump(report, file, indent=1)
    with open(paths["results.md"], "w", encoding="utf-8") as file:
        file.write(header(report))
        if len(speedup_matrix(report["results"])[1]) > 1:
            file.write(
                "Speedup over plain decoding in the same engine and setting (tau):\n\n"
                + matrix_table(report["results"])
                + "\n\nEvery row:\n\n"
            )
        file.write(markdown_table(report["results"]) + "\n")
        if report.get("cost_model"):
            file.write(
                "\nCost model of batch-1 greedy rounds, measured in the same run:\n\n"
                + cost_model_table(report["cost_model"])
                + "\n"
            )
        if report.get("quality"):  # `bench --quality`
            file.write("\nQuality of the decoded outputs:\n\n" + quality_table(report["quality"]) + "\n")
    plot_acceptance(report["results"], paths["acceptance.png"])
    plot_matrix(report["results"], paths["matrix.png"])
    return paths
