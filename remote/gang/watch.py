"""Runs on the node: the gang watch, so that a gang ends together with no controller (python3 3.8+, stdlib).

Each node's supervisor runs one GangWatch beside its trainer. Rank 0's is the hub: it listens on a
TCP port (rdzv_port + 1 by default) on rank 0's gang address only (``remote.gang.door.bind_address``: the
address itself when it is one of the node's, else the node's address on the route to a member); every
other node's watch is a member that keeps one connection to the hub. Both ends send a heartbeat line every ``interval``
seconds (2). Then:

* a member whose trainer ended non-zero sends ``failed <how>`` ("exit 3", "signal 9") until the hub
  acknowledges it; the hub's own trainer failing is the same event on the hub;
* the hub records the first failure {host, how}, sends ``gang-failed <host> <how>`` to every member
  (and again to a member that reconnects later), and calls its own ``stop`` callback; each member
  that hears it calls its ``stop``;
* ``silence`` seconds (20) without a valid line from a member is that member ``lost`` (the hub fails
  the gang with how = "lost"); the same silence from the hub is the hub lost (the member records
  {hub, "lost"} and calls ``stop``). A member that never joins within ``join_timeout`` is lost too.
  A dropped connection alone is not a loss: the member reconnects, and only silence counts.

So a failure reaches every node within ``silence`` + one interval, plus the stop's own grace.

Every line is ``SEQ PAYLOAD MAC``: MAC = HMAC-SHA256(secret, session|direction|SEQ|PAYLOAD) in hex,
the session being the hub's and the member's fresh nonces (exchanged in a MAC'd hello/join), and SEQ
rising on each side. A line with a bad MAC, an old SEQ or from a connection that never joined is
ignored (and counted in ``events``): nothing on the network without the gang's secret can stop a
gang, keep a dead member alive, or replay another connection's lines. The secret comes from the
controller on stdin, one per gang run, never in argv or a file another user can read.

Nor can anyone without it starve the hub (remote/gang/door.py): one thread (selectors) accepts and reads
joins; connections that have not joined are bounded (64 in all, 8 per address, 3 s each to send a valid
join; the excess is reset at once); the gang's own member addresses (``addrs``, and any address a member
joined from) are admitted outside those 64, so a member never waits on strangers; a joined member gets its
own thread and never counts against the bound; accept() out of descriptors or buffers (EMFILE, ENFILE,
ENOBUFS) backs off and goes on; the hub raises its soft open-file limit to the hard one (at most 65,536) at
start.

``python3 -m remote.gang.watch`` (a spec JSON line on stdin) runs a command under a watch: the tests
and a manual check use it; the supervisor uses the class.
"""
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Dict

from remote.gang.door import PENDING_TIMEOUT, HubDoor, bind_address, listen_socket, member_ips, raise_nofile
from remote.gang.wire import _Chan, _lines, _mac, _read_line, _same

NOISY = ("bad-line", "busy", "accept-error")  # strangers' events: counted, the first 20 of each kept


class GangWatch(object):
    def __init__(self, rank, hosts, hub, port, secret, stop, gang_id="", interval=2.0, silence=20.0,
                 join_timeout=30.0, on_event=None, bind=None, peer=None, hello_timeout=PENDING_TIMEOUT, addrs=None):
        if len(secret) < 16:
            raise ValueError("the gang secret must be at least 16 bytes")
        self.rank, self.hosts, self.host = rank, list(hosts), hosts[rank]
        self.hub, self.port, self.secret, self.gang_id = hub, int(port), secret, gang_id
        self.stop_cb, self.on_event, self.bind, self.peer = stop, on_event, bind, peer
        self.hello_timeout = float(hello_timeout)
        self.addrs = list(addrs or [])  # the gang addresses, rank order: the hub admits its members' apart
        self.interval, self.silence, self.join_timeout = float(interval), float(silence), float(join_timeout)
        self.lock = threading.Lock()
        self.events = []
        self.bad_lines = 0
        self.noise = {}  # kind -> count, for NOISY kinds
        self.first_failure = None  # {"host", "how"}
        self.own = None  # None while the trainer runs; then "done" or "failed <how>"
        self.stopped = False
        self.done = threading.Event()
        self.t0 = time.monotonic()
        self._threads = []
        self._listener = None
        self._member_ips = set()  # the members' IPs from ``addrs`` (the hub's door admits them apart)
        # hub: rank -> {"state": joining|running|done|failed|lost, "last": monotonic, "chan": _Chan|None}
        self.members: Dict[int, Dict[str, Any]] = dict(
            (r, {"state": "joining", "last": self.t0, "chan": None}) for r in range(1, len(hosts)))
        # member
        self.chan = None
        self.last_heard = self.t0
        self.acked = False
        self.joined_once = False

    # ------------------------------------------------------------------ common
    def event(self, kind, **kw):
        ev = dict(kw, event=kind, t=round(time.time(), 3))
        with self.lock:
            if kind in NOISY:
                n = self.noise[kind] = self.noise.get(kind, 0) + 1
                if kind == "bad-line":
                    self.bad_lines = n
                if n > 20:  # a stranger's flood: counted, not kept
                    return
            self.events.append(ev)
        if self.on_event is not None:
            try:
                self.on_event(ev)
            except Exception:  # noqa: BLE001 - a reporting hook never breaks the watch
                pass

    def _spawn(self, fn, *args):
        t = threading.Thread(target=fn, args=args, daemon=True)
        t.start()
        with self.lock:  # finished threads are dropped: the list stays as long as the threads alive
            self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def _stop_trainer(self, why):
        with self.lock:
            if self.stopped or self.own is not None:
                return
            self.stopped = True
        self.event("stop", why=why)
        self._spawn(self.stop_cb)

    def _record_failure(self, host, how):
        with self.lock:
            first = self.first_failure is None
            if first:
                self.first_failure = {"host": host, "how": how}
        if first:
            self.event("gang-failed", host=host, how=how)
        return first

    def start(self):
        extra = {}
        if self.rank == 0:
            extra["nofile"] = raise_nofile()
            if self.members:  # a gang of one has nobody to hear: nothing listens
                ip = self.bind or bind_address(self.hub, self.peer)
                if not ip:
                    raise OSError(errno.EADDRNOTAVAIL, "the gang address %s is not an address of this node, and no "
                                  "route to %s shows one: the gang watch listens nowhere else" % (self.hub, self.peer))
                self._listener = listen_socket(ip, self.port)
                self.port = self._listener.getsockname()[1]
                self._member_ips = member_ips(self.addrs[1:])
                extra["address"], extra["members"] = ip, sorted(self._member_ips)
                self._spawn(self._accept_loop)
            self._spawn(self._hub_ticker)
        else:
            self._spawn(self._member_loop)
        self.event("start", role="hub" if self.rank == 0 else "member", port=self.port, **extra)
        return self

    def trainer_ended(self, code, how=None):
        """Tell the watch that this node's trainer ended with ``code`` (0 = success)."""
        how = how or ("exit %d" % code if code >= 0 else "signal %d" % -code)
        with self.lock:
            if self.own is not None:
                return
            self.own = "done" if code == 0 else "failed " + how
        self.event("trainer-ended", code=code, how=how)
        if self.rank == 0 and code != 0:
            self._fail_gang(self.host, how)
        self._check_done()

    def wait(self, timeout=None):
        return self.done.wait(timeout)

    def state(self):
        with self.lock:
            ff = dict(self.first_failure) if self.first_failure else None
            own = self.own
        return {"role": "hub" if self.rank == 0 else "member", "host": self.host, "first_failure": ff,
                "state": "failed" if ff else ("succeeded" if own == "done" and self.done.is_set() else "running"),
                "members": dict((self.hosts[r], m["state"]) for r, m in self.members.items())
                if self.rank == 0 else None}

    def close(self):
        self.done.set()
        if self._listener is not None:
            try:
                self._listener.close()
            except OSError:
                pass
        for ch in [m["chan"] for m in self.members.values()] + [self.chan]:
            if ch is not None:
                ch.close()

    # ------------------------------------------------------------------ hub
    def _fail_gang(self, host, how):
        if not self._record_failure(host, how):
            return
        for m in list(self.members.values()):
            ch = m["chan"]
            if ch is not None:
                ch.send("gang-failed %s %s" % (host, how))
        if host != self.host:
            self._stop_trainer("gang failed: %s %s" % (host, how))

    def _check_done(self):
        with self.lock:
            own = self.own
            states = [m["state"] for m in self.members.values()]
        if self.rank == 0:
            if own is not None and all(s in ("done", "failed", "lost") for s in states):
                self.done.set()
        elif own is not None and self.acked:
            self.done.set()

    def _accept_loop(self):
        HubDoor(self._listener, self.secret, self.gang_id, self.members, self.done, self.event,
                lambda *a: self._spawn(self._hub_session, *a), self.hello_timeout, members=self._member_ips).run()

    def _hub_session(self, sock, ip, rank, session, buf):
        chan = _Chan(sock, self.secret, session, "h", "m")
        m = self.members[rank]
        old, m["chan"], m["last"] = m["chan"], chan, time.monotonic()
        if old is not None:
            old.close()
        if m["state"] == "joining":
            m["state"] = "running"
        self.event("joined", host=self.hosts[rank], peer=ip)
        ff = self.first_failure
        if ff is not None:
            chan.send("gang-failed %s %s" % (ff["host"], ff["how"]))
        first = buf.split(b"\n")  # lines that came with the join
        buf = first.pop()
        lines, eof = [p.decode("utf-8", "replace") for p in first], False
        while True:
            for ln in lines:
                payload = chan.check(ln)
                if payload is None:
                    self.event("bad-line", host=self.hosts[rank], where="member")
                    continue
                m["last"] = time.monotonic()
                self._hub_line(rank, payload, chan)
            if eof or self.done.is_set() or chan.closed:
                break
            lines, buf, eof = _lines(sock, buf, self.interval)
        if m["chan"] is chan:
            m["chan"] = None
        chan.close()

    def _hub_line(self, rank, payload, chan):
        m, host = self.members[rank], self.hosts[rank]
        if payload == "done":
            if m["state"] in ("joining", "running"):
                m["state"] = "done"
            chan.send("ack")
            self.event("member-ended", host=host, how="done")
            self._check_done()
        elif payload.startswith("failed "):
            how = payload[len("failed "):]
            if m["state"] in ("joining", "running"):
                m["state"] = "failed"
            self.event("member-ended", host=host, how=how)
            self._fail_gang(host, how)  # gang-failed goes out before the ack: the member reads both
            chan.send("ack")
            self._check_done()

    def _hub_ticker(self):
        while not self.done.wait(self.interval / 2):
            now = time.monotonic()
            for rank, m in list(self.members.items()):
                ch = m["chan"]
                if ch is not None:
                    ch.send("hb")
                limit = self.join_timeout if m["state"] == "joining" else self.silence
                if m["state"] in ("joining", "running") and now - m["last"] > limit:
                    m["state"] = "lost"
                    self.event("member-lost", host=self.hosts[rank], silent=round(now - m["last"], 1))
                    if ch is not None:
                        ch.close()
                    self._fail_gang(self.hosts[rank], "lost")
                    self._check_done()

    # ------------------------------------------------------------------ member
    def _final(self):
        with self.lock:
            return self.own

    def _member_loop(self):
        while not self.done.is_set():
            limit = self.silence if self.joined_once else self.join_timeout
            if time.monotonic() - self.last_heard > limit:
                self._hub_lost()
                return
            try:
                sock = socket.create_connection((self.hub, self.port), timeout=min(5.0, self.silence))
            except OSError:
                time.sleep(min(1.0, self.interval))
                continue
            chan = self._join(sock)
            if chan is None:
                time.sleep(min(1.0, self.interval))
                continue
            self.chan, self.last_heard, self.joined_once = chan, time.monotonic(), True
            self._member_session(chan, sock)
            self.chan = None
            chan.close()
            self._check_done()

    def _join(self, sock):
        line = _read_line(sock, min(10.0, self.silence))
        parts = (line or "").split(" ")
        if len(parts) != 3 or parts[0] != "hello" or not _same(parts[2], _mac(self.secret, "hello", self.gang_id,
                                                                                   parts[1])):
            self.event("bad-line", where="hello")
            sock.close()
            return None
        mine = os.urandom(16).hex()
        try:
            sock.sendall(("join %d %s %s\n" % (self.rank, mine, _mac(self.secret, "join", self.gang_id, parts[1],
                                                                      self.rank, mine))).encode())
        except OSError:
            sock.close()
            return None
        self.event("joined", hub=self.hub)
        return _Chan(sock, self.secret, parts[1] + mine, "m", "h")

    def _member_session(self, chan, sock):
        buf, next_hb, sent_final = b"", 0.0, False
        while not self.done.is_set() and not chan.closed:
            now = time.monotonic()
            final = self._final()
            pending = final is not None and not self.acked
            if pending and not sent_final:  # the trainer just ended: say so at once
                chan.send(final)
                sent_final, next_hb = True, now + self.interval
            elif now >= next_hb:
                chan.send(final if pending else "hb")  # the final line again until the hub acks it
                next_hb = now + self.interval
            if now - self.last_heard > self.silence:
                self._hub_lost()
                return
            lines, buf, eof = _lines(sock, buf, min(self.interval / 2, 0.2))
            for ln in lines:
                payload = chan.check(ln)
                if payload is None:
                    self.event("bad-line", where="hub")
                    continue
                self.last_heard = time.monotonic()
                if payload == "ack":
                    self.acked = True
                    self._check_done()
                elif payload.startswith("gang-failed "):
                    host, _, how = payload[len("gang-failed "):].partition(" ")
                    self._record_failure(host, how)
                    self._stop_trainer("gang failed: %s %s" % (host, how))
                    self._check_done()
            if eof:
                return

    def _hub_lost(self):
        self.event("hub-lost", host=self.hosts[0], silent=round(time.monotonic() - self.last_heard, 1))
        own = self._final() or ""
        if own.startswith("failed "):  # this node's own failure came first, as far as it knows
            self._record_failure(self.host, own[len("failed "):])
        self._record_failure(self.hosts[0], "lost")
        self._stop_trainer("hub lost: %s" % self.hosts[0])
        self.done.set()


# ---------------------------------------------------------------------- a command under a watch
def _run(spec):
    proc = subprocess.Popen(spec["command"], start_new_session=True)
    grace = float(spec.get("stop_grace", 5))

    def stop():
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass

    def emit(ev):
        sys.stdout.write(json.dumps(ev) + "\n")
        sys.stdout.flush()

    emit({"event": "trainer", "pid": proc.pid})
    w = GangWatch(int(spec["rank"]), spec["hosts"], spec["hub"], int(spec["port"]), bytes.fromhex(spec["secret"]),
                  stop, gang_id=spec.get("gang_id", ""), interval=float(spec.get("interval", 2)),
                  silence=float(spec.get("silence", 20)), join_timeout=float(spec.get("join_timeout", 30)),
                  on_event=emit, bind=spec.get("bind"), peer=spec.get("peer"), addrs=spec.get("addrs")).start()
    code = proc.wait()
    w.trainer_ended(code)
    w.wait(float(spec.get("linger", 60)))
    emit({"event": "final", "state": w.state(), "code": code})
    w.close()
    return code


if __name__ == "__main__":
    code = _run(json.loads(sys.stdin.readline()))
    sys.exit(code if 0 <= code < 256 else 128 - code)
