"""`--sweep NAME=V1,V2 NAME2=...`: every combination of option values, each point parsed as its command line."""

from __future__ import annotations

import argparse
import itertools

NOT_SWEPT = ("sweep", "json", "help")


def sweep_axes(parser: argparse.ArgumentParser, specs: list[str]) -> dict[str, list[str]]:
    """{option name as typed: its values}; parser.error naming the spec and the options that can be swept."""
    options = {flag[2:]: action for action in parser._actions for flag in action.option_strings
               if flag.startswith("--") and action.dest not in NOT_SWEPT and action.nargs != 0}
    axes: dict[str, list[str]] = {}
    for spec in specs:
        name, _, values = spec.partition("=")
        name = name.removeprefix("--")
        if name not in options:
            parser.error(f"--sweep {spec!r}: {name!r} is not an option of this suite; sweepable: "
                         + ", ".join(sorted(options)))
        if not values or "" in values.split(",") or name in axes:
            parser.error(f"--sweep {spec!r}: write NAME=V1,V2,... with each option once")
        axes[name] = values.split(",")
    return axes


def sweep_points(axes: dict[str, list[str]]) -> list[dict[str, str]]:
    """The cartesian product of the axes, first axis slowest."""
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


def point_argv(argv: list[str], point: dict[str, str]) -> list[str]:
    """argv with the point's values appended (argparse keeps the last value given)."""
    return [*argv, *(arg for name, value in point.items() for arg in (f"--{name}", value))]


def point_label(point: dict[str, str]) -> str:
    """'tokens=512 top-k=2'."""
    return " ".join(f"{name}={value}" for name, value in point.items())
