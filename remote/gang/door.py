"""The gang hub's door (python3 3.8+, stdlib): who may take a connection slot before proving itself.

The hub (remote/gang/watch.py) and the address check's ``listen`` op (remote/gang/ops.py) both answer
connections that have not shown anything yet: a join MAC'd with the gang's secret, or the check's token.
Anyone on the network can open such a connection, so they are bounded (issue 19):

* ``_Pending``: strangers (any address that is not the gang's) get at most 64 slots in all and 8 from one
  address, each for 3 s; when every slot is taken the address holding the most gives up its oldest to a
  newcomer from an address holding fewer, otherwise the newcomer is reset at once. The gang's own member
  addresses (its plan's addresses, and any address a member has joined from) are admitted outside those
  64, so a member never waits on strangers (issue 32): up to 128 pending from one member address (4,096
  from all of them), and a newcomer from a member address is never refused: when its address holds 128 it
  takes that address's oldest slot. Before any pending connection is evicted, what it has sent is read: a
  valid join is taken in, not evicted. A joined member is never one of them.
* ``HubDoor``: one thread with ``selectors`` (any descriptor number, unlike select()) reads joins, then
  accepts (in batches of 64) and says hello; a valid join is handed over (``on_join``), which gives it its
  own thread.
  accept() out of descriptors or buffers (EMFILE, ENFILE, ENOBUFS, ENOMEM) frees the oldest pending
  connection (a stranger's first), backs off briefly and goes on; only ``done`` ends the loop.
* ``raise_nofile``: the hub's process raises its soft open-file limit to the hard one (at most 65,536).
* ``bind_address``: the one address the hub (and the check of its port) listens on: rank 0's gang address,
  or, where that is NAT'd, the node's own address on the route to a member. Never every address.
"""
import errno
import os
import selectors
import socket
import struct
import time
from typing import Any, Iterable, Optional, Set, Tuple

from remote.gang.wire import MAX_LINE, _mac, _num, _same

PENDING_MAX = 64  # connections that have not joined (or shown the check's token), in all
PENDING_PER_PEER = 8  # ... from one address: one host outside the gang cannot take every slot
PENDING_TIMEOUT = 3.0  # seconds a new connection has to send its join (one round trip is enough)
# From one of the gang's own member addresses, outside the strangers' 64: a newcomer from there is never refused
# (it takes that address's oldest slot when the address holds this many). Whoever else connects from a member's
# address (a process on that node, a spoofer that completes TCP handshakes) must then open this many connections
# between the member's connect and its join (one round trip) to push the member out: two of the door's accept
# batches at least, and joins are read between batches.
MEMBER_PENDING_PER_ADDR = 128
MEMBER_PENDING_MAX = 4096  # ... from all member addresses together (descriptors: within NOFILE_CAP)
ACCEPT_BATCH = 64  # accepts in a row; then the pending connections' joins are read
# accept() errors that say "out of descriptors or buffers for now": back off and go on accepting
ACCEPT_LATER = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
NOFILE_CAP = 65536  # the hub's soft open-file limit is raised to the hard one, up to this


def raise_nofile(cap=NOFILE_CAP):
    """Raise this process's soft RLIMIT_NOFILE to the hard limit (at most ``cap``); the soft limit now, or None."""
    try:
        import resource
    except ImportError:  # not a Unix
        return None
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = cap if hard == resource.RLIM_INFINITY else min(hard, cap)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
    except (ValueError, OSError):
        return None
    return soft


def _ip(address):
    try:
        return socket.getaddrinfo(address, None, 0, socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, IndexError):
        return None


def _is_mine(ip):
    """True when ``ip`` is an address of this node (a socket can be bound to it)."""
    if ip in ("0.0.0.0", "::"):
        return False
    s = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.bind((ip, 0))
        return True
    except OSError:
        return False
    finally:
        s.close()


def bind_address(address, peer=None):
    """The one IP a gang service of this node listens on: ``address`` (the node's gang address, a name is
    resolved) when it is one of this node's; else (a NAT'd gang address) this node's own address on the
    route to ``peer``. None when neither is known: then nothing should listen, rather than on every address."""
    ip = _ip(address) if address else None
    if ip and _is_mine(ip):
        return ip
    pip = _ip(peer) if peer else None
    if not pip:
        return None
    s = socket.socket(socket.AF_INET6 if ":" in pip else socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((pip, 9))  # UDP: no packet leaves; the kernel picks the route and the source address
        mine = s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()
    return mine if _is_mine(mine) else None


def listen_socket(ip, port, backlog=512):
    """A non-blocking TCP listener on ``ip`` only."""
    s = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((ip, port))
        s.listen(backlog)
        s.setblocking(False)
    except OSError:
        s.close()
        raise
    return s

def _peer_ip(peer):
    """The address a connection comes from, IPv4-mapped IPv6 written as IPv4."""
    ip = peer[0] if isinstance(peer, tuple) and peer else str(peer)
    return ip[7:] if ip.startswith("::ffff:") and "." in ip else ip


def _abort(sock):
    """Close a stranger's connection at once, with a reset (no FIN handshake, no TIME_WAIT left here)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class _Pending(object):
    """The connections that have not proved themselves yet, in two pools.

    Strangers: at most ``cap`` in all and ``per_peer`` from one address, each for ``timeout`` seconds. When
    every slot is taken, the address holding the most gives up its oldest to a newcomer from an address
    holding fewer; otherwise the newcomer is refused at once.

    Members' addresses (``members``, which may grow): outside the strangers' pool, at most ``member_per_peer``
    from one address and ``member_cap`` in all; a newcomer from there is never refused: it takes its own
    address's oldest slot (or, when all member slots are taken, the oldest slot of the member address holding
    the most). A joined member is never in either pool (its connection leaves as it joins)."""

    def __init__(self, cap=PENDING_MAX, per_peer=PENDING_PER_PEER, timeout=PENDING_TIMEOUT, members=(),
                 member_per_peer=MEMBER_PENDING_PER_ADDR, member_cap=MEMBER_PENDING_MAX):
        self.cap, self.per_peer, self.timeout = cap, per_peer, float(timeout)
        self.member_per_peer, self.member_cap = member_per_peer, member_cap
        self.members = set(members)  # the gang's member addresses
        self.conns = {}  # sock -> {"peer", "member", "deadline", "buf", ...}
        self.by_peer = {}  # strangers: peer -> [sock, ...], oldest first
        self.member_by_peer = {}  # members' addresses: peer -> [sock, ...], oldest first
        self.strangers = 0  # len(self.conns) == self.strangers + members' pending

    def __len__(self):
        return len(self.conns)

    def choose(self, peer: str) -> Tuple[bool, Optional[socket.socket]]:
        """(admit, victim) for a newcomer from ``peer``: admit = whether it may have a slot; victim = the
        pending socket that must make room for it first (still in the set), or None."""
        if peer in self.members:
            mine = self.member_by_peer.get(peer, [])
            if len(mine) >= self.member_per_peer:
                return True, mine[0]
            if len(self.conns) - self.strangers >= self.member_cap:
                top = max(self.member_by_peer, key=lambda p: len(self.member_by_peer[p]))
                return True, self.member_by_peer[top][0]
            return True, None
        mine = len(self.by_peer.get(peer, ()))
        if mine >= self.per_peer:
            return False, None
        if self.strangers >= self.cap:
            top = max(self.by_peer, key=lambda p: len(self.by_peer[p]))
            if len(self.by_peer[top]) <= mine + 1:
                return False, None
            return True, self.by_peer[top][0]
        return True, None

    def add(self, sock: socket.socket, peer: str, **data: Any) -> None:
        member = peer in self.members
        self.conns[sock] = dict(data, peer=peer, member=member, deadline=time.monotonic() + self.timeout, buf=b"")
        (self.member_by_peer if member else self.by_peer).setdefault(peer, []).append(sock)
        if not member:
            self.strangers += 1

    def admit(self, sock, peer, **data):
        """(admitted, evicted): not admitted = close ``sock`` now; evicted = a pending socket, already dropped
        from the set, for the caller to close (or None)."""
        ok, victim = self.choose(peer)
        if not ok:
            return False, None
        if victim is not None:
            self.drop(victim)
        self.add(sock, peer, **data)
        return True, victim

    def drop(self, sock):
        """Forget ``sock``; its entry, or None."""
        ent = self.conns.pop(sock, None)
        if ent is not None:
            pool = self.member_by_peer if ent["member"] else self.by_peer
            if not ent["member"]:
                self.strangers -= 1
            socks = pool.get(ent["peer"], [])
            if sock in socks:
                socks.remove(sock)
            if not socks:
                pool.pop(ent["peer"], None)
        return ent

    def oldest(self):
        """The oldest pending stranger; the oldest pending connection when no stranger is pending."""
        socks = [s for s, ent in self.conns.items() if not ent["member"]] or list(self.conns)
        return min(socks, key=lambda s: self.conns[s]["deadline"]) if socks else None

    def expired(self, now=None):
        now = time.monotonic() if now is None else now
        return [s for s, ent in self.conns.items() if ent["deadline"] <= now]

    def feed(self, sock):
        """Read what ``sock`` sent: (line, rest) once a whole line is there, (None, b"") while not yet, or
        (False, b"") when it closed, failed or sent too much without a newline."""
        ent = self.conns.get(sock)
        if ent is None:
            return False, b""
        try:
            chunk = sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return None, b""
        except OSError:
            return False, b""
        if not chunk:
            return False, b""
        ent["buf"] += chunk
        if b"\n" not in ent["buf"]:
            return (False, b"") if len(ent["buf"]) > MAX_LINE else (None, b"")
        line, _, rest = ent["buf"].partition(b"\n")
        return line, rest


def member_ips(addresses: Optional[Iterable[Any]]) -> Set[str]:
    """The IPs of the gang's member addresses (a name: every address it resolves to; one that does not resolve
    is left out), written as connections show them (``_peer_ip``)."""
    out: Set[str] = set()
    for a in addresses or ():
        if not isinstance(a, str) or not a:
            continue
        try:
            found = socket.getaddrinfo(a, None, 0, socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError, ValueError):
            continue
        out.update(_peer_ip((ai[4][0],)) for ai in found)
    return out


class HubDoor(object):
    """The hub's accept loop: ``run()`` until ``done`` is set. ``event(kind, **kw)`` reports ("bad-line" for a
    connection that left without a valid join, "busy" for one refused or evicted, "accept-error");
    ``on_join(sock, ip, rank, session, rest)`` takes a valid join's socket (blocking again), the member's
    rank, the session (hub nonce + member nonce) and the bytes that came after the join line. ``members``:
    the members' IPs (``member_ips``), admitted outside the strangers' pool; an address a member joins from
    is added to them (one per rank: the latest)."""

    def __init__(self, listener, secret, gang_id, ranks, done, event, on_join, timeout=PENDING_TIMEOUT,
                 members=()):
        self.listener, self.secret, self.gang_id, self.ranks = listener, secret, gang_id, set(ranks)
        self.done, self.event, self.on_join = done, event, on_join
        self.planned = set(members)
        self.joined_from = {}  # rank -> the address its last valid join came from
        self.pending = _Pending(timeout=timeout, members=self.planned)
        self.sel = selectors.DefaultSelector()

    def drop(self, sock, why=None):
        ent = self.pending.drop(sock)
        try:
            self.sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        _abort(sock)
        if why is not None and ent is not None:
            self.event("bad-line", peer=ent["peer"], where="join", why=why)

    def run(self):
        try:
            self.sel.register(self.listener, selectors.EVENT_READ, None)
            while not self.done.is_set():
                try:
                    ready = self.sel.select(0.25)
                except OSError:  # the listener went away under us (close()): wait for done
                    self.done.wait(0.1)
                    continue
                # joins first, then new connections: a member's join that is here is never pushed out by
                # the batch of connections behind it
                for key, _ in sorted(ready, key=lambda kv: kv[0].data is None):
                    if key.data is None:
                        self._accept_batch()
                    elif key.fileobj in self.pending.conns:
                        self._input(key.fileobj, key.data)
                for sock in self.pending.expired():
                    self.drop(sock, "timeout")
        finally:
            for sock in list(self.pending.conns):
                self.drop(sock)
            self.sel.close()

    def _accept_batch(self):
        for _ in range(ACCEPT_BATCH):  # a batch, then the pending connections get their turn
            try:
                sock, peer = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if self.done.is_set() or exc.errno in (errno.EBADF, errno.EINVAL):  # closing
                    self.done.wait(0.1)
                    return
                if exc.errno not in ACCEPT_LATER:  # ECONNABORTED and the like: that connection only
                    continue
                self.event("accept-error", error=errno.errorcode.get(exc.errno, str(exc.errno)),
                           pending=len(self.pending))
                old = self.pending.oldest()  # free a descriptor for the next accept, then back off briefly
                if old is not None:
                    self.drop(old)
                self.done.wait(0.05)
                return
            self._admit(sock, _peer_ip(peer))

    def _admit(self, sock, ip):
        ok, victim = self.pending.choose(ip)
        if victim is not None:
            self._input(victim, self.pending.conns[victim]["peer"])  # a join already there is taken in
            if victim in self.pending.conns:
                self.drop(victim)
                self.event("busy", peer=ip, pending=len(self.pending))
        if not ok:
            _abort(sock)
            self.event("busy", peer=ip, pending=len(self.pending))
            return
        nonce = os.urandom(16).hex()
        self.pending.add(sock, ip, nonce=nonce)
        hello = ("hello %s %s\n" % (nonce, _mac(self.secret, "hello", self.gang_id, nonce))).encode()
        try:
            sock.setblocking(False)
            if sock.send(hello) != len(hello):  # a fresh socket's buffer takes ~100 bytes, or it is gone
                raise OSError(errno.EAGAIN, "hello not sent whole")
            self.sel.register(sock, selectors.EVENT_READ, ip)
        except OSError:
            self.pending.drop(sock)
            _abort(sock)

    def _input(self, sock, ip):
        line, rest = self.pending.feed(sock)
        if line is None:
            return
        if line is False:
            self.drop(sock, "closed")
            return
        nonce = self.pending.conns[sock]["nonce"]
        parts = line.decode("utf-8", "replace").split(" ")
        if len(parts) != 4 or parts[0] != "join" or not _num(parts[1]) or not _same(
                parts[3], _mac(self.secret, "join", self.gang_id, nonce, parts[1], parts[2])) \
                or int(parts[1]) not in self.ranks:
            self.drop(sock, "bad join")
            return
        self.pending.drop(sock)
        self.sel.unregister(sock)
        rank = int(parts[1])
        if self.joined_from.get(rank) != ip:  # the member proved itself from here: its address from now on
            self.joined_from[rank] = ip
            self.pending.members = self.planned | set(self.joined_from.values())
        try:
            sock.setblocking(True)
        except OSError:
            sock.close()
            return
        self.on_join(sock, ip, rank, nonce + parts[2], rest)
