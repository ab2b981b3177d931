"""Run one pipeline stage's part of a frequency plan: lock the SM clock per computation.

A training framework tells the controller of each rank when each of its computations begins
and ends; the controller locks that rank's GPU to the computation's planned SM clock::

    frontier = Frontier.load("plans/")
    with FrequencyController.from_frontier(frontier, stage=rank, gpu=gpu) as ctl:
        for batch in loader:
            for kind, microbatch in schedule:          # this rank's schedule
                ctl.on_instruction_begin(kind, microbatch)
                run(kind, microbatch)
                ctl.on_instruction_end(kind, microbatch)

Instructions are looked up by ``(computation, microbatch)``, so a framework that calls them
in another order than the plan's still gets each computation's own frequency (the
out-of-order calls are counted; ``strict=True`` makes them an error). A computation the plan
does not have (e.g. a microbatch beyond the plan's count) is always an error: the plan was
made for another pipeline.

Every lock goes through a :class:`~joules.devices.restore.RestoreGuard`, which resets the
clock when the job ends (:meth:`FrequencyController.restore`, leaving the ``with`` block, an
exception, interpreter exit, SIGINT/SIGTERM/SIGHUP), and journals it first so that after a SIGKILL
the next guard or ``joules restore`` resets it. With ``asynchronous=True`` the locks are made
by a background thread, which cannot install signal handlers: the controller has the guard
install them when it is created (in the main thread) and keeps them until it is closed.
"""

from __future__ import annotations

import bisect
import json
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from joules.devices.base import GPU
from joules.devices.restore import RestoreGuard
from joules.errors import DevicePermissionError
from joules.optimizers.pipeline.frontier import PlanError
from joules.optimizers.pipeline.schedule import KINDS, Kind

if TYPE_CHECKING:
    from joules.optimizers.pipeline.frontier import Frontier, Plan

log = logging.getLogger("joules.pipeline")

_ALIASES: dict[str, Kind] = {
    "forward": "forward", "fwd": "forward", "f": "forward",
    "backward": "backward", "bwd": "backward", "b": "backward",
}


class PlanMismatchError(PlanError):
    """The framework ran a computation the plan does not have (or, when strict, out of order)."""


def normalize_kind(computation: str) -> Kind:
    """``"forward"`` or ``"backward"`` from a computation name (``forward``, ``fwd``, ``F``, ...).

    Raises:
        PlanMismatchError: Not a forward or backward name.
    """
    kind = _ALIASES.get(str(computation).strip().lower())
    if kind is None:
        raise PlanMismatchError(
            f"unknown computation {computation!r}; expected one of {', '.join(KINDS)} (or fwd/bwd, F/B)"
        )
    return kind


def clock_guard(gpu: GPU, guard: RestoreGuard | None, dry_run: bool, journal_dir: str | Path | None,
                handle_signals: bool, recover_stale: bool) -> RestoreGuard | None:
    """The guard clock locks go through: ``guard``, else a new one over ``gpu``; none in a dry run."""
    if dry_run:
        return None
    if guard is None:
        guard = RestoreGuard([gpu], journal_dir=journal_dir, handle_signals=handle_signals,
                             recover_stale=recover_stale)
    return guard


def lock_clock(guard: RestoreGuard, gpu: GPU, mhz: float, dry_run_does: str) -> None:
    """Lock ``gpu``'s SM clock to ``mhz`` through ``guard``.

    Raises:
        DevicePermissionError: No permission; the message adds what ``dry_run=True`` would
            do instead (``dry_run_does``). The clock is unchanged.
    """
    try:
        guard.lock_sm_clock(gpu, mhz, mhz)
    except DevicePermissionError as e:
        # The device layer's message names the GPU and how to get the permission.
        raise DevicePermissionError(
            f"{e} (or pass dry_run=True to {dry_run_does}); the clock was not changed"
        ) from None


@dataclass(frozen=True)
class Instruction:
    """One computation of a stage and the SM frequency to run it at.

    Attributes:
        computation: ``"forward"`` or ``"backward"``.
        microbatch: Microbatch number.
        frequency: Planned SM clock, MHz.
    """

    computation: Kind
    microbatch: int
    frequency: int

    @property
    def key(self) -> tuple[Kind, int]:
        """``(computation, microbatch)``: what identifies the instruction within an iteration."""
        return (self.computation, self.microbatch)

    def to_dict(self) -> dict[str, object]:
        """The dict form, as :meth:`Frontier.rank_plan` gives it."""
        return {"computation": self.computation, "microbatch": self.microbatch, "frequency": self.frequency}


def parse_instructions(instructions: Sequence[Mapping[str, object] | Instruction]) -> tuple[Instruction, ...]:
    """Check and convert a stage's instructions (dicts with computation, microbatch, frequency).

    Raises:
        PlanError: Empty list, a missing or bad field, or a computation listed twice.
    """
    parsed: list[Instruction] = []
    seen: set[tuple[Kind, int]] = set()
    for i, raw in enumerate(instructions):
        if isinstance(raw, Instruction):  # checked like a dict ("F" is "forward" in both)
            raw = raw.to_dict()
        try:
            kind = normalize_kind(str(raw["computation"]))
            mb, freq = raw["microbatch"], raw["frequency"]
            if isinstance(mb, bool) or not isinstance(mb, int | float | str):
                raise TypeError(f"microbatch {mb!r}")
            if isinstance(freq, bool) or not isinstance(freq, int | float | str):
                raise TypeError(f"frequency {freq!r}")
            if float(mb) != int(float(mb)):
                raise ValueError(f"microbatch {mb!r} is not a whole number")
            ins = Instruction(kind, int(float(mb)), int(float(freq)))
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise PlanError(f"instruction {i} ({raw!r}) is malformed: {type(e).__name__}: {e}") from None
        if ins.microbatch < 0 or ins.frequency <= 0:
            raise PlanError(f"instruction {i} ({ins}) needs a microbatch >= 0 and a positive frequency")
        if ins.key in seen:
            raise PlanError(f"instruction {i}: {ins.computation} {ins.microbatch} is listed twice")
        seen.add(ins.key)
        parsed.append(ins)
    if not parsed:
        raise PlanError("a stage's plan has no instructions")
    return tuple(parsed)


def snap_frequency(frequency: float, supported_mhz: Sequence[float]) -> float:
    """The supported clock nearest ``frequency`` (the higher one on a tie; clamped to the range)."""
    clocks = sorted(supported_mhz)
    if not clocks:
        raise ValueError("the GPU reports no supported SM clocks")
    i = bisect.bisect_left(clocks, frequency)
    if i == 0:
        return clocks[0]
    if i == len(clocks):
        return clocks[-1]
    lo, hi = clocks[i - 1], clocks[i]
    return lo if frequency - lo < hi - frequency else hi


@dataclass
class ControllerStats:
    """What a :class:`FrequencyController` has done.

    Attributes:
        instructions: Instructions begun.
        locks_applied: Clock locks made (or, in a dry run, that would have been made).
        locks_skipped: Instructions whose frequency was already locked.
        out_of_order: Instructions begun or ended out of the plan's order (tolerated unless strict).
        iterations: Times the plan's last instruction ended.
        plan_switches: Calls of :meth:`FrequencyController.set_plan`.
        restores: Times the clock was reset through the guard.
        locks_dropped: With ``asynchronous``, clocks superseded before they were applied.
    """

    instructions: int = 0
    locks_applied: int = 0
    locks_skipped: int = 0
    out_of_order: int = 0
    iterations: int = 0
    plan_switches: int = 0
    restores: int = 0
    locks_dropped: int = 0

    def to_dict(self) -> dict[str, int]:
        """JSON-friendly form."""
        return dict(self.__dict__)


@dataclass(frozen=True)
class LockRecord:
    """One clock lock the controller made (or, in a dry run, would have made)."""

    computation: Kind
    microbatch: int
    frequency_mhz: float
    applied: bool


class FrequencyController:
    """Locks one GPU's SM clock to each computation's planned frequency as the stage runs.

    Args:
        gpu: The GPU this rank (stage) runs on.
        instructions: The stage's plan in execution order: dicts with ``computation``
            (``"forward"``/``"backward"``), ``microbatch`` and ``frequency`` (MHz), as
            :meth:`Frontier.rank_plan <joules.optimizers.pipeline.frontier.Frontier.rank_plan>`
            returns them (or :class:`Instruction` objects).
        guard: The :class:`RestoreGuard` every lock goes through (default: a new one over
            ``gpu``). :meth:`restore` restores the guard, i.e. every GPU it changed: the
            other controllers sharing the guard then lock their clock again at their next
            instruction, even one at the frequency they had locked.
        dry_run: Never touch the GPU: record in :attr:`records` the locks that would be made.
        strict: Raise :class:`PlanMismatchError` when computations begin or end out of the
            plan's order (by default they are looked up by ``(computation, microbatch)``, and
            counted in :attr:`stats`).
        journal_dir: Journal directory of the default guard (default: the guard's default).
        handle_signals: Whether the default guard restores on SIGINT, SIGTERM and SIGHUP too.
        recover_stale: Whether the default guard first resets what killed jobs left locked.
        keep_records: Keep at most this many :attr:`records` (the oldest are dropped).
        asynchronous: Lock clocks from a background thread, so that
            :meth:`on_instruction_begin` never waits for the driver: it only posts the clock
            wanted, and the thread applies the latest one (a clock superseded before it was
            applied is dropped, counted in ``stats.locks_dropped``). An error there (e.g. no
            permission) is raised by the next call (:meth:`on_instruction_begin`,
            :meth:`on_instruction_end`, :meth:`flush`), else by :meth:`close` or at the end of
            the ``with`` block, once the clock is reset (when the block raised, its exception
            goes on and this error is logged). :meth:`flush` waits until the clock wanted
            is in place; :meth:`restore` stops the thread first. The guard's SIGINT/SIGTERM/SIGHUP
            handlers are installed when the controller is created (it must be created in the
            main thread for that), and kept until :meth:`close` or the end of the ``with``
            block.

    Raises:
        PlanError: ``instructions`` is empty or malformed.
    """

    def __init__(
        self,
        gpu: GPU,
        instructions: Sequence[Mapping[str, object] | Instruction],
        *,
        guard: RestoreGuard | None = None,
        dry_run: bool = False,
        strict: bool = False,
        journal_dir: str | Path | None = None,
        handle_signals: bool = True,
        recover_stale: bool = True,
        keep_records: int = 10_000,
        asynchronous: bool = False,
    ) -> None:
        self.gpu = gpu
        self.asynchronous = asynchronous and not dry_run
        self._cond = threading.Condition()
        self._wanted: tuple[Kind, int, float] | None = None
        self._busy = False
        self._stopping = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.dry_run = dry_run
        self.strict = strict
        self.stats = ControllerStats()
        self.records: list[LockRecord] = []
        self._keep_records = max(0, keep_records)
        self._supported = sorted(float(f) for f in gpu.supported_sm_clocks_mhz())
        if not self._supported:
            raise ValueError(f"GPU {gpu.index} ({gpu.name}) reports no supported SM clocks to lock")
        self._plan: tuple[Instruction, ...] = ()
        self._by_key: dict[tuple[Kind, int], int] = {}
        self._snapped: dict[int, float] = {}
        self._next = 0
        self._running: tuple[Kind, int] | None = None
        self._locked_mhz: float | None = None
        self._warned_order = False  # the first begin out of the plan's order is logged as a warning
        self._load(instructions)
        self.guard = clock_guard(gpu, guard, dry_run, journal_dir, handle_signals, recover_stale)
        # The first lock is made in the background thread, where no signal handler can be
        # installed: install the guard's now (when this is the main thread).
        self._holds_handlers = (self.asynchronous and self.guard is not None
                                and self.guard.install_signal_handlers())

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def from_frontier(
        cls,
        frontier: Frontier,
        stage: int,
        gpu: GPU,
        time_s: float | None = None,
        *,
        plan: Plan | None = None,
        **kwargs: object,
    ) -> FrequencyController:
        """A controller for stage ``stage`` running a plan of ``frontier``.

        Args:
            frontier: The frontier.
            stage: This rank's stage.
            gpu: This rank's GPU.
            time_s: Run :meth:`Frontier.plan_for_time` of this iteration time (default: the
                fastest plan).
            plan: Run this plan instead.
            **kwargs: Passed on to the constructor (``guard``, ``dry_run``, ...).
        """
        if plan is None:
            plan = frontier.fastest if time_s is None else frontier.plan_for_time(time_s)
        return cls(gpu, frontier.rank_plan(plan, stage), **kwargs)  # type: ignore[arg-type]

    @classmethod
    def from_file(
        cls, path: str | Path, gpu: GPU, *, stage: int | None = None, microbatches: int | None = None,
        stages: int | None = None, **kwargs: object,
    ) -> FrequencyController:
        """A controller from a ``rank{stage}.json`` file :meth:`Frontier.save` writes (or a JSON list).

        Args:
            path: The file.
            gpu: This rank's GPU.
            stage: This rank's pipeline stage. Recommended: the stage the file records
                must then be this one, so that a rank that loads another rank's file (e.g.
                its local rank's instead of its stage's) gets an error instead of running
                another stage's frequencies. ``None`` checks nothing (a plain JSON list of
                instructions records no stage, so it can only be loaded that way).
            microbatches: The microbatches this rank runs per iteration. When given, the plan
                must have that many (a plan for 8 run with 4 would lock the wrong clocks
                without an error in the non-strict mode).
            stages: The pipeline's number of stages. When given, the file must record that
                many (a GPipe plan for 4 stages run on 2 follows the same order of
                computations: the last stage would run a middle stage's clocks, unnoticed).
            **kwargs: Passed on to the constructor (``guard``, ``dry_run``, ...).

        Raises:
            PlanError: Missing or malformed file.
            PlanMismatchError: The file is another stage's plan, records no stage to check
                ``stage`` against, plans another number of microbatches, or (given
                ``stages``) of stages.
        """
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise PlanError(f"cannot read the stage plan {path}: {e}") from None
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise PlanError(f"{path}: not JSON ({type(e).__name__}: {e})") from None
        instructions = data.get("instructions") if isinstance(data, dict) else data
        if not isinstance(instructions, list):
            raise PlanError(f"{path}: expected a list of instructions or an object with 'instructions'")
        if stage is not None:
            recorded = data.get("stage") if isinstance(data, dict) else None
            if recorded is None:
                raise PlanMismatchError(
                    f"{path} records no stage, so it cannot be checked against stage {stage}; "
                    "load it with stage=None to skip the check"
                )
            if isinstance(recorded, bool) or not isinstance(recorded, int):
                raise PlanError(f"{path}: malformed stage {recorded!r} (expected an integer)")
            if recorded != stage:
                raise PlanMismatchError(
                    f"{path} is the plan of stage {recorded}, but this rank runs stage {stage}; "
                    f"load rank{stage}.json of the same plan directory"
                )
        if stages is not None:
            recorded = data.get("stages") if isinstance(data, dict) else None
            if recorded is None:
                raise PlanMismatchError(
                    f"{path} records no number of stages, so it cannot be checked against {stages}; "
                    "plan again with this joules, or load it with stages=None to skip the check"
                )
            if recorded != stages:
                raise PlanMismatchError(
                    f"{path} is a plan for {recorded} stages, but this pipeline has {stages}: plan "
                    "again for this pipeline (joules pipeline plan --stages)"
                )
        # Checked before the controller is made: it installs signal handlers and recovers clocks.
        planned = 1 + max(i.microbatch for i in parse_instructions(instructions))
        if microbatches is not None and planned != microbatches:
            raise PlanMismatchError(
                f"{path} plans {planned} microbatches per iteration, but this rank runs {microbatches}: "
                "plan again for this pipeline (joules pipeline plan --microbatches)"
            )
        return cls(gpu, instructions, **kwargs)  # type: ignore[arg-type]

    # -- state ------------------------------------------------------------------------------
    @property
    def instructions(self) -> tuple[Instruction, ...]:
        """The current plan, in execution order."""
        return self._plan

    @property
    def locked_mhz(self) -> float | None:
        """The clock this controller has locked (would have, in a dry run), or ``None``.

        ``None`` also once the guard has reset the clock, whoever asked it to (e.g. another
        controller sharing the guard).
        """
        mhz = self._locked_mhz
        return mhz if mhz is not None and self._lock_in_place() else None

    def _lock_in_place(self) -> bool:
        """Whether the clock this controller locked (or posted) is still locked, or on its way.

        The guard may have reset it, or locked another clock, behind this controller's back:
        a :meth:`restore` or a lock of another controller sharing the guard, or the guard's
        own restore. Only the guard's record is read (no device call), so a repeated clock
        still costs no driver call. (Another process locking the same GPU is not seen: real
        drivers do not report a locked range.)
        """
        mhz = self._locked_mhz
        if self.guard is None:  # dry run: nothing to reset
            return True
        if mhz is not None and self.guard.holds_sm_clock(self.gpu, (mhz, mhz)):
            return True  # (not when another component sharing the guard locked another clock)
        if self.asynchronous:
            with self._cond:
                return self._wanted is not None or self._busy  # the clock posted is on its way
        return False

    def frequency_of(self, computation: str, microbatch: int) -> float:
        """The supported clock (MHz) the plan runs ``computation`` of ``microbatch`` at.

        Raises:
            PlanMismatchError: The plan has no such computation.
        """
        return self._snapped[self._lookup(normalize_kind(computation), microbatch)]

    # -- plan -------------------------------------------------------------------------------
    def set_plan(self, instructions: Sequence[Mapping[str, object] | Instruction]) -> None:
        """Switch to another plan (e.g. a slower one while a straggler holds the pipeline back).

        It takes effect at the next :meth:`on_instruction_begin`; the position in the
        iteration is kept (the next instruction is the one after the last one begun).

        Raises:
            PlanError: ``instructions`` is empty or malformed; the old plan stays.
        """
        last = self._plan[self._next - 1].key if self._plan and self._next > 0 else None
        self._load(instructions)
        self.stats.plan_switches += 1
        if last is not None and last in self._by_key:
            self._next = self._by_key[last] + 1
        else:
            self._next = 0

    def _load(self, instructions: Sequence[Mapping[str, object] | Instruction]) -> None:
        plan = parse_instructions(instructions)
        self._plan = plan
        self._by_key = {ins.key: i for i, ins in enumerate(plan)}
        self._snapped = {i: snap_frequency(ins.frequency, self._supported) for i, ins in enumerate(plan)}
        self._next = 0

    def _lookup(self, kind: Kind, microbatch: int) -> int:
        try:
            if isinstance(microbatch, bool) or int(microbatch) != microbatch:
                raise KeyError(microbatch)  # 1.5, True, "1": no microbatch of the plan
            return self._by_key[(kind, int(microbatch))]
        except (KeyError, TypeError, ValueError):
            mbs = sorted({ins.microbatch for ins in self._plan})
            raise PlanMismatchError(
                f"GPU {self.gpu.index}: the plan has no {kind} of microbatch {microbatch} (it has "
                f"{len(self._plan)} instructions for microbatches {mbs[0]}..{mbs[-1]}); was it made for "
                "this stage, schedule and microbatch count?"
            ) from None

    # -- callbacks --------------------------------------------------------------------------
    def on_instruction_begin(self, computation: str, microbatch: int) -> float:
        """Lock the SM clock to the planned frequency of ``computation`` of ``microbatch``.

        The lock is skipped when that clock is already locked (and its guard has not reset
        it since, e.g. through another controller sharing the guard).

        Returns:
            The clock locked (MHz).

        Raises:
            PlanMismatchError: The plan has no such computation (or, when strict, it is not
                the next one in the plan's order).
            DevicePermissionError: The clock cannot be locked; the GPU is unchanged.
        """
        self._raise_pending()
        kind = normalize_kind(computation)
        i = self._lookup(kind, microbatch)
        out_of_order = self.stats.out_of_order, self._warned_order  # (put back if not begun)
        mismatch = False
        if self._running is not None:  # the previous computation's end was never reported
            if self.strict:
                raise PlanMismatchError(
                    f"GPU {self.gpu.index}: {kind} {microbatch} began while {self._running[0]} "
                    f"{self._running[1]} was still running (no on_instruction_end for it)"
                )
            mismatch = True
        expected = self._next % len(self._plan)
        if i != expected:
            if self.strict:
                want = self._plan[expected]
                raise PlanMismatchError(
                    f"GPU {self.gpu.index}: {kind} {microbatch} began, but the plan's next computation "
                    f"is {want.computation} {want.microbatch} (instruction {expected})"
                )
            mismatch = True
            if not self._warned_order:
                self._warned_order = True
                want = self._plan[expected]
                log.warning("GPU %d: %s %d began, but the plan's next computation is %s %d: is the plan "
                            "another pipeline's (schedule, microbatches)? Such mismatches are counted in "
                            "stats.out_of_order (strict=True raises)", self.gpu.index, kind, microbatch,
                            want.computation, want.microbatch)
            else:
                log.debug("GPU %d: %s %d out of the plan's order", self.gpu.index, kind, microbatch)
        if mismatch:  # one call out of order counts once, whatever is wrong with it
            self.stats.out_of_order += 1
        before = self._next, self._running, self.stats.instructions
        self._next = i + 1
        self._running = (kind, int(microbatch))
        self.stats.instructions += 1
        mhz = self._snapped[i]
        if mhz == self._locked_mhz and self._lock_in_place():
            self.stats.locks_skipped += 1
            return mhz
        if self.asynchronous:
            self._post(kind, int(microbatch), mhz)
        else:
            try:
                self._lock(kind, int(microbatch), mhz)
            except BaseException:
                # Not begun: the same computation may begin again (e.g. after a retry).
                self._next, self._running, self.stats.instructions = before
                self.stats.out_of_order, self._warned_order = out_of_order
                raise
        return mhz

    # -- asynchronous locking ---------------------------------------------------------------
    def _post(self, kind: Kind, microbatch: int, mhz: float) -> None:
        if not self._holds_handlers and self.guard is not None and self._thread is None:
            # The thread starts (again, after close()): the handlers it cannot install itself.
            self._holds_handlers = self.guard.install_signal_handlers()
        with self._cond:
            if self._wanted is not None:
                self.stats.locks_dropped += 1
            self._wanted = (kind, microbatch, mhz)
            self._locked_mhz = mhz
            if self._thread is None or not self._thread.is_alive():
                self._stopping = False
                # Not a daemon: at interpreter exit it is joined before the guard's exit handler
                # restores the clock, so no lock can land after that restore.
                self._thread = threading.Thread(target=self._work, name=f"joules-clock-gpu{self.gpu.index}")
                self._thread.start()
            self._cond.notify_all()

    def _work(self) -> None:
        while True:
            with self._cond:
                while self._wanted is None and not self._stopping:
                    self._cond.wait(0.1)
                    if not threading.main_thread().is_alive():  # the program is ending
                        self._stopping = True
                if self._wanted is None:
                    return
                wanted, self._wanted = self._wanted, None
                self._busy = True
            try:
                self._lock(*wanted)
            except BaseException as e:  # noqa: BLE001 - handed to the training thread
                with self._cond:
                    self._error = e
                    self._locked_mhz = None
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _take_pending(self) -> BaseException | None:
        """The error the background thread hit and no call has raised yet (cleared), or ``None``."""
        if self._error is None:
            return None
        with self._cond:
            error, self._error = self._error, None
        return error

    def _raise_pending(self) -> None:
        error = self._take_pending()
        if error is not None:
            raise error

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the clock last asked for is in place (a no-op unless asynchronous).

        Raises:
            DevicePermissionError: (or what else locking raised) from the background thread.
            TimeoutError: Still not in place after ``timeout`` seconds.
        """
        with self._cond:
            done = self._cond.wait_for(lambda: self._wanted is None and not self._busy, timeout)
        self._raise_pending()
        if not done:
            raise TimeoutError(f"GPU {self.gpu.index}: clock lock still pending after {timeout} s")

    def _stop(self) -> None:
        thread = self._thread
        if thread is None:
            return
        with self._cond:
            self._stopping = True
            self._wanted = None  # a clock not applied yet is not wanted any more
            self._cond.notify_all()
        if thread is not threading.current_thread():
            thread.join()
        self._thread = None

    def on_instruction_end(self, computation: str, microbatch: int) -> None:
        """Note that ``computation`` of ``microbatch`` ended (the clock stays until the next begins).

        Raises:
            PlanMismatchError: The plan has no such computation (or, when strict, it is not
                the one that began last).
            DevicePermissionError: (or what else locking raised) With ``asynchronous``, a
                lock the background thread failed to make since the last call.
        """
        kind = normalize_kind(computation)
        i = self._lookup(kind, microbatch)
        key = (kind, int(microbatch))
        if key != self._running:
            if self.strict:
                running = "nothing" if self._running is None else f"{self._running[0]} {self._running[1]}"
                raise PlanMismatchError(
                    f"GPU {self.gpu.index}: {key[0]} {key[1]} ended, but {running} was running"
                )
            self.stats.out_of_order += 1
        self._running = None
        if i == len(self._plan) - 1:
            self.stats.iterations += 1
        self._raise_pending()

    def _lock(self, kind: Kind, microbatch: int, mhz: float) -> None:
        if self.dry_run:
            log.debug("dry run: would lock GPU %d's SM clock to %g MHz", self.gpu.index, mhz)
            self._record(LockRecord(kind, microbatch, mhz, applied=False))
        else:
            assert self.guard is not None
            lock_clock(self.guard, self.gpu, mhz, "only check the plan")
            self._record(LockRecord(kind, microbatch, mhz, applied=True))
        if not self.asynchronous:
            self._locked_mhz = mhz  # (asynchronous: set when posted, a newer one may be waiting)
        self.stats.locks_applied += 1

    def _record(self, record: LockRecord) -> None:
        if self._keep_records == 0:
            return
        self.records.append(record)
        if len(self.records) > self._keep_records:
            del self.records[: len(self.records) - self._keep_records]

    # -- restore ----------------------------------------------------------------------------
    def restore(self) -> list[str]:
        """Reset the clock through the guard (every GPU the guard changed); idempotent.

        The controller can go on afterwards: the next instruction locks again. With
        ``asynchronous``, an error of the background thread that no call has raised yet is
        kept for the next call (:meth:`close` raises it).

        Returns:
            The guard's error lines (empty when everything was restored, and in a dry run).
        """
        self._stop()
        self._locked_mhz = None
        if self.guard is None:
            return []
        had = bool(self.guard.changed)
        errors = self.guard.restore()
        if had:
            self.stats.restores += 1
        return errors

    def close(self) -> list[str]:
        """:meth:`restore`, and let the guard drop the signal handlers installed for ``asynchronous``.

        Returns:
            The guard's error lines, as :meth:`restore`.

        Raises:
            DevicePermissionError: (or what else locking raised) With ``asynchronous``, a
                lock the background thread failed to make that no call has raised yet; it
                is raised once the thread has ended and the clock is reset.
        """
        errors = self._close()
        self._raise_pending()
        return errors

    def _close(self) -> list[str]:
        errors = self.restore()
        self._running, self._next = None, 0  # an iteration cut short does not outlive the block
        if self._holds_handlers and self.guard is not None:
            self._holds_handlers = False
            self.guard.uninstall_signal_handlers()
        return errors

    def __enter__(self) -> FrequencyController:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        """:meth:`close`; a pending error of the background thread is raised unless the block raised.

        When the block raised, its exception goes on, and the pending error is logged.
        """
        self._close()
        error = self._take_pending()
        if error is None:
            return
        if exc is None:
            raise error
        log.error("GPU %d: a clock lock also failed in the background: %s: %s",
                  self.gpu.index, type(error).__name__, error)

    def summary(self) -> dict[str, object]:
        """Stats and the current lock, JSON-friendly."""
        return {"gpu": self.gpu.index, "dry_run": self.dry_run, "locked_mhz": self.locked_mhz,
                "instructions": len(self._plan), **self.stats.to_dict()}


__all__ = [
    "ControllerStats", "FrequencyController", "Instruction", "LockRecord", "PlanMismatchError",
    "clock_guard", "lock_clock", "normalize_kind", "parse_instructions", "snap_frequency",
]
