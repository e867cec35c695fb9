"""The command line: run a gin-configured experiment, list the shipped configs, say where the logs are.

The module docstring is not the help text: `_DESCRIPTION` is plain text, as a terminal shows it.
"""

import argparse
import glob
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any, List, Optional, Sequence

_DESCRIPTION = """\
Run a gin-configured experiment and log it with instrument.

examples:
  instrument run nca                                   a shipped config, by name
  instrument run nca --bind 'train_nca.steps = 50'     override any binding
  instrument run my.gin other.gin                      your own files (later ones override earlier ones)
  instrument list                                      the shipped configs, with what each does
"""


def _parser() -> argparse.ArgumentParser:
    from instrument import __version__

    parser = argparse.ArgumentParser(
        prog="instrument", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"instrument {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{run,list}")
    run = sub.add_parser(
        "run", help="run the experiment a config binds", description="Run the experiment a config binds "
        "(run.experiment), then say where its logs are and how to view them."
    )
    run.add_argument("config", nargs="*", help="a shipped config's name (see: instrument list) or a path to a "
                     ".gin file; several are parsed in order, later ones override earlier ones")
    run.add_argument("--bind", action="append", default=[], metavar="BINDING",
                     help="an extra gin binding, e.g. 'train_nca.steps = 50' (repeatable; applied after the files)")
    run.add_argument("--list", action="store_true", help="list the shipped configs and exit")
    run.add_argument("--debug", action="store_true", help="show the full traceback of a configuration error")
    sub.add_parser("list", help="list the shipped configs", description="List the shipped configs.")
    return parser


def list_configs() -> str:
    """The shipped configs by name with their one-line descriptions: experiments, then fragments to include."""
    from instrument.config import shipped_configs

    configs = shipped_configs()
    width = max(len(c.name) for c in configs) + 2
    lines = ["Shipped configs (instrument run NAME [--bind 'Name.param = value' ...]):"]
    lines += [f"  {c.name:<{width}}{c.description}" for c in configs if c.runnable]
    lines += ["", "Fragments to include from your own .gin file (include 'NAME.gin'):"]
    lines += [f"  {c.name:<{width}}{c.description}" for c in configs if not c.runnable]
    return "\n".join(lines)


def viewer_hints(backends: Sequence[Any], log_root: str) -> List[str]:
    """How to look at what each backend wrote: one command per backend that was used, in the order used, with
    paths quoted for a shell (``'my runs'``), so a pasted command gets each as one argument."""
    from instrument.backends.mlflow import MlflowBackend
    from instrument.backends.tensorboard import TensorBoardBackend
    from instrument.backends.wandb import WandbBackend

    hints: List[str] = []
    for backend in backends:
        if isinstance(backend, TensorBoardBackend):
            hints.append(f"TensorBoard: tensorboard --logdir {shlex.quote(_tensorboard_dir(backend, log_root))}")
        elif isinstance(backend, MlflowBackend) and backend.tracking_uri:
            uri = backend.tracking_uri
            hints.append(f"MLflow: open {uri}" if uri.startswith(("http://", "https://"))
                         else f"MLflow: mlflow ui --backend-store-uri {shlex.quote(uri)}")
        elif isinstance(backend, WandbBackend):
            if backend.mode == "offline":
                pattern = str(Path(backend.dir or log_root).resolve() / "wandb" / "offline-run-*")
                runs = sorted(glob.glob(pattern))
                target = runs[-1] if runs else pattern
                hints.append(f"W&B (offline): wandb sync {shlex.quote(target)}")
            elif backend.mode == "online":
                hints.append(f"W&B: logged online to project {backend.project!r} (wandb.ai)")
    return list(dict.fromkeys(hints))


def _tensorboard_dir(backend: Any, log_root: str) -> str:
    """The log root, where every run's event files are side by side to compare; the backend's own folder when
    ``TensorBoardBackend.log_dir`` puts them outside it (the log root would show nothing)."""
    own = getattr(backend, "log_dir", None)
    if not own:
        return str(log_root)
    root = Path(log_root).expanduser().resolve()
    if Path(own).expanduser().resolve().is_relative_to(root):
        return str(log_root)
    return str(own)


def _print_result(outcome: dict) -> None:
    result = outcome["result"]
    if isinstance(result, dict):
        summary = ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in result.items()
            if isinstance(v, (int, float, str))
        )
        print(f"done: {summary}")
    print(f"logs: {shlex.quote(outcome['run_dir'])}")
    hints = viewer_hints(outcome.get("backends", ()), outcome["log_root"])
    if hints:
        print("view them with:")
        for hint in hints:
            print(f"  {hint}")


def _redacted(message: str, binds: Sequence[str]) -> str:
    """An error message with every secret the config binds left out (`secrets.redacted_text`), as
    `parse_config` leaves them out of its own errors."""
    from instrument.config.secrets import redacted_text

    return redacted_text(message, binds)


_interrupt = {"seen": False, "hook": False, "entry": False}


def _exit_at_once(signum: int, frame: Any) -> None:
    """Another Ctrl-C once the interrupted run is closed (all it committed is saved): end now, status 130,
    rather than a KeyboardInterrupt in the middle of the exit (or Python's default action) killing the
    process by the signal, which a caller sees as -2, not the 130 it was told."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stream: nothing more to say
            pass
    os._exit(130)


def _ignore_late_interrupts() -> None:
    """Run last of the exit hooks (registered first): after an interrupt, a Ctrl-C from here on, when Python
    no longer runs handlers, is ignored, so the exit status stays 130. Earlier hooks (an SDK's teardown)
    could still be cut short by `_exit_at_once`, so a hung teardown never makes Ctrl-C useless."""
    if _interrupt["seen"]:
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _on_interrupt() -> Any:
    """The run was interrupted and is closed: until `main` returns, another Ctrl-C ends the process at once with
    status 130; so does one during the interpreter's exit, from its first exit hook on (registered now, so it
    runs first). Returns the SIGINT handler to put back when `main` returns: a program that calls `main` itself
    (a sweep) keeps its own Ctrl-C handling for what it runs next."""
    import atexit
    import signal

    _interrupt["seen"] = True
    atexit.register(_exit_on_interrupt_from_now)
    try:
        return signal.signal(signal.SIGINT, _exit_at_once)
    except ValueError:  # not the main thread (main() called from a thread): Python's default stays
        return None


def _exit_on_interrupt_from_now() -> None:
    import signal

    try:
        signal.signal(signal.SIGINT, _exit_at_once)
    except ValueError:
        pass


def _restore_interrupt(previous: Any) -> None:
    import signal

    if previous is not None:
        try:
            signal.signal(signal.SIGINT, previous)
        except ValueError:
            pass


def entry() -> int:
    """The ``instrument`` command and ``python -m instrument``: `main` as the process itself. The process ends
    after it, so an interrupted run keeps its exit-at-once Ctrl-C handler through the interpreter's exit:
    putting Python's back left a window, before the exit hooks, in which a second Ctrl-C raised inside the exit's
    clean-up (a weakref callback) and printed a traceback."""
    _interrupt["entry"] = True
    return main()


def _take_extras(args: argparse.Namespace, extras: List[str], argv: List[str], parser: argparse.ArgumentParser,
                 run: argparse.ArgumentParser) -> None:
    """Configs after a --bind (argparse ends the configs at the first option): the configs are those before it
    and these, in order, everything after ``--`` included. (parse_intermixed_args refuses a parser with
    subcommands.) An unknown option is refused alone, by the parser it was typed to (the top-level one before
    ``run``), and a binding typed without --bind is named as one; whatever is echoed is redacted."""
    from instrument.logger.params import redact_argv

    after: List[str] = []
    if "--" in extras:
        extras, after = extras[:extras.index("--")], extras[extras.index("--") + 1:]
    options = [e for e in extras if e.startswith("-")]
    if options:
        before_run = "run" not in argv or argv.index(options[0]) < argv.index("run") if options[0] in argv else False
        (parser if args.command != "run" or before_run else run).error(
            f"unrecognized arguments: {' '.join(redact_argv(options))}")
    if args.command != "run":
        parser.error(f"unrecognized arguments: {' '.join(redact_argv(extras + after))}")
    args.config = [*args.config, *extras, *after]


def _refuse_bindings(configs: Sequence[str], run: argparse.ArgumentParser) -> None:
    """A binding typed where a config goes (before or after a --bind, or after ``--``) is named as one, redacted:
    read as a config name, it was echoed in clear in 'no config file ...'. A name that is a file, or ends in
    ``.gin`` (``x=y.gin``), is a config."""
    from instrument.logger.params import redact_argv

    for name in configs:
        if re.match(r"\s*[\w./]+\s*=", name) and not name.endswith(".gin") and not os.path.exists(name):
            shown = redact_argv([name])[0]
            quoted = f'"{shown}"' if "'" in shown and '"' not in shown else shlex.quote(shown)
            run.error(f"{shown} is a binding, not a config: pass it with --bind {quoted}")


def main(argv: Optional[List[str]] = None) -> int:
    if not _interrupt["hook"]:  # first, so it runs after the hooks the run registers (atexit runs them LIFO)
        import atexit

        atexit.register(_ignore_late_interrupts)
        _interrupt["hook"] = True
    parser = _parser()
    args, extras = parser.parse_known_args(argv)
    run = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["run"]
    if extras:
        _take_extras(args, extras, list(sys.argv[1:] if argv is None else argv), parser, run)
    if args.command == "list" or args.list:
        try:
            print(list_configs(), flush=True)
        except BrokenPipeError:  # `instrument list | head`: the reader left; say nothing more
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    _refuse_bindings(args.config or [], run)
    if not args.config:
        run.error("run needs a config: a shipped name (instrument list shows them) or a path to a .gin file")

    from instrument import config
    from instrument.config.parse import check_bound_macros
    from instrument.errors import InstrumentError

    config.clear_config()  # each call runs its own config: nothing bound by an earlier call in this process
    try:
        config.parse_config(args.config, args.bind)
        config.require_experiment()  # before run: gin would start the run's instrumentation for nothing
        check_bound_macros(args.bind)  # `--bind 'train_nca_steps = 2'`: a macro nothing uses, not a binding
    except InstrumentError as exc:
        if args.debug:
            raise
        lead = " in " if getattr(exc, "where", "") else ": "
        # the config names too: 'no config file ...' echoes one, and 'api_key=sek.gin' is secret-looking
        message = _redacted(str(exc), [*args.bind, *args.config])
        print(f"instrument: configuration error{lead}{message}", file=sys.stderr)
        print("(instrument run ... --debug shows the traceback)", file=sys.stderr)
        return 2
    try:
        outcome = config.run()
    except KeyboardInterrupt as exc:  # Ctrl-C: the run is closed ("killed") and what was committed is saved
        if args.debug:
            raise
        previous = _on_interrupt()
        try:
            print("instrument: interrupted (Ctrl-C); the steps committed before it are saved.", file=sys.stderr)
            if getattr(exc, "outcome", None) is not None:
                _print_result(exc.outcome)
        finally:
            if not _interrupt.get("entry"):  # `main` called by a program that goes on: its handler comes back
                _restore_interrupt(previous)
        return 130  # what a shell reports for a process ended by SIGINT
    except InstrumentError as exc:  # bad input found while building or running (gin adds where it was bound)
        if args.debug:
            raise
        print(f"instrument: {type(exc).__name__}: {_redacted(str(exc), args.bind)}", file=sys.stderr)
        where = config.where_bound(str(exc), args.config, args.bind)
        if where:
            print(f"  bound at {_redacted(where, args.bind)}", file=sys.stderr)
        print("(instrument run ... --debug shows the traceback)", file=sys.stderr)
        return 2
    unused = config.unused_bindings(args.config, args.bind)
    if unused:  # e.g. WandbBackend.mode bound, but the config includes no W&B backend: the setting did nothing
        print("instrument: these bindings were never used in this process, since it never built what they "
              "configure (a backend the config does not include, say: include what builds it, e.g. backends/wandb "
              "for WandbBackend; what worker processes build is not seen here):", file=sys.stderr)
        for line in unused:
            print(f"  {_redacted(line, args.bind)}", file=sys.stderr)
    try:
        _print_result(outcome)
    except BrokenPipeError:  # `instrument run ... | head -1`: the reader left; the run itself is done and saved
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the interpreter's exit flush is quiet
    return 0


if __name__ == "__main__":
    sys.exit(entry())
