"""`moe-bench SUITE [options]`: runs one benchmark suite (each suite owns its options)."""

from __future__ import annotations

import importlib
import sys

SUITES = {
    "dispatch": "dispatch.bench",
    "pipeline": "pipeline.bench",
    "optim": "optim.bench",
    "kernels": "kernels.bench",
}


def main(argv: list[str] | None = None) -> int:
    """Parse the suite name and hand the remaining arguments to that suite's main()."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUITES:
        names = ", ".join(SUITES)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"moe-bench: unknown suite {argv[0]!r}; choose one of: {names}", file=sys.stderr)
            return 2
        print(f"usage: moe-bench SUITE [options]   (SUITE: {names}; SUITE --help for its options)")
        return 0
    module = importlib.import_module(SUITES[argv[0]])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
