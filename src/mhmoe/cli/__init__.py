"""The ``mhmoe`` command line: one entry point, one module per command group.

``plan`` (plan, presets), ``train`` (train, eval, generate, compare), ``bench``, ``export`` (export,
convert-checkpoint), ``research`` (reproduce, analyze), ``ecosystem`` (downstream, make-tasks and the
transformers / lm-eval handlers). Every module lists ``PARSER_BUILDERS``: functions that add a
subcommand whose parser sets ``func``; the handlers turn the parsed arguments into typed configs and
call the library with those only. Bad input (any ``ValueError``, including :mod:`mhmoe.errors`) prints one line to
stderr and exits with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from mhmoe.runtime.cpu_malloc import malloc_from_env


def _parser_builders() -> list[Callable[[argparse._SubParsersAction], None]]:
    """Every command group's parser builders, in ``mhmoe --help`` order (heavy modules load per command)."""
    from mhmoe.cli import bench, ecosystem, export, plan, research, train

    return (plan.PARSER_BUILDERS + train.PARSER_BUILDERS + bench.PARSER_BUILDERS + export.PARSER_BUILDERS
            + research.PARSER_BUILDERS + ecosystem.PARSER_BUILDERS)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mhmoe", description="Multi-Head Mixture-of-Experts language models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for add in _parser_builders():
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    malloc_from_env()  # MHMOE_MALLOC=tuned: reuse freed CPU memory across steps (mhmoe.runtime.cpu_malloc)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"mhmoe {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"mhmoe {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
