"""The ``mhmoe`` command line: one entry point, one module per command group.

``plan`` (plan, presets), ``train`` (train, eval, generate, compare), ``bench``, ``export`` (export,
convert-checkpoint), ``research`` (reproduce, analyze, plot), ``integrations`` (downstream, make-tasks and
the transformers / lm-eval handlers). :data:`COMMANDS` names every subcommand, its module and the one-line
summary ``mhmoe --help`` shows; each module's ``PARSER_BUILDERS`` maps a command name to the function that
adds its parser (which sets ``func``). Only the module of the command being run is imported, so
``mhmoe --help`` and ``mhmoe --version`` answer without importing torch. The handlers turn the parsed
arguments into typed configs and call the library with those only. Every option has a help text and
``--help`` shows its default (:class:`HelpFormatter`); warnings are printed once, as one line, on rank 0
(:mod:`mhmoe.runtime.console`). Bad input (any ``ValueError``, including :mod:`mhmoe.errors`, and
file-system errors) and running out of memory print one line to stderr and exit with status 2; running
out of disk space (or the file-size limit, or the quota) while writing prints one line and exits with
status 74; no traceback. Ctrl-C and SIGTERM, also during start-up, print one line and exit 130 / 143 (a
training saves a checkpoint first, see :mod:`mhmoe.train.loop`). A reader of stdout that went away (``| head``)
ends the command quietly with status 141, as a shell reports other tools killed by SIGPIPE.
"""

from __future__ import annotations

import argparse
import importlib
import os
import select
import sys
from collections.abc import Callable, Sequence

from mhmoe.errors import NO_SPACE_EXIT, NoSpaceError, close_match, one_line
from mhmoe.runtime.console import one_line_warnings
from mhmoe.runtime.cpu_malloc import malloc_from_env
from mhmoe.runtime.files import no_space_errno
from mhmoe.runtime.signals import file_size_limit_as_error, raise_on_sigterm

#: every subcommand, in ``mhmoe --help`` order: (module under mhmoe.cli, one-line summary)
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("plan", "size an MH-MoE layer at FLOPs and parameter parity with a sparse MoE baseline"),
    "presets": ("plan", "list the named presets, or print one as YAML"),
    "train": ("train", "train a model from a preset or a YAML config"),
    "eval": ("train", "perplexity of a checkpoint on every validation set (--tasks: lm-eval tasks)"),
    "generate": ("train", "sample text from a model (KV cache)"),
    "compare": ("train", "train + evaluate several presets; one table and one curves plot"),
    "bench": ("bench", "benchmarks (moe: MoE layer paths vs masked loop vs same-FLOPs dense FFN)"),
    "export": ("export", "export a checkpoint (--bitnet: packed 2-bit ternary weights; --hf: a transformers "
                         "model directory)"),
    "convert-checkpoint": ("export", "convert a checkpoint between single-file safetensors and sharded "
                                     "torch.distributed.checkpoint (DCP)"),
    "reproduce": ("research", "train + evaluate the matched models of a paper table"),
    "analyze": ("research", "expert activation, sub-token assign diversity, entropy, load imbalance"),
    "plot": ("research", "training and validation curves of any runs in one PNG"),
    "downstream": ("integrations", "lm-eval tasks on several checkpoints: one table (rows = models)"),
    "make-tasks": ("integrations", "(re)build the offline lm-eval tasks from the KJV held-out split"),
    "data": ("data", "data tools (bundle: a prepared corpus + tokenizer that travels without its packages)"),
}


def version_string() -> str:
    """``mhmoe X (torch Y, Python Z)`` from the installed distributions' metadata (imports no torch)."""
    from importlib.metadata import PackageNotFoundError, version

    __version__ = sys.modules["mhmoe"].__version__  # the package itself (imported with any of its modules)
    try:
        torch_version = version("torch")
    except PackageNotFoundError:  # pragma: no cover
        torch_version = "not installed"
    return f"mhmoe {__version__} (torch {torch_version}, Python {sys.version.split()[0]})"


def _parser_builders(command: str | None = None) -> dict[str, Callable[[argparse._SubParsersAction], None]]:
    """The parser builders of ``command``'s module (None: of every module; "": none), by command name.
    Importing a module is what makes a command slow to start (torch), so only the one that runs is imported."""
    modules = dict.fromkeys(mod for name, (mod, _) in COMMANDS.items() if command in (None, name))
    builders: dict = {}
    for mod in modules:
        builders.update(importlib.import_module(f"mhmoe.cli.{mod}").PARSER_BUILDERS)
    return builders


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


class _Commands(argparse._SubParsersAction):
    """Subcommands whose one-line summary comes from :data:`COMMANDS` and is also the description of
    ``mhmoe COMMAND --help`` when the builder gives none."""

    def add_parser(self, name: str, **kwargs) -> argparse.ArgumentParser:
        summary = COMMANDS[name][1]
        kwargs.setdefault("help", summary)
        kwargs.setdefault("description", summary[:1].upper() + summary[1:] + ".")
        return super().add_parser(name, **kwargs)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``mhmoe`` parser. ``command`` None: every subcommand's full parser; a command name: only that
    one's (the others are listed with their summary), so building it imports one command module; "": none
    (``mhmoe --help``, ``mhmoe --version``)."""
    parser = _Parser(prog="mhmoe", description="Multi-Head Mixture-of-Experts language models: plan, train, "
                     "evaluate, compare and analyse MH-MoE and its baselines. `mhmoe COMMAND --help` for the options "
                     "of a command.")
    parser.add_argument("--version", action="version", version=version_string(), help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser, action=_Commands)
    builders = _parser_builders(command)
    for name in COMMANDS:
        if name in builders and (command is None or name == command):
            builders[name](sub)
        else:
            sub.add_parser(name, add_help=False)  # listed in `mhmoe --help`; never parsed (not the command)
    return parser


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (the first argument that is not an option), or None."""
    return next((a for a in argv if not a.startswith("-")), None)


MESSAGE_CHARS = 2000  # the longest error line the command prints


#: what torch's allocators say when an allocation fails (``model.max_seq_len=10**12`` asks for terabytes)
_ALLOCATION_FAILED = ("can't allocate memory", "cannot allocate memory", "out of memory", "failed to allocate")


def _is_out_of_memory(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")  # loaded by the command if it ran out of device memory
    oom = getattr(torch.cuda, "OutOfMemoryError", None) if torch is not None else None
    if isinstance(exc, MemoryError) or (oom is not None and isinstance(exc, oom)):
        return True
    text = str(exc)[:2000].lower()
    return isinstance(exc, RuntimeError) and any(s in text for s in _ALLOCATION_FAILED)


CLOSED_PIPE_EXIT = 141  # 128 + SIGPIPE: what a shell reports for a tool whose reader went away (`| head`)


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader went away (poll says POLLERR for it), as opposed to another pipe of
    the command breaking. False where stdout is no file (a test's capture) or there is no ``poll`` (Windows)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    if not hasattr(select, "poll"):
        return False
    poll = select.poll()
    poll.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poll.poll(0))


def _stdout_to_devnull() -> None:
    """stdout onto /dev/null, so that the interpreter's last flush does not fail again (Python's recipe for a
    closed pipe)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    command = "mhmoe"
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        # a SIGTERM raises mhmoe.runtime.signals.Interrupted (exit 143), like Ctrl-C; the file-size limit is EFBIG
        with raise_on_sigterm(), file_size_limit_as_error():
            name = _command_of(argv)
            if name is not None and name not in COMMANDS:
                hint = close_match(name, COMMANDS)
                print(f"mhmoe: error: unknown command {name!r}" + (f"; did you mean {hint}?" if hint else "")
                      + " (`mhmoe --help` lists them)", file=sys.stderr)
                return 2
            parser = build_parser(name or "")  # imports the command's module (torch): a Ctrl-C here is one line too
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
        if isinstance(exc, BrokenPipeError) and _stdout_reader_gone():  # `| head`: quiet, as other tools are
            _stdout_to_devnull()
            return CLOSED_PIPE_EXIT
        if isinstance(exc, OSError) and no_space_errno(exc) is not None:
            print(f"{command}: {one_line(exc, MESSAGE_CHARS)}", file=sys.stderr)
            return NO_SPACE_EXIT
        print(f"{command}: error: {one_line(exc, MESSAGE_CHARS)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (Interrupted, exit_code 143)
        print(f"{command}: {one_line(exc) if str(exc) else 'interrupted'}", file=sys.stderr)
        return int(getattr(exc, "exit_code", 130))
    except (MemoryError, RuntimeError) as exc:
        if no_space_errno(exc) is not None:  # e.g. torch's archive writer on a full disk
            print(f"{command}: {one_line(exc, MESSAGE_CHARS)} (no space left)", file=sys.stderr)
            return NO_SPACE_EXIT
        if not _is_out_of_memory(exc):
            raise
        print(f"{command}: error: out of memory ({one_line(exc, 200)}); lower train.batch_size or train.seq_len, "
              "or use a smaller model", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
