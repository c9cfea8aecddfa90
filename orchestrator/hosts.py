"""One command's view of its hosts: resolved once, one connection each, run in parallel."""

from __future__ import annotations

import queue
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .errors import EXIT_UNEXPECTED, DfoError, HostError
from .transport.base import resource_error  # here, not when needed: out of descriptors, no module can be read

if TYPE_CHECKING:  # config (pydantic, yaml) and the transports (fabric, paramiko) load when a session opens
    from .config.inventory import Inventory, ResolvedHost
    from .transport.base import Transport

T = TypeVar("T")
# connection set-ups at once (SSH handshakes and key exchanges cost CPU here); a host's work after its set-up
# is never held back by it: every host of a command runs at once (issue 35)
PARALLEL = 16


@dataclass
class Outcome(Generic[T]):
    host: str
    value: T | None = None
    error: DfoError | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        if self.error is not None:
            return self.error.exit_code
        code = getattr(self.value, "exit_code", 0)
        return int(code or 0)


def exit_code_of(outcomes: list[Outcome[Any]]) -> int:
    """The worst exit code of the hosts' outcomes (0 when all went well)."""
    return max((o.exit_code for o in outcomes), default=0)


def error_json(err: DfoError) -> dict[str, Any]:
    """A failed host's --json document."""
    return {"ok": False, "error": err.to_json()}


def _resolver_failed(exc: BaseException) -> bool:
    """Whether a socket.gaierror (the resolver's own error) lies under ``exc``, however it was wrapped."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, socket.gaierror):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _unresolved(exc: HostError) -> HostError:
    """A host name that does not resolve (the resolver's error under the HostError) gets a hint."""
    if exc.hint is None and _resolver_failed(exc):
        exc.message += " (the host name does not resolve)"
        exc.hint = ("check the host name (inventory host:, or HostName in ~/.ssh/config for an alias), "
                    "and that DNS answers for it here")
    return exc


def resolve_all(inv: Inventory, names: list[str], path: Path) -> dict[str, ResolvedHost]:
    """Each host's settings, in the order of ``names``, as a loop over ``resolve_host`` gives them: the
    first failing host's error (in that order) is raised. On the OpenSSH transport (the default) the
    first host is resolved here (it fills the caches: which ssh, its version) and the rest at once in
    threads, at most PARALLEL at a time, each waiting for its own `ssh -G`, which 8 hosts in a row paid
    one after another; after a failure no more hosts are begun. The paramiko fallback and local hosts
    resolve in the loop (paramiko's notes on stderr stay in the hosts' order)."""
    from .transport.resolve import resolve_host, ssh_transport

    def on_openssh(n: str) -> bool:
        entry = inv.hosts.get(n)
        t = (entry.transport if entry is not None else None) or inv.defaults.transport or "ssh"
        return t == "openssh" or (t == "ssh" and ssh_transport() == "openssh")

    if len(names) < 3 or not all(on_openssh(n) for n in names):
        return {n: resolve_host(inv, n, path) for n in names}
    got: dict[str, Any] = {names[0]: resolve_host(inv, names[0], path)}
    todo: queue.SimpleQueue[str] = queue.SimpleQueue()
    for n in names[1:]:
        todo.put(n)
    failed = threading.Event()

    def worker() -> None:
        while not failed.is_set():
            try:
                n = todo.get_nowait()
            except queue.Empty:
                return
            try:
                got[n] = resolve_host(inv, n, path)
            except BaseException as exc:  # noqa: BLE001 -- raised in the calling thread below
                got[n] = exc
                failed.set()  # the names not begun come after this one: its error (or an earlier one) wins

    threads = [threading.Thread(target=worker, name="dfo-resolve", daemon=True)
               for _ in range(min(PARALLEL, len(names) - 1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for n in names:
        if isinstance(got.get(n), BaseException):
            raise got[n]
    return {n: got[n] for n in names}


class HostSession:
    """Hosts named by -H, each with at most one connection for the whole command."""

    def __init__(self, inventory: str | Path | None, targets: tuple[str, ...] | list[str]) -> None:
        from .config.inventory import expand_targets, load_inventory
        from .transport import openssh_early

        self.inventory, self.inventory_path = load_inventory(inventory)
        openssh_early.loaded(self.inventory_path)
        self.names = expand_targets(self.inventory, targets, self.inventory_path)
        self.hosts: dict[str, ResolvedHost] = resolve_all(self.inventory, self.names, self.inventory_path)
        self._conns: dict[str, Transport] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_inventory(cls, inv: Inventory, path: Path, names: list[str]) -> HostSession:
        self = cls.__new__(cls)
        self.inventory, self.inventory_path, self.names = inv, path, names
        self.hosts = resolve_all(inv, names, path)
        self._conns, self._lock = {}, threading.Lock()
        return self

    def conn(self, name: str) -> Transport:
        with self._lock:
            c = self._conns.get(name)
            if c is None:
                from .transport import open_connection

                c = self._conns[name] = open_connection(self.hosts[name])
            return c

    def each(self, fn: Callable[[Transport], T], names: list[str] | tuple[str, ...] | None = None,
             on_done: Callable[[Outcome[T]], None] | None = None, parallel: int | None = PARALLEL
             ) -> list[Outcome[T]]:
        """Run ``fn(conn)`` on every host (or on ``names``, some of them) in parallel; one host's failure
        never hides another's. A host keeps its one connection from call to call.

        ``on_done(outcome)`` is called in the calling thread as each host finishes, in the order they
        finish: a slow or dead host never holds back the others' results. The list returned is in
        the order of ``names``. Every host's ``fn`` runs at once; at most ``parallel`` hosts set up their
        connection at once (Transport.establish; None: no bound), and a host's slot is given back as soon
        as its connection is up, so a call that runs as long as the run (tail, a launch's watch window)
        never holds back another host's."""
        names = list(self.names if names is None else names)

        def one(name: str, gate: threading.Semaphore | None = None) -> Outcome[T]:
            try:
                conn = self.conn(name)
                if gate is not None:
                    with gate:  # the set-up only: what fn does then holds no slot
                        conn.establish()
                return Outcome(name, value=fn(conn))
            except DfoError as exc:
                if exc.host is None:
                    exc.host = name
                if isinstance(exc, HostError):
                    _unresolved(exc)
                return Outcome(name, error=exc)
            except Exception as exc:  # noqa: BLE001 - reported per host, never a traceback
                # out of open files, processes or memory here: the limit and what to do (exit 4), not a bug
                err = resource_error(exc, name) or DfoError(f"unexpected error: {type(exc).__name__}: {exc}", host=name,
                                                            hint="set DFO_DEBUG=1 for a traceback; please report it")
                err.__cause__ = exc
                return Outcome(name, error=err)

        if len(names) == 1:
            out = one(names[0])
            if on_done is not None:
                on_done(out)
            return [out]
        # daemon threads, waited on in short slices: Ctrl-C reaches the main thread at once and the
        # command can leave without waiting for calls still in flight on other hosts
        results: dict[str, Outcome[T]] = {}
        done: queue.Queue[Outcome[T]] = queue.Queue()
        gate = threading.Semaphore(parallel) if parallel else None

        def run(name: str) -> None:
            try:
                out = one(name, gate)
            except BaseException as exc:  # noqa: BLE001 - a SystemExit in a worker: its host still gets an
                #                           outcome, so the wait below never hangs
                err = DfoError(f"unexpected error: {type(exc).__name__}: {exc}", host=name)
                err.exit_code = EXIT_UNEXPECTED
                out = Outcome(name, error=err)
            results[name] = out
            done.put(out)

        for n in names:
            try:
                threading.Thread(target=run, args=(n,), daemon=True, name=f"dfo-{n}").start()
            except RuntimeError as exc:  # no thread to be had here (the process limit): that host's error
                err = resource_error(exc, n)
                if err is None:
                    raise
                results[n] = Outcome(n, error=err)
                done.put(results[n])
        for _ in names:
            while True:
                try:
                    out = done.get(timeout=0.2)
                except queue.Empty:
                    continue
                break
            if on_done is not None:
                on_done(out)
        return [results[n] for n in names]

    def close(self) -> None:
        for c in self._conns.values():
            c.close()

    def __enter__(self) -> HostSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
