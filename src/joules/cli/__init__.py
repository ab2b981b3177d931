"""The ``joules`` command line.

Commands: ``info``, ``measure``, ``power``, ``demo``, ``simulate``, ``restore``, ``serve``, ``pipeline``.
"""

from __future__ import annotations

import math
import os
import sys

import rich.console
import typer
from typer._click.exceptions import NoArgsIsHelpError

from joules.devices.discovery import SIM_ENV
from joules.errors import JoulesError

app = typer.Typer(
    name="joules",
    help="Measure and optimize the energy of deep-learning work.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

SIM_HELP = (
    f"Use simulated hardware, e.g. A100, H100x4, 'V100,A40' (also: {SIM_ENV}=SPEC). "
    "Models: P100 V100 A40 A100 H100 H200; CPUs: XEON8480 XEON6248 EPYC7763; nocpu."
)


@app.callback()
def _root(
    sim: str | None = typer.Option(None, "--sim", metavar="SPEC", help=SIM_HELP),
) -> None:
    """Measure and optimize the energy of deep-learning work."""
    use_sim(sim)


MAX_DURATION_S = 1e8  # about three years; far beyond what a sleep can take is refused


def check_duration(name: str, value: float | None) -> None:
    """A positive number of seconds up to ``MAX_DURATION_S``, or ``None``."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise JoulesError(f"{name} must be a positive number of seconds, got {value:g}")
    if value is not None and value > MAX_DURATION_S:
        raise JoulesError(f"{name} must be at most {MAX_DURATION_S:,.0f} s, got {value:g}")


def print_out(text: str) -> bool:
    """Print a line on stdout; ``False`` (and stdout silenced) when its reader has gone.

    ``joules measure --json | head -1`` closes the pipe early: what is left to do (the
    timeline, the command's exit code) still happens, and nothing more is written there.
    """
    try:
        print(text, flush=True)
        return True
    except BrokenPipeError:
        silence_stdout()
        return False


class StdoutGone(Exception):
    """Stdout's reader has gone (``joules info | head -1``): nothing more to write there."""


class Console(rich.console.Console):
    """A ``rich`` console whose closed stdout ends the command quietly, exit code 0.

    ``rich``'s own handling exits with 1, which a ``set -o pipefail`` script takes for a failure
    (``joules measure`` and ``joules power`` already keep their exit code there).
    """

    def on_broken_pipe(self) -> None:
        silence_stdout()
        raise StdoutGone


def silence_stdout() -> None:
    """Point stdout at ``/dev/null`` once its reader has gone.

    The interpreter's own flush at exit then fails no more.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def use_sim(sim: str | None) -> None:
    """Apply a command's ``--sim`` option (it wins over the environment), checking it first."""
    if sim is not None:
        from joules.devices.sim import parse_spec

        parse_spec(sim)
        os.environ[SIM_ENV] = sim


def parse_indices(value: str | None, what: str) -> list[int] | None:
    """Parse ``"0,2"`` into ``[0, 2]``; ``None`` means all, ``""``/``"none"`` means none."""
    if value is None:
        return None
    value = value.strip()
    if value.lower() in ("", "none"):
        return []
    out: list[int] = []
    for part in value.split(","):
        part = part.strip()
        if not part.isdigit():
            raise JoulesError(f"bad {what} list {value!r}: expected indices like 0,1,3")
        out.append(int(part))
    return out


def _register() -> None:
    from joules.cli import demo, info, measure, pipeline, power, restore, serve, simulate

    for module in (info, measure, power, demo, simulate, restore, serve, pipeline):
        module.register(app)


_register()


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; every expected error is one line on stderr and a non-zero exit code."""
    try:
        result = app(args=argv, prog_name="joules", standalone_mode=False)
    except typer.Exit as e:
        return e.exit_code
    except StdoutGone:
        return 0
    except typer.Abort:
        print("joules: aborted", file=sys.stderr)
        return 130
    except NoArgsIsHelpError as e:
        print(e.format_message())
        return 2
    except typer.TyperException as e:  # usage errors: unknown option, bad value...
        print(f"joules: error: {e.format_message()}", file=sys.stderr)
        return 2
    except (JoulesError, ValueError, OSError) as e:
        print(f"joules: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)  # e.g. 126/127 for a command that cannot start
    return result if isinstance(result, int) else 0

