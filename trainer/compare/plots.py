"""The four plots of a comparison, from its report (trainer/compare/report.py), and tau against context length when it
measured by context length; each names budget and machine."""

from __future__ import annotations

from pathlib import Path


def _caption(report: dict) -> str:
    setup = report["setup"]
    return f"{setup['target']}, budget {setup['budget']}, seed {setup['seed']}; {report['machine']['summary']}"


def method_colors(methods: list[str]) -> dict[str, tuple[float, float, float, float]]:
    """One color per method, all different: matplotlib's tab10 for up to 10 methods, tab20 for up to 20 (its pairs of
    shades of one hue follow each other), then repeating."""
    import matplotlib

    palette = matplotlib.colormaps["tab10" if len(methods) <= 10 else "tab20"]
    return {name: palette(i % palette.N) for i, name in enumerate(methods)}


def write_plots(report: dict, out: Path) -> list[Path]:
    """tau_vs_cost.png, acceptance.png, tau_vs_tokens.png and speedup.png in ``out``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [row for row in report["rows"] if row["status"] == "done"]
    colors = method_colors([row["method"] for row in report["rows"]])
    paths = []

    def save(fig, name: str, title: str) -> None:
        fig.suptitle(f"{title}\n{_caption(report)}", fontsize=9)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in done:
        costs = [e["draft_cost_per_round"] for e in row["per_k"]]
        ax.plot(costs, [e["tau_greedy"] for e in row["per_k"]], "o-", color=colors[row["method"]], label=row["method"])
        sampled = [
            (e["draft_cost_per_round"], e["tau_sampling"]) for e in row["per_k"] if e["tau_sampling"] is not None
        ]
        if sampled:
            ax.plot(*zip(*sampled), "o--", mfc="none", color=colors[row["method"]])
        for e in row["per_k"]:
            ax.annotate(f"K={e['k']}", (e["draft_cost_per_round"], e["tau_greedy"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")  # fmt: skip
    ax.set_xlabel("drafting time of a round / one target forward (measured)")
    ax.set_ylabel("tau (filled: greedy, hollow: sampling T=1)")
    if ax.lines:
        ax.legend(fontsize=7, ncol=2)
    save(fig, "tau_vs_cost", "tau against drafting cost, one point per method and K")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in done:
        entry = row["largest_k"]
        positions = range(1, len(entry["acceptance_per_position"]) + 1)
        values = [float("nan") if a is None else a for a in entry["acceptance_per_position"]]
        ax.plot(positions, values, "o-", color=colors[row["method"]], label=f"{row['method']} (K={entry['k']})")
    ax.set_xlabel("draft position")
    ax.set_ylabel("share of rounds accepting it (greedy)")
    ax.set_ylim(0, 1)
    if ax.lines:
        ax.legend(fontsize=7, ncol=2)
    save(fig, "acceptance", "acceptance per draft position at each method's largest K")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in report["rows"]:
        curve = [p for p in (row.get("training") or {}).get("tau", []) if p[0] is not None]
        if curve:
            ax.plot([p[0] for p in curve], [p[1] for p in curve], "o-", color=colors[row["method"]],
                    label=row["method"])  # fmt: skip
    ax.set_xlabel("training tokens")
    ax.set_ylabel("tau greedy (training callback, few prompts)")
    if ax.lines:
        ax.legend(fontsize=7, ncol=2)
    save(fig, "tau_vs_tokens", "tau during training")

    fig, ax = plt.subplots(figsize=(7, 1.8 + 0.4 * max(1, len(done))))
    for i, row in enumerate(done):
        entry = row["best_k"]
        low, high = entry["measured_speedup_quartiles"]
        median = entry["measured_speedup"]
        whiskers = [[max(0.0, median - low)], [max(0.0, high - median)]]
        ax.barh(i, median, color=colors[row["method"]], xerr=whiskers, capsize=3)
        ax.plot(entry["projected_speedup"], i, "k|", markersize=14)
    ax.set_yticks(range(len(done)), [f"{row['method']} (K={row['best_k']['k']})" for row in done], fontsize=8)
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("speedup over the target alone: bar measured (median, quartiles), | projected")
    save(fig, "speedup", "measured and projected speedup at each method's best K")

    by_context = [row for row in done if row.get("by_context")]
    if by_context:  # evaluation.context_lengths: tau against the context length, the target's loss on a second axis
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for row in by_context:
            lengths = [b["context_length"] for b in row["by_context"]]
            k = max(b["k"] for b in row["by_context"])
            ax.plot(lengths, [b["tau_greedy"] for b in row["by_context"]], "o-", color=colors[row["method"]],
                    label=f"{row['method']} (K={k})")  # fmt: skip
        ax.set_xscale("log", base=2)
        ticks = sorted({b["context_length"] for row in by_context for b in row["by_context"]})
        ax.set_xticks(ticks, [str(n) for n in ticks])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("tau greedy at the largest K")
        ax.legend(fontsize=7, ncol=2)
        unchanged = [row for row in by_context if not row["target_changed"]]
        if unchanged:
            loss = ax.twinx()
            buckets = unchanged[0]["by_context"]
            loss.plot([b["context_length"] for b in buckets], [b["target_loss"] for b in buckets], "k--", lw=1)
            loss.set_ylabel("target loss (nats/token, dashed)")
        save(fig, "tau_by_context", "tau against context length, one line per method")
    return paths
