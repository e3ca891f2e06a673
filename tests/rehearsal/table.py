"""``python -m tests.rehearsal.table OUT.md [COMMAND]``: the memory table of the rehearsal results
(tests/rehearsal/cases.py writes one JSON per case) as a markdown page, with
the date, commit, machine and the command that produced it."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.rehearsal.cases import CASES, REPO, SEQ_LEN, STEPS, results_dir

INTRO = " ".join(
    """Every real-model recipe run through the real CLI on its target's real shapes: the published config.json
(tests/fixtures/real_configs/) with the layer count cut, random weights, the real tokenizer size and special token ids
(tests/real_shapes.py). Per recipe: `draftsmith fit` with the recipe's objective, data settings, loss chunking,
vocabulary and strategy on one CPU process, {steps} optimizer steps of one {seq}-token chat sequence, in the recipe's
precision (bf16-mixed, the target frozen in bf16) on a CPU that computes bf16 natively and in float32 throughout
elsewhere (the precision column: without bf16 instructions PyTorch's bf16 matrix products take a slow path for some
layouts, the backward of one 4,096 x 14,336 linear layer over 128 tokens taking 88 s against 1 s in float32, and a
real-width fit of two steps did not finish in an hour), or in `bf16-true` (weights, gradients and AdamW's moments in
bf16) where a case does not fit this machine in float32 (named in its changes); `draftsmith export` in every format
the method writes, each read
back by its loader and compared with the checkpoint's weights; `draftsmith eval` on two prompts (greedy output
identical to the target's, which eval checks, but where the target's own top two logits tie to its dtype's rounding,
which eval reports: docs/guides/evaluation.md); `draftsmith plan` on the same recipe and overrides, with the cut
target's config (`--target`) and one GPU. Peak RSS: the fit process's maximum resident set (wait4).
Cases and overrides: tests/rehearsal/cases.py.""".split()
)


def machine() -> str:
    """This machine in words: its cores and whether it computes bf16 natively (what the precision column follows)."""
    from trainer.models.target import cpu_has_native_bf16

    bf16 = "native bf16 instructions" if cpu_has_native_bf16() else "no native bf16 instructions"
    return f"{os.cpu_count()}-core CPU, no GPU, {bf16}"


def _eval_status(result: dict) -> str:
    """The eval column: greedy identical, with the prompts that parted on a near-tie of the target's logits and
    their gaps, or the refusal a case expects (``Case.eval_refused``)."""
    if result.get("eval_refused"):
        return "refused by name, as expected: " + result["eval_refused"].replace("|", "/")
    ties = result.get("eval_near_ties") or []
    if not ties:
        return "greedy identical"
    gaps = ", ".join(f"{t['ulps']:g}" for t in ties)
    many = f"{len(ties)} near-ties" if len(ties) > 1 else "a near-tie"
    dtype = "float32" if result.get("precision") == "fp32" else "bf16"
    return f"greedy identical up to {many} of the target's logits ({gaps} {dtype} ulps apart; reported by eval)"


def _ratio(plan: float | None, measured: float | None) -> str:
    return f"{plan / measured:.2f}" if plan and measured else "-"


def _cpu(result: dict) -> float:
    steps = [result.get("fit"), result.get("readback"), result.get("eval")]
    steps += [e for e in result.get("export_steps", [])]
    return sum(s["cpu_s"] for s in steps if s)


def _params(result: dict) -> str:
    value = result.get("target_params_b")
    return f", {value:.2f} B" if isinstance(value, float) else ""


def _failed(result: dict) -> str:
    for step in ("fit", "readback", "eval"):
        if result.get(step) and result[step]["rc"] != 0:
            return f"{step} failed (exit {result[step]['rc']})"
    return "not reached"


def _precision(result: dict) -> str:
    precision = result.get("precision", "recipe")
    return {"fp32": "float32", "recipe": "bf16-mixed"}.get(precision, precision)


def _planner(plan: dict | None) -> str:
    if not plan:
        return "not run"
    if plan.get("estimate_gib") is not None:
        return f"{plan['estimate_gib']:.2f}"
    lines = (plan.get("stderr") or plan.get("stdout") or "").strip().splitlines()
    why = lines[-1] if lines else f"exit {plan.get('rc')}"
    return "refused: " + why.replace("|", "/")[:160]


def render(results: list[dict], command: str) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    rows = [
        "| recipe | cut target | strategy | precision | changed for this machine | fit CPU s | peak RSS GiB | "
        "planner GiB | planner / measured | exports read back | eval | case CPU s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        fit = r.get("fit") or {}
        plan = r.get("plan") or {}
        measured = fit.get("peak_rss_gib")
        status = _eval_status(r) if r.get("ok") else _failed(r)
        status += f" ({r['note']})" if r.get("note") else ""
        exports = ", ".join(r.get("exports", [])) or "-"
        for fmt, why in (r.get("refused_exports") or {}).items():
            exports += f"; {fmt} refused: {why.replace('|', '/')}"
        rows.append(
            f"| `{r['recipe']}` | {r['model']}, {r['layers']} layers{_params(r)} | "
            f"{(r.get('strategy') or 'recipe').removesuffix('.yaml')} | {_precision(r)} | {r.get('changes') or '-'} | "
            f"{fit.get('cpu_s', '-')} | {measured if measured is not None else '-'} | {_planner(plan)} | "
            f"{_ratio(plan.get('estimate_gib'), measured)} | {exports} | {status} | {_cpu(r):.0f} |"
        )
    missing = [c.name for c in CASES if c.name not in {r["case"] for r in results}]
    return (
        "\n".join(
            [
                "# Real-shape rehearsal on CPU",
                "",
                INTRO.format(steps=STEPS, seq=SEQ_LEN),
                "",
                f"Date {date}, commit {commit.stdout.strip()}, machine: {machine()}.",
                f"Command: `{command}`",
                "",
                *rows,
                "",
                *([f"Not run in this table: {', '.join(missing)}."] if missing else []),
            ]
        )
        + "\n"
    )


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    command = argv[1] if len(argv) > 1 else "make rehearse"
    order = {c.name: i for i, c in enumerate(CASES)}
    results = [json.loads(p.read_text()) for p in sorted(results_dir().glob("*.json"))]
    results.sort(key=lambda r: order.get(r["case"], len(order)))
    out.write_text(render(results, command))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
