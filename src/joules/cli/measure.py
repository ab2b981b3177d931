"""``joules measure -- CMD``: time and energy of a whole command."""

from __future__ import annotations

import errno
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from joules.cli import SIM_HELP, parse_indices, print_out, use_sim
from joules.errors import JoulesError, NothingMeasuredWarning
from joules.monitoring.measurement import Measurement
from joules.monitoring.monitor import EnergyMonitor


def measurement_json(command: list[str], exit_code: int, m: Measurement) -> dict[str, object]:
    """The ``--json`` object of ``joules measure``."""

    def zone(values: dict[int, float], kind: str) -> dict[str, float] | None:
        """``None`` where no device of the kind is measured (``{}``: all of them left out)."""
        measured = values or any(_kind(x) == kind for x in m.missing)
        return {str(k): v for k, v in values.items()} if measured else None

    return {
        "command": command,
        "exit_code": exit_code,
        "time_s": m.elapsed_s,
        "gpu_energy_j": {str(k): v for k, v in m.gpu_energy_j.items()},
        "cpu_energy_j": zone(m.cpu_energy_j, "cpu"),
        "dram_energy_j": zone(m.dram_energy_j, "dram"),
        "total_energy_j": m.total_energy_j,
        "uncertainty_j": m.uncertainty_j,
        "sources": m.sources,
        "missing": list(m.missing),
    }


_LABELS = {"gpu": "GPU", "cpu": "CPU", "dram": "DRAM"}


def _kind(missing: str) -> str:
    """``gpu``, ``cpu`` or ``dram``: the kind of a device named in ``Measurement.missing``."""
    return missing.rstrip("0123456789")
_MAX_TITLE = 200  # characters of a command shown above its table


def measurement_table(m: Measurement, title: str) -> Table:
    """A table of time, energy and average power per device."""
    if len(title) > _MAX_TITLE:  # a long command would bury the numbers (--json has it whole)
        title = title[: _MAX_TITLE - 1] + "…"
    t = Table(title=Text(title))  # plain text: a command's ``[...]`` is not markup
    for col, justify in (("device", "left"), ("energy (J)", "right"), ("± (J)", "right"),
                         ("avg power (W)", "right"), ("source", "left")):
        # Numbers are never cut short on a narrow terminal: they fold onto more lines.
        t.add_column(col, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for prefix, zones in (("GPU", m.gpu), ("CPU", m.cpu), ("DRAM", m.dram)):
        for k, d in zones.items():
            power = d.energy_j / m.elapsed_s if m.elapsed_s > 0 else 0.0
            source = d.source.value + (" (corrected)" if d.corrected else "")
            t.add_row(f"{prefix} {k}", f"{d.energy_j:,.2f}", f"{d.uncertainty_j:,.2f}",
                      f"{power:,.1f}", source)
    for x in m.missing:  # left out of the total
        kind = _kind(x)
        t.add_row(f"{_LABELS.get(kind, kind)} {x[len(kind):]}", "—", "—", "—", "not read at the end")
    t.add_section()
    t.add_row("total", f"{m.total_energy_j:,.2f}", f"{m.uncertainty_j:,.2f}",
              f"{m.average_power_w:,.1f}", f"time {m.elapsed_s:,.3f} s")
    return t


def check_output_path(option: str, path: str | None, *, make_dirs: bool = False) -> None:
    """Fail before anything runs when an output file (``.csv`` or ``.jsonl``) cannot be written.

    Args:
        option: The option's name, for the message.
        path: The file asked for, or ``None``.
        make_dirs: Whether missing directories will be made (``--log``); else they must exist.
    """
    if path is None:
        return
    p = Path(path)
    if p.suffix not in (".csv", ".jsonl") or p.stem == "":
        raise JoulesError(f"{option} needs a .csv or .jsonl file name, got {path!r}")
    parent = p.parent
    if make_dirs:
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
    if not parent.is_dir():
        why = "is a file, not a directory" if parent.exists() else "does not exist"
        raise JoulesError(f"{option} {path!r}: directory {str(parent)!r} {why}")
    if p.is_dir() or not os.access(p if p.exists() else parent, os.W_OK):
        raise JoulesError(f"{option} {path!r} cannot be written")


def check_timeline_path(path: str | None) -> None:
    """Fail before anything runs when a ``--timeline`` path cannot be written as asked."""
    check_output_path("--timeline", path)


def export_timeline(monitor: EnergyMonitor, path: str | None) -> None:
    """Write the sampler's timeline, after the results are out: a failure only warns."""
    if path is None:
        return
    try:
        monitor.sampler.export(path)
    except OSError as e:
        print(f"joules: warning: could not write the timeline to {path}: {e}", file=sys.stderr)


def open_monitor(*args: Any, **kwargs: Any) -> EnergyMonitor:
    """An :class:`EnergyMonitor`; one that finds no device to measure is said so on stderr.

    The monitor's own warning (:class:`~joules.errors.NothingMeasuredWarning`) names the
    library's options; the command line names its own.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NothingMeasuredWarning)
        monitor = EnergyMonitor(*args, **kwargs)
    if not monitor.gpus and not monitor.cpus:
        print("joules: warning: no GPU or CPU energy readings found, so nothing is measured "
              "(see `joules info`; --sim SPEC simulates devices)", file=sys.stderr)
    return monitor


def run_measured(command: list[str], monitor: EnergyMonitor) -> tuple[int, Measurement | None]:
    """Run ``command`` inside a window; return its exit status and the measurement.

    The measurement is ``None`` when the devices could not be read as the command ended, in
    three tries (a warning on stderr says why): the command's status is still returned.

    The status is ``Popen``'s: the exit code, or ``-N`` when the command died of signal ``N``
    (:func:`shell_code` gives what a shell would report).

    Ctrl-C reaches the child (same process group); joules waits for it to end and still
    reports what was measured. SIGTERM and SIGHUP sent to joules alone are passed on to the
    child (also one that arrives while it starts), and are handled the same way.

    Raises:
        CommandNotRunError: The command was not found (exit code 127) or is not executable
            (126), as a shell reports them.
    """
    if not command[0]:
        raise CommandNotRunError("command not found: '' (an empty command name)", 127)
    started: list[subprocess.Popen[bytes]] = []
    early: list[int] = []  # signals that came before the child existed

    def forward(signum: int, _frame: object) -> None:
        if started:
            started[0].send_signal(signum)
        else:
            early.append(signum)

    # Installed before the child starts (a SIGTERM in between is passed on once it has); the
    # child starts with the default handlers (exec resets caught signals).
    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        monitor.begin_window("command")
        try:
            try:
                proc = subprocess.Popen(command)
            except OSError as e:
                if e.errno != errno.ENOEXEC:
                    raise
                # A script without a ``#!`` line: run it with /bin/sh, as execvp and shells do.
                path = command[0] if os.sep in command[0] else shutil.which(command[0]) or command[0]
                proc = subprocess.Popen(["/bin/sh", path, *command[1:]])
        except FileNotFoundError:
            monitor.cancel_window("command")
            raise CommandNotRunError(f"command not found: {command[0]}", 127) from None
        except PermissionError:
            monitor.cancel_window("command")
            raise CommandNotRunError(f"command not executable: {command[0]}", 126) from None
        except BaseException:
            monitor.cancel_window("command")
            raise
        started.append(proc)
        for signum in early:
            proc.send_signal(signum)
        previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)  # the child handles Ctrl-C
        try:
            code = proc.wait()
            # (still under the handlers: a signal while the end is read, tried again, is passed
            # on to the command, which has ended, rather than end joules without its report)
            return code, end_measurement(monitor, "command", "as the command ended")
        finally:
            signal.signal(signal.SIGINT, previous_int)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


_END_TRIES = 3


def end_measurement(monitor: EnergyMonitor, name: str, when: str) -> Measurement | None:
    """End the window ``name``; ``None``, with a warning saying ``when``, if it cannot be.

    A device read that fails is tried again (a window whose end failed stays open). After
    the last try the devices that can be read are measured without the others
    (``end_window(partial=True)``), with a warning naming what was left out.
    """
    for attempt in range(_END_TRIES):
        try:
            return monitor.end_window(name)
        except JoulesError as e:
            error = e
            if attempt + 1 < _END_TRIES:
                time.sleep(0.02 * (attempt + 1))
    try:
        m = monitor.end_window(name, partial=True)
    except JoulesError as e:
        error = e
        m = None
    if m is None or (m.missing and not (m.gpu or m.cpu or m.dram)):  # (every device left out)
        print(f"joules: warning: the devices could not be read {when} ({error}): nothing was measured",
              file=sys.stderr)
        return None
    left_out = f"; left out of the totals: {', '.join(m.missing)}" if m.missing else ""
    sampled = "; a GPU whose energy counter failed is measured from its power samples" if m.gpu else ""
    print(f"joules: warning: a device could not be read {when} ({error}){left_out}{sampled}", file=sys.stderr)
    return m


FORWARDED = (signal.SIGTERM, signal.SIGHUP)
"""Signals sent to joules alone that it passes on to the command (Ctrl-C reaches both)."""


def shell_code(status: int) -> int:
    """The exit code a shell reports for ``Popen`` status ``status`` (128 + N for signal N)."""
    return 128 - status if status < 0 else status


class CommandNotRunError(JoulesError):
    """The measured command could not be started; ``exit_code`` is what a shell would return."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def register(app: typer.Typer) -> None:
    """Add the command to the app."""

    @app.command(context_settings={"allow_interspersed_args": False})
    def measure(
        command: list[str] = typer.Argument(None, metavar="-- CMD [ARGS...]", show_default=False),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
        gpus: str | None = typer.Option(None, "--gpus", metavar="LIST", help="GPU indices, e.g. 0,1."),
        cpus: str | None = typer.Option(None, "--cpus", metavar="LIST",
                                        help="CPU package indices; 'none' for none."),
        log: str | None = typer.Option(None, "--log", metavar="FILE", help="Append the window to FILE."),
        timeline: str | None = typer.Option(None, "--timeline", metavar="FILE",
                                            help="Write GPU power samples to FILE (.csv or .jsonl)."),
        sim: str | None = typer.Option(None, "--sim", metavar="SPEC", help=SIM_HELP),
    ) -> int:
        """Run a command and report its time, energy and average power per device."""
        use_sim(sim)
        if not command:
            raise JoulesError("no command given (usage: joules measure [OPTIONS] -- CMD [ARGS...])")
        check_timeline_path(timeline)
        check_output_path("--log", log, make_dirs=True)
        monitor = open_monitor(parse_indices(gpus, "GPU"), parse_indices(cpus, "CPU"), log=log)
        try:
            status, m = run_measured(command, monitor)  # CommandNotRunError: main() exits 126/127
        finally:
            monitor.close()
        code = shell_code(status)
        export_timeline(monitor, timeline)  # first: the report's reader may be gone
        if m is None:  # (said on stderr)
            if as_json:
                print_out(json.dumps({"command": command, "exit_code": code, "error": "the devices "
                                      "could not be read as the command ended: nothing was measured"}))
        elif as_json:
            print_out(json.dumps(measurement_json(command, code, m)))
        else:
            try:
                Console(stderr=True).print(measurement_table(m, shlex.join(command)))
            except OSError:  # the terminal hung up (EIO): the log and timeline are written
                pass
        if status == -signal.SIGINT:
            # The command died of Ctrl-C: so does joules, once the report is out, so that a
            # shell loop around it stops too (a shell goes on when a command exits 130, which
            # a command that merely exits with 130 still does).
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        return code
