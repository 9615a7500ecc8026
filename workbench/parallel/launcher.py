"""Start N rank processes, talk to them over pipes, and never hang on them.

Every wait is ``multiprocessing.connection.wait`` over the ranks' pipes *and* their process
sentinels, so a rank that raises (it sends a ``RankFailure``) and a rank that dies without a word
(SIGKILL, segfault: its sentinel fires) both end the wait at once. The other ranks may then be
blocked in a collective waiting for the failed one, so they are terminated, and the parent raises a
single ``RankError`` naming the failed rank. The one exception: every rank raised the same kind of
error for the same command (a typo in ``configure``, a transform that fails everywhere). Then no
rank is stuck in a collective and all are in the same state, so they keep running and the error is
raised as on one process.

Start methods: ``forkserver`` (default) forks each rank from a server process that imported torch
and the pipeline once (``workbench.api`` and ``workbench.parallel.worker`` preloaded); ``spawn`` starts a fresh
interpreter per rank. Plain ``fork`` is refused: forking a process where torch has started threads
can deadlock the child.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import signal
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

from .group import FileRendezvous
from .worker import RankFailure, RankLaunch, rank_main

START_METHODS = ("forkserver", "spawn")
# After the first rank reports an error, how long the others get to report theirs (all ranks failing
# alike is a recoverable user error; a rank still busy after this is taken to be stuck).
ERROR_GRACE_S = 3.0
CLOSE_TIMEOUT_S = 10.0  # a polite close: the ranks leave the process group and exit
KILL_TIMEOUT_S = 5.0  # after SIGTERM, before SIGKILL
_GONE = ("gone",)  # _drain's answer for a rank whose pipe closed: it died


class RankError(RuntimeError):
    """A rank failed: it raised (``exc_type``, ``message``, ``traceback`` are the rank's) or died
    (``exitcode``). ``recoverable``: every rank raised alike and all are still running."""

    def __init__(
        self,
        rank: int,
        command: str,
        *,
        exc_type: Optional[str] = None,
        message: str = "",
        traceback: str = "",
        exitcode: Optional[int] = None,
        recoverable: bool = False,
        others: str = "",
    ):
        self.rank, self.command, self.exc_type, self.message = rank, command, exc_type, message
        self.traceback, self.exitcode, self.recoverable = traceback, exitcode, recoverable
        if exc_type is not None:
            head = f"rank {rank} failed in {command}(): {exc_type.rsplit('.', 1)[-1]}: {message}"
        else:
            head = f"rank {rank} died during {command}() with exit code {exitcode}{_signal_name(exitcode)}"
            if command == "start" and exitcode == 1:
                head += (
                    " before reporting (its stderr says why; a script that starts ranks needs the "
                    "`if __name__ == '__main__':` guard, as with any multiprocessing code)"
                )
        tail = f"\n{others}" if others else ""
        tb = f"\n--- traceback on rank {rank} ---\n{traceback.rstrip()}" if traceback else ""
        super().__init__(head + tail + tb)

    @classmethod
    def from_failure(cls, f: RankFailure, **kw: Any) -> "RankError":
        return cls(f.rank, f.command, exc_type=f.exc_type, message=f.message, traceback=f.traceback, **kw)

    def __reduce__(self):
        return (
            _rebuild_rank_error,
            (
                self.rank,
                self.command,
                dict(
                    exc_type=self.exc_type,
                    message=self.message,
                    traceback=self.traceback,
                    exitcode=self.exitcode,
                    recoverable=self.recoverable,
                ),
            ),
        )


def _rebuild_rank_error(rank, command, kw):
    return RankError(rank, command, **kw)


def _unpickle(data: Optional[bytes]) -> Optional[BaseException]:
    """A rank's exception as it was raised there; None when its class does not import here."""
    if data is None:
        return None
    import pickle

    try:
        return pickle.loads(data)
    except Exception:  # noqa: BLE001 - then the RankError's text stands for it
        return None


def _signal_name(exitcode: Optional[int]) -> str:
    if exitcode is None or exitcode >= 0:
        return ""
    try:
        return f" (killed by {signal.Signals(-exitcode).name})"
    except ValueError:
        return f" (killed by signal {-exitcode})"


def mp_context(start_method: Optional[str] = None) -> multiprocessing.context.BaseContext:
    """The multiprocessing context ranks start from (default ``forkserver`` where the platform has it)."""
    method = start_method or ("forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn")
    if method == "fork":
        raise ValueError(
            "start_method='fork' is refused: forking after torch started its threads can deadlock "
            f"the rank; use one of {START_METHODS}"
        )
    if method not in START_METHODS:
        raise ValueError(f"unknown start_method {method!r}; use one of {START_METHODS}")
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        # Takes effect when the fork server starts (the first forkserver Process of this interpreter);
        # later ones reuse the server and so skip the imports entirely.
        ctx.set_forkserver_preload(["workbench.api", "workbench.parallel.worker"])
    return ctx


class RankGroup:
    """The N rank processes of one sharded run and the parent's ends of their pipes."""

    def __init__(
        self,
        launches: Sequence[RankLaunch],
        rendezvous: Optional[FileRendezvous] = None,
        start_method: Optional[str] = None,
    ):
        self.world_size = len(launches)
        self.procs: List[Any] = []
        self.conns: List[Any] = []
        self.failure: Optional[BaseException] = None  # set when the group was brought down
        self.closed = False
        try:
            self.ctx = mp_context(start_method)
            self.start_method = self.ctx.get_start_method()
            for launch in launches:
                parent_end, child_end = self.ctx.Pipe(duplex=True)
                proc = self.ctx.Process(  # type: ignore[attr-defined]  # typeshed's BaseContext lacks Process
                    target=rank_main, args=(launch, child_end), name=f"workbench-rank{launch.rank}"
                )
                proc.start()
                child_end.close()  # only the rank holds its end: its death closes the pipe
                self.procs.append(proc)
                self.conns.append(parent_end)
        finally:
            # Kill the ranks when this object is collected or the interpreter exits, whatever the user
            # forgot; the finalizer holds the processes, not self.
            self._finalizer = weakref.finalize(self, _shutdown, self.procs, self.conns, rendezvous, CLOSE_TIMEOUT_S)

    @property
    def pids(self) -> List[int]:
        return [p.pid for p in self.procs]

    # ------------------------------------------------------------------ commands
    def request(
        self,
        ranks: Sequence[int],
        command: str,
        args: Sequence[Any] = (),
        kwargs: Optional[Dict[str, Any]] = None,
        on_snapshot: Optional[Callable[[int, Any], None]] = None,
    ) -> Dict[int, Any]:
        """Send ``command`` to ``ranks`` and return ``{rank: (result, state)}`` once all answered."""
        self.check_open()
        for r in ranks:  # a rank that died while idle is reported before anything is sent
            if self.procs[r].exitcode is not None:
                self._bring_down(
                    RankError(r, command, exitcode=self.procs[r].exitcode, others=self._others_line(r, {}))
                )
        for r in ranks:
            try:
                self.conns[r].send((command, tuple(args), dict(kwargs or {})))
            except OSError:  # broken pipe: it died between the check and the send
                self.procs[r].join(KILL_TIMEOUT_S)
                self._bring_down(
                    RankError(r, command, exitcode=self.procs[r].exitcode, others=self._others_line(r, {}))
                )
        return self.collect(ranks, command, on_snapshot)

    def collect(
        self, ranks: Sequence[int], command: str, on_snapshot: Optional[Callable[[int, Any], None]] = None
    ) -> Dict[int, Any]:
        """Wait for one reply from each of ``ranks`` (passing streamed snapshots to ``on_snapshot``)."""
        waiting, results, failures = set(ranks), {}, {}
        deaths: Dict[int, Optional[int]] = {}
        deadline: Optional[float] = None
        try:
            while waiting:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                objs = {self.conns[r]: r for r in waiting}
                objs.update({self.procs[r].sentinel: r for r in waiting})
                ready = multiprocessing.connection.wait(list(objs), timeout)
                if not ready:
                    break  # the grace period ran out: the ranks still waiting are stuck
                # A rank's pipe is read before its death is believed: a reply sent just before exiting counts.
                for r in sorted({objs[o] for o in ready}):
                    if r not in waiting:
                        continue
                    reply = self._drain(r, on_snapshot)
                    if reply is None:
                        continue  # only snapshots so far
                    if reply is _GONE:
                        deaths[r] = self.procs[r].exitcode
                        waiting.discard(r)
                        deadline = time.monotonic()  # a dead rank: nobody else is going to finish
                    elif reply[0] == "error":
                        failures[r] = reply[1]
                        waiting.discard(r)
                        deadline = deadline or time.monotonic() + ERROR_GRACE_S
                    else:
                        results[r] = (reply[1], reply[2])
                        waiting.discard(r)
        except KeyboardInterrupt:
            self.bring_down_quietly(f"interrupted during {command}()")
            raise
        if not failures and not deaths:
            return results
        self._raise_failure(command, ranks, results, failures, deaths, waiting)
        raise AssertionError("unreachable")

    def _drain(self, r: int, on_snapshot) -> Any:
        """Read rank ``r``'s pipe: streamed snapshots go to ``on_snapshot``; returns the final reply,
        None when there is none yet, ``_GONE`` when the rank is dead (its exit code then known)."""
        conn = self.conns[r]
        while True:
            try:
                if not conn.poll():
                    if self.procs[r].exitcode is None:
                        return None
                    raise EOFError  # dead, and nothing left to read
                msg = conn.recv()
            except (EOFError, OSError):
                self.procs[r].join(KILL_TIMEOUT_S)  # the pipe closes as the process exits
                return _GONE
            if msg[0] == "snapshot":
                if on_snapshot is not None:
                    on_snapshot(r, msg[1])
                continue
            return msg

    def _raise_failure(self, command, ranks, results, failures, deaths, stuck) -> None:
        kinds = {f.exc_type for f in failures.values()}
        if not deaths and not stuck and not results and len(kinds) == 1:
            # Every rank raised the same kind of error: none is stuck in a collective. Raise it as one
            # process would (the original exception when it unpickles, this RankError as its cause).
            f = failures[min(failures)]
            alive = command != "start"  # a rank that failed to start has ended
            note = "the ranks are still running" if alive else "no rank started"
            err = RankError.from_failure(
                f, recoverable=alive, others=f"(every rank raised {f.exc_type.rsplit('.', 1)[-1]}; {note})"
            )
            if not alive:
                self.failure = err
                self._stop(polite=False)
            original = _unpickle(f.exception)
            if original is not None:
                raise original from err
            raise err
        first = next(iter(failures)) if failures else next(iter(deaths))  # the first to arrive
        states = {
            **{r: "answered" for r in results},
            **{r: "still busy (stuck in a collective?)" for r in stuck},
            **{r: f"died (exit code {c})" for r, c in deaths.items()},
            **{
                r: f"also failed: {f.exc_type.rsplit('.', 1)[-1]}: {f.message.splitlines()[0] if f.message else ''}"
                for r, f in failures.items()
            },
        }
        if first in failures:
            err = RankError.from_failure(failures[first], others=self._others_line(first, states))
        else:
            err = RankError(first, command, exitcode=deaths[first], others=self._others_line(first, states))
        self._bring_down(err)

    def _others_line(self, failed: int, states: Dict[int, str]) -> str:
        others = [f"rank {r}: {states.get(r, 'idle')}" for r in range(self.world_size) if r != failed]
        return ("every rank was stopped; " + "; ".join(others)) if others else ""

    # ------------------------------------------------------------------ shutting down
    def check_open(self) -> None:
        if self.failure is not None:
            first_line = str(self.failure).splitlines()[0]
            raise RuntimeError(
                f"this sharded workbench was closed after {first_line}; its snapshots are still "
                "readable, create a new one to run again"
            )
        if self.closed:
            raise RuntimeError("this sharded workbench is closed (close() was called); create a new one")

    def _bring_down(self, err: BaseException) -> None:
        """Terminate every rank at once (they may be stuck in a collective), then raise ``err``."""
        self.failure = err
        self._stop(polite=False)
        raise err

    def bring_down_quietly(self, reason: str) -> None:
        """Terminate every rank now (an interrupt) and remember why."""
        self.failure = RuntimeError(reason)
        self._stop(polite=False)

    def close(self) -> None:
        """Stop the ranks: ask them to leave the group and exit, terminate those that do not."""
        self._stop(polite=True)

    def _stop(self, polite: bool) -> None:
        self.closed = True
        if self._finalizer.alive:
            detached = self._finalizer.detach()
            assert detached is not None  # alive: not called yet
            _, _, (procs, conns, rendezvous, timeout), _ = detached
            _shutdown(procs, conns, rendezvous, timeout if polite else 0.0)


def _shutdown(procs, conns, rendezvous, timeout: float) -> None:
    """Polite close within ``timeout``, then terminate; remove the rendezvous directory."""
    deadline = time.monotonic() + timeout
    if timeout > 0:
        for p, c in zip(procs, conns):
            if p.exitcode is None:
                try:
                    c.send(("close", (), {}))
                except OSError:
                    pass
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    _terminate(procs, conns)
    _cleanup_rendezvous(rendezvous)


def _terminate(procs, conns) -> None:
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    deadline = time.monotonic() + KILL_TIMEOUT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join()
    for c in conns:
        c.close()


def _cleanup_rendezvous(rendezvous: Optional[FileRendezvous]) -> None:
    if rendezvous is not None:
        rendezvous.cleanup()


__all__ = ["RankGroup", "RankError", "mp_context", "START_METHODS", "ERROR_GRACE_S"]
