"""Reports of ``gpu_step_benchmark.py`` runs split with ``--only`` joined into one report, ratios over all variants.

The device call (``.ci/gpu-device``) runs the variants in stages with time limits of their own, so that a slow
compilation cannot cost the bare reference its measurement; this joins the stages' reports again. Reports of
different set-ups (device, torch, model, workload, steps) are refused: their ratios would mean nothing.

    python benchmarks/gpu_step_merge.py OUT.json REPORT.json [REPORT.json ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from gpu_step_benchmark import ratios

SETUP = ("device", "torch", "dtype", "model", "sequences", "tokens", "max_tokens_per_micro_batch", "steps")
"""What every joined report must share."""


def merge(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report: the first one's set-up, every report's variants (a later one wins a name), fresh ratios.

    Raises:
        SystemExit: the reports differ in a field of :data:`SETUP`.
    """
    first = reports[0]
    for report in reports[1:]:
        differing = [key for key in SETUP if report.get(key) != first.get(key)]
        if differing:
            raise SystemExit(
                f"gpu_step_merge: the reports differ in {differing}; join runs of one set-up only."
            )
    variants: dict[str, Any] = {}
    for report in reports:
        variants |= report["variants"]
    return {**first, "variants": variants, "ratios": ratios(variants)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the joined report to write")
    parser.add_argument(
        "reports", type=Path, nargs="+", help="reports written by gpu_step_benchmark.py --out"
    )
    args = parser.parse_args(argv)
    found = [path for path in args.reports if path.is_file()]
    if not found:
        names = ", ".join(map(str, args.reports))
        raise SystemExit(f"gpu_step_merge: none of {names} exists; did every benchmark stage fail to start?")
    args.out.write_text(json.dumps(merge([json.loads(path.read_text()) for path in found]), indent=2))
    print(f"gpu_step_merge: {len(found)} reports joined into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
