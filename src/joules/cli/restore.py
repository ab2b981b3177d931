"""``joules restore``: put back GPU settings that jobs which are gone (killed, crashed) left changed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from joules.cli import SIM_HELP, print_out, use_sim
from joules.devices.base import Problem
from joules.devices.discovery import discover
from joules.devices.restore import default_journal_dir, recover_report
from joules.errors import JoulesError


def _finding_failed(problem: Problem) -> bool:
    """Whether ``problem`` says GPUs could not be found or opened (not a found GPU's own warning)."""
    return (problem.device in ("nvml", "AMD") or problem.device.startswith("physical GPU")
            or problem.message.startswith("cannot use physical GPU")
            or "could not be opened" in problem.message)  # (amdsmi)


def register(app: typer.Typer) -> None:
    """Add the command to the app."""

    @app.command()
    def restore(
        journal_dir: Path | None = typer.Option(
            None, "--journal-dir", metavar="DIR",
            help="Where restore journals are (default: $JOULES_STATE_DIR/restore, else "
                 "$XDG_STATE_HOME/joules/restore or ~/.local/state/joules/restore).",
        ),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
        sim: str | None = typer.Option(None, "--sim", metavar="SPEC", help=SIM_HELP),
    ) -> int:
        """Restore power limits and clocks that jobs which are no longer running left changed.

        Reads the journals that joules writes before changing a GPU; exits with 1 when
        something could not be restored, a journal is unreadable, or a GPU left changed is
        not found while finding GPUs had problems (which are named).
        """
        use_sim(sim)
        if journal_dir is not None and journal_dir.exists() and not journal_dir.is_dir():
            raise JoulesError(f"--journal-dir {str(journal_dir)!r} is not a directory")
        directory = journal_dir if journal_dir is not None else default_journal_dir()
        devices = discover()
        lines = recover_report(devices.gpus, directory)
        ok = all(line.ok for line in lines)
        # A GPU a dead job left changed that cannot be reached because discovery failed (no
        # driver, NVML failing): not done, and the reasons said.
        unreached = [f"{p.device}: {p.message}" for p in devices.problems if _finding_failed(p)
                     ] if any(x.kind == "kept" for x in lines) else []
        ok = ok and not unreached
        restored = sum(line.kind == "restored" for line in lines)
        if as_json:
            print_out(json.dumps({
                "journal_dir": str(directory),
                "restored": restored,
                "ok": ok,
                "actions": [{"kind": x.kind, "message": x.message, "journal": x.journal} for x in lines],
                "problems": unreached,
            }, indent=2))
        else:
            for line in lines:
                print_out(line.message)
            for problem in unreached:
                print(f"joules: a GPU left changed may be out of reach: {problem}", file=sys.stderr)
            if ok and not any(x.kind in ("restored", "kept") for x in lines):
                # Name a directory that does not exist: a mistyped --journal-dir shows.
                print_out("nothing to restore" if directory.is_dir()
                          else f"nothing to restore (no journal directory {directory})")
        return 0 if ok else 1  # what was done, whether or not its reader is still there
