"""What ``pdserve plan`` prints and saves once its searches are done: the recommendation, each
family's best against it, the flags that run it, and every candidate's points."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pdserve.bench.metrics import Slo
from pdserve.flags import save_result
from pdserve.planning.plan_candidates import CHUNKED, CONDITIONAL, PRIORITY, SPLIT, Row, rank


def report(args: argparse.Namespace, rows: list[Row], skipped: list[str]) -> None:
    """Print the summary of ``rows`` (at least one), save it with ``--save-result``, and end
    with its JSON line (the candidates left out of it)."""
    rows.sort(key=rank, reverse=True)
    # Every family is deployable (prefill-priority with --colocated-schedule); ties keep the
    # earlier family in the search order: chunked colocation first.
    best_per_gpu, rec, rec_result = rows[0]

    def family_best(name: str) -> Row | None:
        return max((r for r in rows if r[1].family == name), key=rank, default=None)

    pure_coloc = [r for r in rows if r[1].colocated and not r[1].conditional]
    coloc = max(pure_coloc, key=rank, default=None)
    chunked, priority, split = family_best(CHUNKED), family_best(PRIORITY), family_best(SPLIT)
    conditional = family_best(CONDITIONAL)
    # one degree everywhere: what a search without per-pool parallelism would have found
    equal_tp = max((r for r in rows if r[1].equal_tp), key=rank, default=None)
    prefill_tp = rec.decode_tp if rec.colocated else rec.prefill_tp
    print(f"\nrecommended: {rec.label}: {best_per_gpu:.3f} req/s per GPU")
    summary: dict[str, Any] = {
        "gpus": args.gpus,
        "goodput_slo": " ".join(args.goodput),
        "recommended": rec.label,
        "recommended_per_gpu": round(best_per_gpu, 3),
        "recommended_gpus": rec.gpus,
        "recommended_prefill_tp": prefill_tp,
        "recommended_decode_tp": rec.decode_tp,
        "not_measured": skipped,  # past --time-budget
    }
    if skipped:
        print(f"  not measured (time budget): {', '.join(skipped)}")
    # The bound of the workload the recommendation was measured on (its highest passing point).
    passing = [p for p in rec_result["points"] if p["rate"] <= rec_result["goodput_rate"]]
    if passing:
        wb = float(max(passing, key=lambda p: p["rate"])["work_bound_per_gpu"])
        summary["work_bound_per_gpu"] = round(wb, 3)
        print(f"  {best_per_gpu / wb:.2f}x the work bound ({wb:.3f} per GPU, what no layout sustains unshed)")
        if best_per_gpu > 1.05 * wb and getattr(args, "admission", "none") == "none":  # shedding may pass it
            summary["transient"] = True
            print(
                "  warning: above the work bound, so these goodputs are a transient (the arrivals end before "
                "the backlog they build is felt); give each point more arrivals (--duration SECONDS)",
                flush=True,
            )
    if rows_tp := any(r[1].prefill_tp > 1 or r[1].decode_tp > 1 for r in rows):
        held = f"{rec.gpus} GPUs held"
        print(f"  tensor parallelism: prefill tp {prefill_tp}, decode tp {rec.decode_tp} ({held})")
    for name, row in (
        ("best with equal TP everywhere", equal_tp if rows_tp else None),
        ("best colocated", coloc),
        ("best chunked colocated", chunked),
        ("prefill-priority colocated", priority),
        ("best static split", split),
        ("best conditional", conditional),
    ):
        if row is None:
            continue
        ratio = best_per_gpu / row[0] if row[0] else float("inf")
        print(f"  {ratio:.2f}x {name} ({row[1].label}: {row[0]:.3f} per GPU)")
    for key, row in (
        ("best_chunked", chunked),
        ("best_prefill_priority", priority),
        ("best_split", split),
        ("best_conditional", conditional),
        ("best_equal_tp", equal_tp),
    ):
        if row is not None:
            summary[key] = row[1].label
            summary[f"{key}_per_gpu"] = round(row[0], 3)
            summary[f"recommended_over_{key}"] = round(best_per_gpu / row[0], 3) if row[0] else None
    pure = max((r[0] for r in (chunked, split) if r is not None), default=0.0)
    if conditional is not None and pure:
        summary["conditional_over_better_pure"] = round(conditional[0] / pure, 3)
        print(f"  conditional / better of chunked colocation and static split: {conditional[0] / pure:.2f}x")
    slo = Slo.parse(args.goodput)
    slo_flag = "default:" + ",".join(
        f"{name}={ms:g}" for name, ms in (("ttft", slo.ttft_ms), ("tpot", slo.tpot_ms)) if ms
    )
    print(f"  {rec.serve_flags(args.profile, args.policy, slo_flag)}")
    summary["candidates"] = [
        {
            "label": c.label,
            "family": c.family,
            "per_gpu": round(pg, 3),
            "goodput_rps": round(r["goodput_rate"], 2),
            "bracketed": r["bracketed"],
            "pruned": r["pruned"],
            "points": r["points"],
        }
        for pg, c, r in rows
    ]
    save_result(args, summary, f"plan-{args.gpus}gpus.json")
    print(json.dumps({k: v for k, v in summary.items() if k != "candidates"}, sort_keys=True))
