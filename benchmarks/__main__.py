"""``python -m benchmarks [--only prefill|decode] [--no-results]``: time fast against fla on a GPU.

Runs ``benchmarks.bench_prefill`` and (when present) ``benchmarks.bench_decode``. Each module exposes
``run() -> list[dict]`` (one table's rows) and optionally ``run_sections() -> [(title, rows, meta)]``
(several tables), plus optional ``TITLE`` / ``META`` for the single-table form. Tables are printed
and appended to ``benchmarks/RESULTS.md`` (unless ``--no-results``) with the device, versions and date.
Without a GPU it says so and exits 0.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import traceback

from . import common

MODULES = {"prefill": "benchmarks.bench_prefill", "decode": "benchmarks.bench_decode", "train": "benchmarks.bench_train",
           "norm": "benchmarks.bench_norm"}


def _sections(mod) -> list:
    if hasattr(mod, "run_sections"):
        return list(mod.run_sections())
    rows = mod.run()
    title = getattr(mod, "TITLE", mod.__name__.rsplit(".", 1)[-1].replace("bench_", "").capitalize())
    return [(title, rows, dict(getattr(mod, "META", {}) or {}))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=sorted(MODULES), default=None, help="run one benchmark module")
    ap.add_argument("--no-results", action="store_true", help="print only; do not append to RESULTS.md")
    args = ap.parse_args(argv)

    if not common.gpu_available():
        print("benchmarks: a CUDA GPU is needed (none found, or TRITON_INTERPRET=1); nothing to do.")
        return 0

    v = common.versions()
    print(f"device: {common.device_name()} | torch {v['torch']} | triton {v['triton']} | fla {v['fla']}")
    rc = 0
    for key, mod_name in MODULES.items():
        if args.only and key != args.only:
            continue
        if importlib.util.find_spec(mod_name) is None:
            print(f"{mod_name}: not present, skipped")
            continue
        try:
            mod = importlib.import_module(mod_name)
            sections = _sections(mod)
        except Exception:  # noqa: BLE001 - one broken module must not hide the other's numbers
            traceback.print_exc()
            rc = 1
            continue
        for title, rows, meta in sections:
            print(f"\n## {title}\n")
            for k_, v_ in (meta or {}).items():
                print(f"- {k_}: {v_}")
            print(common.format_table(rows))
            if not args.no_results:
                common.append_results(title, rows, meta)
    if not args.no_results:
        print(f"appended to {common.RESULTS_PATH}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
