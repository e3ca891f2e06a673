"""The report of ``draftsmith compare``: ``report.json``, ``report.md`` and four plots, from the method folders.

Rows come from what each method's stages left (trainer/compare/run.py): ``fit.json``, ``footprint.json`` and
``eval/report.json`` (``draftsmith eval``'s own report), or ``failed.json``; with ``evaluation.context_lengths`` also
``eval_context/report.json`` (its ``by_context``: the "By context length" table and tau_by_context.png; a method
whose evaluation by context length failed keeps its other figures and shows "-" with the reason there). Every figure
names the budget and the machine it was measured under.
"""

from __future__ import annotations

import json
import os
import platform
from itertools import combinations
from pathlib import Path

from trainer.compare.config import CompareConfig, Method
from trainer.compare.fit_logs import tokens_at
from trainer.decoding.drift import heldout_text
from trainer.interface.errors import PathError

METRICS = {
    "tau_greedy": "tau greedy at the largest K",
    "tau_sampling": "tau sampling at the largest K",
    "measured_speedup": "measured speedup at the best K",
}


def describe_machine(words: str) -> dict:
    """The machine a comparison ran on: the recipe's words, the CPU, its cores, the GPUs and torch."""
    import torch

    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line]
        cpu = names[0] if names else cpu
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    summary = f"{len(gpus)} x {gpus[0]}" if gpus else f"{cores}-core CPU ({cpu}), no GPU"
    return {"words": words, "summary": summary, "cpu": cpu, "cores": cores, "gpus": gpus, "torch": torch.__version__}


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def method_row(config: CompareConfig, method: Method, root: Path) -> dict:
    """One method's row: what it is, what training it got, and its measurements at every K."""
    fit, footprint = _read(root / "fit.json"), _read(root / "footprint.json")
    seconds = _read(root / "stage_seconds.json") or {}
    report, failed = _read(root / "eval" / "report.json"), _read(root / "failed.json")
    context_failed = failed if failed and failed.get("stage") == "eval_context" else None
    failed = None if context_failed else failed  # the other figures stand
    row: dict = {
        "method": method.name,
        "status": "failed" if failed else "done" if report else "not run",
        "failure": failed,
        "target_changed": method.eval_target != "{target}",
        "budget": config.budget_of(method).describe() if method.trains else "no training",
        "stage_seconds": seconds,
    }
    if footprint:
        row.update(
            kind=footprint["kind"],
            parameters=footprint["parameters"],
            extra_parameters=footprint["extra_parameters"],
            extra_mib=footprint["extra_bytes"] / 2**20,
            formats=footprint["formats"],
            export_format=method.export_format or (footprint["formats"][0] if footprint["formats"] else None),
        )
    if fit:
        scalars = {tag: dict((int(s), v) for s, v in values) for tag, values in fit["scalars"].items()}
        tokens = scalars.get("train/tokens", {})
        curve = [
            [tokens_at(tokens, step), tau, scalars.get("spec_eval/tau_sampling", {}).get(step)]
            for step, tau in sorted(scalars.get("spec_eval/tau", {}).items())
        ]
        row["loss"] = fit.get("loss")
        row["training"] = {"steps": fit["steps"], "tokens": fit["tokens"], "seconds": seconds.get("fit"), "tau": curve}
    if report:
        sampling = {entry["k"]: entry for entry in report["sampling"]}
        row["loop_share"] = report["loops"]["share"]
        drift = report.get("original_target")
        if drift:  # a changed target beside the recipe's target, the model it was fine-tuned from
            row["heldout_loss"] = drift["target"]["heldout_loss"]
            row["original_heldout_loss"] = drift["original"]["heldout_loss"]
            row["original_loop_share"] = drift["original"]["loop_share"]
        row["per_k"] = [
            {
                "k": g["k"],
                "tau_greedy": g["tau"],
                "tau_sampling": sampling[g["k"]]["tau"] if g["k"] in sampling else None,
                "tau_in_loops": g["tau_in_loops"],
                "tau_outside_loops": g["tau_outside_loops"],
                "acceptance_per_position": g["acceptance_per_position"],
                "acceptance_per_position_sampling": sampling[g["k"]]["acceptance_per_position"]
                if g["k"] in sampling
                else None,
                "draft_cost": g["draft_cost"],
                "draft_cost_per_round": g["draft_cost_per_round"],
                "measured_speedup": g["measured_speedup"],
                "measured_speedup_quartiles": g["measured_speedup_quartiles"],
                "projected_speedup": g["projected_speedup"],
            }
            for g in report["greedy"]
        ]
        row["largest_k"] = max(row["per_k"], key=lambda e: e["k"])
        row["best_k"] = max(row["per_k"], key=lambda e: e["measured_speedup"])
    if config.evaluation.context_lengths:
        row.update(context_row(_read(root / "eval_context" / "report.json"), context_failed))
    return row


def failure_reason(failure: dict) -> str:
    """``failed at STAGE: ERROR``, the error being the stage log's last ``error:`` line when there is one."""
    errors = [line for line in (failure.get("tail") or "").splitlines() if line.startswith("error: ")]
    return f"failed at {failure.get('stage')}: {errors[-1][len('error: ') :] if errors else failure.get('error')}"


def context_row(report: dict | None, failure: dict | None) -> dict:
    """A method's figures by context length from its ``eval_context/report.json``: per length (ascending) the prompts,
    tau greedy and sampling and acceptance per position at the largest K, the loop share and the loss of the target
    it was verified against; ``context_kept``: tau at the longest length over tau at the shortest. Without a report:
    the reason."""
    if report is None:
        return {"context_missing": failure_reason(failure) if failure else "not run"}
    rows = []
    for bucket in sorted(report["by_context"], key=lambda b: b["context_length"]):
        greedy = max(bucket["greedy"], key=lambda e: e["k"])
        sampling = {e["k"]: e for e in bucket["sampling"]}.get(greedy["k"])
        rows.append(
            {
                "context_length": bucket["context_length"],
                "prompts": bucket["prompts"],
                "k": greedy["k"],
                "tau_greedy": greedy["tau"],
                "tau_sampling": sampling["tau"] if sampling else None,
                "acceptance_per_position": greedy["acceptance_per_position"],
                "loop_share": bucket["loops"]["share"],
                "target_loss": bucket["target_loss"],
            }
        )
    kept = rows[-1]["tau_greedy"] / rows[0]["tau_greedy"] if rows and rows[0]["tau_greedy"] else None
    return {"by_context": rows, "context_kept": kept}


def metric(row: dict, name: str) -> float | None:
    """The value a method is ranked by for :data:`METRICS` ``name`` (None when it was not measured)."""
    if row.get("status") != "done":
        return None
    entry = row["best_k"] if name == "measured_speedup" else row["largest_k"]
    return entry[name]


def ordering_flips(rows: list[dict], other: list[dict]) -> dict:
    """For every metric, the pairs of methods measured in both runs whose order differs between them (a tie in
    either run is no flip)."""
    theirs = {row["method"]: row for row in other}
    out = {}
    for name in METRICS:
        values = {}
        for row in rows:
            a, b = metric(row, name), metric(theirs.get(row["method"], {}), name)
            if a is not None and b is not None:
                values[row["method"]] = (a, b)
        flipped = [
            [x, y]
            for x, y in combinations(values, 2)
            if (values[x][0] - values[y][0]) * (values[x][1] - values[y][1]) < 0
        ]
        pairs = len(values) * (len(values) - 1) // 2
        out[name] = {"pairs": pairs, "flips": len(flipped), "flipped": flipped}
    return out


def _fmt(value, spec: str = ".2f", missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _beside(row: dict, key: str, spec: str) -> str:
    """A changed target's figure after its original's (``original -> changed``), else the figure alone."""
    original = row.get(f"original_{key}")
    if original is None:
        return _fmt(row.get(key), spec)
    return f"{_fmt(original, spec)} -> {_fmt(row.get(key), spec)}"


def render_markdown(report: dict) -> str:
    """The report's tables, with the budget and the machine named above them."""
    setup, machine = report["setup"], report["machine"]
    words = f"; {machine['words']}" if machine["words"] else ""
    lines = [
        f"# draftsmith compare: {setup['target']}",
        "",
        f"Machine: {machine['summary']}{words}. Budget: {setup['budget']} per method unless its row says "
        f"otherwise; seed {setup['seed']}. Evaluation: "
        f"{setup['prompts']} held-out prompts, {setup['max_new_tokens']} new tokens each, greedy and sampling at "
        f"T = {setup['temperature']}, speedups side by side ({setup['repeats']} pass(es)). Compare wall time "
        f"{report['seconds']:.0f} s. Loop share: of the greedy output of the target each method is verified against; "
        "for a changed target `original -> changed`, with its held-out loss (nats per token, on "
        f"{heldout_text(setup.get('heldout'), setup.get('heldout_tokens') or 0)}) the same way.",
        "",
        "| method | kind | parameters | extra serving MiB | training | loss | tokens | time (s) | loop share | "
        "target changed | held-out loss | export formats |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        training = row.get("training") or {}
        formats = ", ".join(f"**{f}**" if f == row.get("export_format") else f for f in row.get("formats", []))
        lines.append(
            f"| {row['method']} | {row.get('kind', '-')} | {_fmt(row.get('parameters'), ',')} | "
            f"{_fmt(row.get('extra_mib'), '.2f')} | {row['budget']} | {row.get('loss') or '-'} | "
            f"{_fmt(training.get('tokens'), ',.0f')} | "
            f"{_fmt(training.get('seconds'), '.0f')} | {_beside(row, 'loop_share', '.0%')} | "
            f"{'yes' if row['target_changed'] else 'no'} | {_beside(row, 'heldout_loss', '.3f')} | {formats or '-'} |"
        )
    lines += [
        "",
        "| method | K | tau greedy | tau sampling | tau in loops | tau outside loops | acceptance per position "
        "(greedy) | draft cost c per token / per round | measured speedup (quartiles) | projected speedup |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        if row["status"] != "done":
            failure = row.get("failure") or {}
            reason = f"failed at {failure.get('stage')}: {failure.get('error')}" if failure else row["status"]
            lines.append(f"| {row['method']} | {reason} | | | | | | | | |")
            continue
        for e in row["per_k"]:
            acceptance = ", ".join(_fmt(a) for a in e["acceptance_per_position"])
            cost = f"{e['draft_cost']:.3f} / {e['draft_cost_per_round']:.2f}"
            low, high = e["measured_speedup_quartiles"]
            lines.append(
                f"| {row['method']} | {e['k']} | {e['tau_greedy']:.2f} | {_fmt(e['tau_sampling'])} | "
                f"{_fmt(e['tau_in_loops'])} | {_fmt(e['tau_outside_loops'])} | {acceptance} | {cost} | "
                f"{e['measured_speedup']:.2f}x ({low:.2f}-{high:.2f}) | {e['projected_speedup']:.2f}x |"
            )
    if setup.get("context_lengths"):
        lines += context_table(report)
    if report.get("stability"):
        lines += ["", f"Seed stability against {report['stability']['other']}:", ""]
        for name, flips in report["stability"]["flips"].items():
            pairs = "; ".join(" vs ".join(p) for p in flips["flipped"]) or "none"
            lines.append(f"- {METRICS[name]}: {flips['flips']} of {flips['pairs']} pairwise orderings flip ({pairs})")
    plots = [*PLOTS, *(["tau_by_context"] if any(row.get("by_context") for row in report["rows"]) else [])]
    lines += ["", *[f"![{name}]({name}.png)" for name in plots]]
    return "\n".join(lines) + "\n"


def context_table(report: dict) -> list[str]:
    """The "By context length" section: one row per method (tau greedy at its largest K at each length, and kept:
    the longest length's over the shortest's), the loss of the recipe's target once, and a changed target's own."""
    setup = report["setup"]
    lengths = sorted(setup["context_lengths"])
    lines = [
        "",
        "## By context length",
        "",
        f"tau greedy at each method's largest K on prompts cut from {setup['context_documents']}: the first L tokens "
        f"of each document at least L + {setup['max_new_tokens']} tokens long, up to {setup['context_prompts']} per "
        "length (eval's `--context_lengths`). kept: tau at the longest length over tau at the shortest. "
        "target loss: the target's own next-token loss on those prompts (nats per token).",
        "",
        "| method | K | " + " | ".join(str(n) for n in lengths) + " | kept |",
        "|---|---|" + "---|" * len(lengths) + "---|",
    ]

    def cells(row: dict, key: str, spec: str) -> str:
        values = {b["context_length"]: b[key] for b in row["by_context"]}
        return " | ".join(_fmt(values.get(n), spec) for n in lengths)

    unchanged = [r for r in report["rows"] if r.get("by_context") and not r["target_changed"]]
    if unchanged:
        lines.append(f"| target loss | | {cells(unchanged[0], 'target_loss', '.3f')} | |")
    for row in report["rows"]:
        if row["status"] != "done" or not row.get("by_context"):
            failure = row.get("failure") or {}
            reason = failure_reason(failure) if failure else row.get("context_missing") or row["status"]
            lines.append(f"| {row['method']} | - | " + " | ".join("-" for _ in lengths) + f" | - ({reason}) |")
            continue
        k = max(b["k"] for b in row["by_context"])
        lines.append(
            f"| {row['method']} | {k} | {cells(row, 'tau_greedy', '.2f')} | {_fmt(row['context_kept'], '.2f')} |"
        )
        if row["target_changed"]:
            lines.append(f"| target loss ({row['method']}'s changed target) | | {cells(row, 'target_loss', '.3f')} | |")
    return lines


def write_report(config: CompareConfig, out: Path, stability: Path | None = None) -> list[Path]:
    """``report.json``, ``report.md`` and the plots of the comparison in ``out``; returns the paths written."""
    rows = [method_row(config, m, out / "methods" / m.name) for m in config.methods]
    seconds = _read(out / "compare_seconds.json") or []
    evaluation = config.evaluation
    report = {
        "setup": {
            "target": config.target,
            "budget": config.budget.describe(),
            "seed": config.seed,
            "prompts": evaluation.max_prompts,
            "max_new_tokens": evaluation.max_new_tokens,
            "temperature": evaluation.temperature,
            "repeats": evaluation.repeats,
            "heldout": evaluation.heldout,
            "heldout_tokens": evaluation.heldout_tokens,
            "context_lengths": evaluation.context_lengths,
            "context_documents": evaluation.documents if evaluation.context_lengths else None,
            "context_prompts": evaluation.context_prompts,
        },
        "machine": describe_machine(config.machine),
        "seconds": sum(seconds),
        "rows": rows,
    }
    if stability is not None:
        other = _read(stability / "report.json")
        if other is None:
            raise PathError(f"--stability {stability}: no report.json there (run that comparison first)")
        report["stability"] = {"other": str(stability), "flips": ordering_flips(rows, other["rows"])}
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "report.json", out / "report.md"]
    paths[0].write_text(json.dumps(report, indent=2) + "\n")
    paths[1].write_text(render_markdown(report))
    from trainer.compare.plots import write_plots

    return paths + write_plots(report, out)


PLOTS = ("tau_vs_cost", "acceptance", "tau_vs_tokens", "speedup")
