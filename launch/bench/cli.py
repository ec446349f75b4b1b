"""`moe-bench SUITE [options]`: runs one benchmark suite (each suite owns its options)."""

from __future__ import annotations

import importlib
import importlib.util
import sys

from launch.errors import cli

SUITES = {
    "dispatch": "launch.bench.dispatch",
    "pipeline": "launch.bench.pipeline",
    "optim": "launch.bench.optim",
    "kernels": "launch.bench.kernels",
    "clock": "launch.bench.clock",
    "train": "launch.bench.train",
    "tp": "launch.bench.tp",
    "checkpoint": "launch.bench.checkpoint",
    "cp": "launch.bench.cp",
    "data": "launch.bench.data",
    "layer": "launch.bench.layer",
    "compare": "launch.bench.compare",
    "imbalance": "launch.bench.imbalance",
    "gpu": "launch.bench.gpu",
}


def available() -> dict[str, str]:
    """The registered suites whose module exists in this checkout."""
    return {name: module for name, module in SUITES.items() if importlib.util.find_spec(module) is not None}


@cli("moe-bench")
def main(argv: list[str] | None = None) -> int:
    """Parse the suite name and hand the remaining arguments to that suite's main()."""
    argv = list(sys.argv[1:] if argv is None else argv)
    suites = available()
    names = ", ".join(suites)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: moe-bench SUITE [options]   (SUITE: {names}; SUITE --help for its options)")
        return 0
    if argv[0] not in suites:
        print(f"moe-bench: unknown suite {argv[0]!r}; choose one of: {names}", file=sys.stderr)
        return 2
    module = importlib.import_module(suites[argv[0]])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
