"""The ``mhmoe`` command line: one entry point, one module per command group.

``plan`` (plan, presets), ``train`` (train, eval, generate, compare), ``bench``, ``export`` (export,
convert-checkpoint), ``research`` (reproduce, analyze), ``integrations`` (downstream, make-tasks and the
transformers / lm-eval handlers). Every module lists ``PARSER_BUILDERS``: functions that add a
subcommand whose parser sets ``func``; the handlers turn the parsed arguments into typed configs and
call the library with those only. Every option has a help text and ``--help`` shows its default
(:class:`HelpFormatter`); warnings are printed once, as one line, on rank 0 (:mod:`mhmoe.runtime.console`).
Bad input (any ``ValueError``, including :mod:`mhmoe.errors`, and file-system errors) and running out of
memory print one line to stderr and exit with status 2; no traceback. Ctrl-C and SIGTERM, also during
start-up, print one line and exit 130 / 143 (a training saves a checkpoint first, see :mod:`mhmoe.train.loop`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from mhmoe.errors import NO_SPACE_EXIT, NoSpaceError, one_line
from mhmoe.runtime.console import one_line_warnings
from mhmoe.runtime.cpu_malloc import malloc_from_env
from mhmoe.runtime.files import no_space_errno
from mhmoe.runtime.signals import raise_on_sigterm


def _parser_builders() -> list[Callable[[argparse._SubParsersAction], None]]:
    """Every command group's parser builders, in ``mhmoe --help`` order (heavy modules load per command)."""
    from mhmoe.cli import bench, export, integrations, plan, research, train

    return (plan.PARSER_BUILDERS + train.PARSER_BUILDERS + bench.PARSER_BUILDERS + export.PARSER_BUILDERS
            + research.PARSER_BUILDERS + integrations.PARSER_BUILDERS)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the help already says what the default is or
    there is nothing to show (a flag, or a default of None meaning "not set")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or default is None or default is False or default == argparse.SUPPRESS
                or not action.option_strings or isinstance(action, argparse._HelpAction)):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        return f"{text} (default: {str(shown).replace('%', '%%')})"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mhmoe", description="Multi-Head Mixture-of-Experts language models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for add in _parser_builders():
        add(sub)
    return parser


MESSAGE_CHARS = 2000  # the longest error line the command prints


def _is_out_of_memory(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")  # loaded by the command if it ran out of device memory
    oom = getattr(torch.cuda, "OutOfMemoryError", None) if torch is not None else None
    return isinstance(exc, MemoryError) or (oom is not None and isinstance(exc, oom))


def main(argv: Sequence[str] | None = None) -> int:
    command = "mhmoe"
    try:
        with raise_on_sigterm():  # a SIGTERM raises mhmoe.runtime.signals.Interrupted (exit 143), like Ctrl-C
            parser = build_parser()  # imports torch: a Ctrl-C here must end in one line too
            args = parser.parse_args(argv)
            if not getattr(args, "func", None):
                parser.print_help()
                return 2
            command = f"mhmoe {args.command}"
            malloc_from_env()  # MHMOE_MALLOC=tuned: reuse freed CPU memory across steps (mhmoe.runtime.cpu_malloc)
            with one_line_warnings():
                return int(args.func(args) or 0)
    except NoSpaceError as exc:  # the disk, the quota or the file-size limit ran out while writing
        print(f"{command}: {one_line(exc.strerror or exc, MESSAGE_CHARS)}", file=sys.stderr)
        return NO_SPACE_EXIT
    except (ValueError, OSError) as exc:
        if isinstance(exc, OSError) and no_space_errno(exc) is not None:
            print(f"{command}: {one_line(exc, MESSAGE_CHARS)}", file=sys.stderr)
            return NO_SPACE_EXIT
        print(f"{command}: error: {one_line(exc, MESSAGE_CHARS)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (Interrupted, exit_code 143)
        print(f"{command}: {one_line(exc) if str(exc) else 'interrupted'}", file=sys.stderr)
        return int(getattr(exc, "exit_code", 130))
    except (MemoryError, RuntimeError) as exc:
        if not _is_out_of_memory(exc):
            raise
        print(f"{command}: error: out of memory ({one_line(exc, 200)}); lower train.batch_size or train.seq_len, "
              "or use a smaller model", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
