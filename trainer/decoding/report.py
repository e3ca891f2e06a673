"""Writers for the ``draftsmith eval`` report: report.json, report.md and acceptance.png (and, when it measured by
context length, acceptance_by_context.png)."""

from __future__ import annotations

import json
import math
from pathlib import Path


def _clean(value):
    """JSON-safe copy: NaN and infinities become ``None``."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def _fmt(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def markdown(report: dict) -> str:
    """The human-readable report."""
    loops = report["loops"]
    lines = [
        "# Speculative decoding evaluation",
        "",
        f"- target: `{report.get('target', '?')}`; drafter: `{report.get('drafter', '?')}`",
        f"- prompts: {report.get('prompts', '?')}; max new tokens: {report.get('max_new_tokens', '?')}",
        f"- target alone (greedy): {report['baseline']['target_forwards']} forwards for "
        f"{report['baseline']['tokens']} tokens, {_fmt(report['baseline']['forward_seconds'] * 1e3, 2)} ms per forward",
        f"- loops: {_fmt(100 * loops['share'], 1)}% of the target's greedy output sits in a {loops['window']}-token "
        f"window repeating with a period <= {loops['max_period']} ({loops['looped_prompts']} prompts touched); "
        "any drafter that follows a loop scores well there, so tau is also given inside and outside loops",
        f"- best K by measured greedy speedup: **{report['best_k']}**"
        + (f" (threshold {report.get('best_accept_threshold', 0.0):g})" if _dynamic(report) else ""),
        *_drift_lines(report.get("original_target")),
        "",
        "tau: mean tokens committed per forward of the target, the bonus token counted (the first forward, also the",
        "prefill, verifies drafts made after the prompt). c: one draft's measured cost relative to a target decoding",
        "forward. Projected: Leviathan's (1 - a^(K+1)) / ((1 - a)(cK + 1)) with a the measured acceptance",
        "rate. Measured: the median over prompts (and passes) of the wall-clock time of the target alone over the time",
        "with speculation, the two run one right after the other for each prompt, the order alternating; in brackets",
        "the quartiles of those ratios.",
        "",
        "## Greedy (output identical to the target's, checked token for token)",
        "",
        "| K | tau | tau in loops | tau off loops | acceptance | target forwards (alone) | c | projected | measured |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in report["greedy"]:
        lines.append(
            f"| {e['k']}{_threshold_label(e)} | {_fmt(e['tau'])} | {_fmt(e['tau_in_loops'])} "
            f"| {_fmt(e['tau_outside_loops'])} "
            f"| {_fmt(e['acceptance_rate'])} | {e['target_forwards']} ({e['baseline_target_forwards']}) "
            f"| {_fmt(e['draft_cost'])} | {_fmt(e['projected_speedup'], 2)}x | {_measured(e)} |"
        )
    if report["sampling"]:
        lines += [
            "",
            f"## Speculative sampling (temperature {report['temperature']})",
            "",
            "| K | tau | acceptance | target forwards (alone) | c | projected | measured |",
            "|---|---|---|---|---|---|---|",
        ]
        for e in report["sampling"]:
            lines.append(
                f"| {e['k']}{_threshold_label(e)} | {_fmt(e['tau'])} | {_fmt(e['acceptance_rate'])} "
                f"| {e['target_forwards']} ({e['baseline_target_forwards']}) | {_fmt(e['draft_cost'])} "
                f"| {_fmt(e['projected_speedup'], 2)}x | {_measured(e)} |"
            )
    lines += _near_tie_lines(report)
    lines += _threshold_section(report)
    lines += _context_section(report)
    lines += ["", "## Acceptance per draft position (greedy)", ""]
    for e in report["greedy"]:
        rates = ", ".join(_fmt(a, 2) for a in e["acceptance_per_position"])
        lines.append(f"- K={e['k']}{_threshold_label(e)}: {rates}")
    return "\n".join(lines) + "\n"


def _dynamic(report: dict) -> bool:
    """Whether the report measured dynamic draft length (a threshold other than 0)."""
    return any(t > 0 for t in report.get("accept_thresholds", [0.0]))


def _threshold_label(entry: dict) -> str:
    threshold = entry.get("accept_threshold", 0.0)
    return f", threshold {threshold:g}" if threshold else ""


def _near_tie_lines(report: dict) -> list[str]:
    """The prompts whose greedy outputs parted on a near-tie of the target's logits (trainer/decoding/identity.py)."""
    ties = [(e["k"], t) for e in report["greedy"] for t in e.get("near_ties", [])]
    if not ties:
        return []
    lines = ["", "Outputs that parted on a near-tie of the target's logits (rounding, not a draft: the two tokens",
             "were the target's top two, this many units in the last place of its dtype apart; from there each",
             "output is the engine's own greedy output):", ""]  # fmt: skip
    for k, t in ties:
        lines.append(
            f"- K={k}, prompt {t['prompt']}, position {t['position']}: tokens {t['target_token']} (target alone) and "
            f"{t['speculative_token']} (speculative), {t['ulps']:g} ulps"
        )
    return lines


def _threshold_section(report: dict) -> list[str]:
    """Dynamic draft length side by side: per mode and K, one row per threshold (0: fixed length K)."""
    if not _dynamic(report):
        return []
    lines = [
        "",
        "## Draft length by predicted acceptance",
        "",
        "Threshold: a path of drafts is verified only while the drafter's predicted chance of its acceptance (the",
        "product of its drafts' probabilities) stays at or above it; 0 is the fixed draft length K. Drafts per round:",
        "the mean number of draft tokens one target forward verified. Drafting cost per round: the proposer's time per",
        "round over a target decoding forward. The projected speedup assumes K drafts every round, so it is left out.",
    ]
    for mode in ("greedy", "sampling"):
        entries = sorted(report[mode], key=lambda e: (e["k"], e.get("accept_threshold", 0.0)))
        if not entries:
            continue
        lines += [
            "",
            f"### {mode.capitalize()}" + (f" (temperature {report['temperature']})" if mode == "sampling" else ""),
            "",
            "| K | threshold | tau | drafts per round | drafting cost per round | acceptance | measured |",
            "|---|---|---|---|---|---|---|",
        ]
        for e in entries:
            lines.append(
                f"| {e['k']} | {e.get('accept_threshold', 0.0):g} | {_fmt(e['tau'])} "
                f"| {_fmt(e['drafts_per_round'], 2)} "
                f"| {_fmt(e['draft_cost_per_round'])} | {_fmt(e['acceptance_rate'])} | {_measured(e)} |"
            )
    return lines


def _context_section(report: dict) -> list[str]:
    """By context length (``by_context``): per length, mode and K, tau, acceptance per draft position and the target's
    own loss on the prompts."""
    buckets = report.get("by_context")
    if not buckets:
        return []
    lines = [
        "",
        "## By context length",
        "",
        "Prompts: the first L tokens of every document at least L + max new tokens long (per length, the",
        "documents long enough). Target loss: the target's own mean next-token cross entropy over those prompts'",
        "tokens (nats per token), so a drop of tau that the target's loss shares is the target's, not the drafter's.",
        "Loops: the share of the target's greedy output in loops at that length. All lengths were decoded in one",
        "run, greedy output checked against the target's at each.",
    ]
    for mode in ("greedy", "sampling"):
        if not any(b[mode] for b in buckets):
            continue
        lines += [
            "",
            f"### {mode.capitalize()}" + (f" (temperature {report['temperature']})" if mode == "sampling" else ""),
            "",
            "| context (tokens) | prompts | target loss | loops | K | tau | tau off loops | acceptance per position "
            "| measured |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for b in buckets:
            for e in b[mode]:
                rates = ", ".join(_fmt(a, 2) for a in e["acceptance_per_position"])
                lines.append(
                    f"| {b['context_length']} | {b['prompts']} | {_fmt(b.get('target_loss'))} "
                    f"| {_fmt(100 * b['loops']['share'], 1)}% "
                    f"| {e['k']}{_threshold_label(e)} | {_fmt(e['tau'])} | {_fmt(e.get('tau_outside_loops'))} "
                    f"| {rates} | {_measured(e)} |"
                )
    return lines


def _drift_lines(drift: dict | None) -> list[str]:
    """The changed target beside the model it was fine-tuned from (``--original_target``), when given."""
    if not drift:
        return []
    new, old = drift["target"], drift["original"]
    return [
        f"- changed target against its original `{drift.get('original_path')}`: held-out loss on "
        f"{drift.get('heldout', 'the prompts')} {_fmt(new['heldout_loss'])} nats per token (original "
        f"{_fmt(old['heldout_loss'])}, {drift['tokens']} tokens); "
        f"loop share of the greedy output {_fmt(100 * new['loop_share'], 1)}% (original "
        f"{_fmt(100 * old['loop_share'], 1)}%)"
    ]


def _measured(entry: dict) -> str:
    low, high = entry["measured_speedup_quartiles"]
    return f"{_fmt(entry['measured_speedup'], 2)}x ({_fmt(low, 2)}-{_fmt(high, 2)})"


def plot(report: dict, path: Path) -> None:
    """Acceptance per draft position (one line per K and mode) and tau per K."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, style in (("greedy", "-o"), ("sampling", "--s")):
        for e in report[mode]:
            positions = list(range(1, len(e["acceptance_per_position"]) + 1))
            left.plot(positions, e["acceptance_per_position"], style, label=f"{mode} K={e['k']}{_threshold_label(e)}")
        for threshold in report.get("accept_thresholds", [0.0]):
            entries = [e for e in report[mode] if e.get("accept_threshold", 0.0) == threshold]
            if entries:
                label = mode + (f" threshold {threshold:g}" if _dynamic(report) else "")
                right.plot([e["k"] for e in entries], [e["tau"] for e in entries], style, label=label)
    left.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.05), title="Acceptance per draft position")
    left.legend(fontsize=7)
    left.xaxis.set_major_locator(MaxNLocator(integer=True))
    right.xaxis.set_major_locator(MaxNLocator(integer=True))
    ks = sorted({e["k"] for e in report["greedy"]})
    right.plot(ks, [k + 1 for k in ks], ":", color="gray", label="K + 1 (all accepted)")
    right.set(xlabel="K", ylabel="tau (tokens per target forward)", title="tau per K")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_by_context(report: dict, path: Path) -> None:
    """By context length: acceptance per draft position (one line per length, K and mode) and tau per length (one
    line per K and mode), the target's own loss per length on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    buckets = report["by_context"]
    lengths = [b["context_length"] for b in buckets]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, style in (("greedy", "-o"), ("sampling", "--s")):
        for b in buckets:
            for e in b[mode]:
                positions = list(range(1, len(e["acceptance_per_position"]) + 1))
                label = f"{mode} L={b['context_length']} K={e['k']}{_threshold_label(e)}"
                left.plot(positions, e["acceptance_per_position"], style, label=label)
        for i, first in enumerate(buckets[0][mode]):  # entries line up across buckets: same thresholds and Ks
            taus = [b[mode][i]["tau"] for b in buckets]
            right.plot(lengths, taus, style, label=f"{mode} K={first['k']}{_threshold_label(first)}")
    left.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.05), title="Acceptance per draft position")
    left.legend(fontsize=7)
    left.xaxis.set_major_locator(MaxNLocator(integer=True))
    right.set_xscale("log", base=2)
    right.set_xticks(lengths, [str(n) for n in lengths])
    right.set(xlabel="context length (prompt tokens)", ylabel="tau (tokens per target forward)", title="tau by context")
    losses = [b.get("target_loss") for b in buckets]
    if all(isinstance(x, float) and math.isfinite(x) for x in losses):
        twin = right.twinx()
        twin.plot(lengths, losses, ":^", color="gray", label="target loss")
        twin.set_ylabel("target loss (nats per token)")
        twin.legend(fontsize=7, loc="lower right")
    right.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(report: dict, out_dir: str | Path) -> list[Path]:
    """Write report.json, report.md and acceptance.png into ``out_dir`` (created), and acceptance_by_context.png
    when the report has ``by_context``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "report.json", out / "report.md", out / "acceptance.png"]
    paths[0].write_text(json.dumps(_clean(report), indent=2) + "\n", encoding="utf-8")
    paths[1].write_text(markdown(report), encoding="utf-8")
    plot(report, paths[2])
    if report.get("by_context"):
        paths.append(out / "acceptance_by_context.png")
        plot_by_context(report, paths[3])
    return paths
