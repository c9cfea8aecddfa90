"""Runs on the node: the gang's checks before a launch (python3 3.8+, stdlib only).

``python3 -m remote.gang`` reads ``{"op": ...}`` on stdin:

* ``facts`` {workspace, job, manifests: {"data": DEST, "model": DEST}} -> {"provision": {ok, python,
  packages} | null, "manifests": {kind: {path, source, files, bytes, digest} | null}}: what the
  controller compares across nodes (orchestrator/steps/gang.py preflight_problems). Read only: the
  manifest's journal is folded in memory, its lock is not taken.
* ``listen`` {ports, token, expect, window, bind} (rank 0): listen on every port until ``expect`` peers
  have shown the token on each port, or ``window`` seconds -> {"ok", "port", "error", "peers": {port:
  [rank, ...]}}. A peer proves it reached this listener by echoing the token. A port in ``bind`` {ports,
  address, peer} listens where the gang watch will: ``bind_address(address, peer)`` only; the others on
  every address (as torchrun's store). Connections that have not shown the token are bounded
  (gangdoor._Pending: 64, 8 per address, 3 s each); the gang's own addresses (``members``) are admitted
  apart from those 64, as at the hub (issue 32); selectors, so any number of descriptors works.
* ``connect`` {address, ports, token, rank, window, connect_timeout} (the others): a TCP connection
  to address:port for each port, retried until ``window`` -> {"ok", "port", "error"}.
* ``iface`` {address, peer} -> {"ifname": str|null}: the interface gloo should use (GLOO_SOCKET_IFNAME).
"""
import errno
import hashlib
import json
import os
import re
import selectors
import socket
import subprocess
import time
from typing import Dict, List, Optional, Set, TypedDict

from remote._proto import serve
from remote.gang.door import ACCEPT_LATER, _abort, _ip, _peer_ip, _Pending, bind_address, listen_socket, member_ips
from remote.lib.fsutil import node_path, workspace

# --------------------------------------------------------------------------- requests and replies
# python3 -m remote.gang reads one JSON object, {"op": NAME, ...}; the module docstring says what each does.


class FactsRequest(TypedDict, total=False):
    """``facts`` -> ``{"provision": {ok, python, packages} | None, "manifests": {kind: {path, source, files,
    bytes, digest} | None}, "gpus": int | None}``."""
    op: str
    workspace: str
    job: str
    manifests: Dict[str, str]  # kind ("data", "model") -> the dest whose manifest to read


class ListenRequest(TypedDict, total=False):
    """``listen`` (rank 0) -> CheckReply + ``peers``: {port: [rank, ...]}."""
    op: str
    ports: List[int]
    token: str
    expect: int
    window: float
    members: List[str]  # the other nodes' gang addresses: admitted apart from strangers


class ConnectRequest(TypedDict, total=False):
    """``connect`` (the other ranks) -> CheckReply."""
    op: str
    address: str
    ports: List[int]
    token: str
    rank: int
    window: float
    connect_timeout: float


class CheckReply(TypedDict, total=False):
    ok: bool
    port: Optional[int]  # the port that failed
    error: Optional[str]
    peers: Dict[str, List[int]]


class IfaceRequest(TypedDict, total=False):
    """``iface`` -> ``{"ifname": str | None}``: the interface gloo should use (GLOO_SOCKET_IFNAME)."""
    op: str
    address: str
    peer: Optional[str]


# --------------------------------------------------------------------------- facts


def provision_facts(workspace, job):
    path = "%s/.dfo/provision/%s.json" % (workspace.rstrip("/") or "", job)
    try:
        with open(path) as fh:
            rec = json.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict):
        return None
    return {"ok": bool(rec.get("ok")), "python": rec.get("python"), "packages": rec.get("packages_after") or {},
            "finished": rec.get("finished"), "path": path}


def _read(path):
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:
        return None


def manifest_facts(dest):
    """A summary of DEST/.dfo/manifest.json plus its journal: files, bytes and a digest of every
    (name, size, ETag) of the current source. None when there is no manifest."""
    meta = os.path.join(dest, ".dfo")
    raw = _read(os.path.join(meta, "manifest.json"))
    journal = _read(os.path.join(meta, "journal.jsonl")) or b""
    doc = None
    if raw is not None:
        try:
            doc = json.loads(raw.decode("utf-8"))
        except ValueError:
            doc = None
    if not isinstance(doc, dict) and not journal.strip():
        return None
    doc = doc if isinstance(doc, dict) else {}
    source = doc.get("source")
    files = dict(doc.get("files") or {})
    for line in journal.split(b"\n"):
        try:
            rec = json.loads(line.decode("utf-8"))
        except ValueError:
            continue
        if not isinstance(rec, dict) or "k" not in rec:
            continue
        if source is None:
            source = rec.get("source")
        if rec.get("deleted"):
            files.pop(rec["k"], None)
        elif rec.get("source") == source:
            files[rec["k"]] = rec
    h = hashlib.sha256(("source %s\n" % source).encode("utf-8"))
    total = 0
    for rel in sorted(files):
        ent = files[rel]
        total += int(ent.get("size") or 0)
        h.update(("%s\0%s\0%s\n" % (rel, ent.get("size"), ent.get("etag"))).encode("utf-8"))
    return {"path": dest, "source": source, "files": len(files), "bytes": total, "digest": h.hexdigest()}


def gpu_count(proc="/proc/driver/nvidia/gpus"):
    """The node's NVIDIA GPUs as the driver lists them (one folder each), honouring
    CUDA_VISIBLE_DEVICES when it is a plain list; 0 without the driver."""
    try:
        n = len(os.listdir(proc))
    except OSError:
        return 0
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is not None and vis.strip() != "":
        n = min(n, len([v for v in vis.split(",") if v.strip() and not v.strip().startswith("-")]))
    elif vis is not None:
        n = 0
    return n


def facts(req: FactsRequest):
    out = {"provision": provision_facts(workspace(req.get("workspace")), req["job"]), "manifests": {},
           "gpus": gpu_count()}
    for kind, dest in sorted((req.get("manifests") or {}).items()):
        out["manifests"][kind] = manifest_facts(node_path(dest)) if dest else None
    return out


# --------------------------------------------------------------------------- address check
HELLO = b"dfo-gang-check "


def _wildcard(port):
    """A listening socket on every address of this node (IPv6 and IPv4 where the node has both)."""
    try:
        s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        except OSError:
            pass
    except OSError:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("::" if s.family == socket.AF_INET6 else "", port))
    except OSError:
        s.close()
        if s.family != socket.AF_INET6:
            raise
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("", port))
    s.listen(64)
    s.setblocking(False)
    return s


def _open_listeners(ports, bind):
    """{port: socket}, or (port, error) for the first port that cannot listen."""
    socks = {}
    bind_ports = set(int(p) for p in bind.get("ports") or [])
    for p in ports:
        try:
            if p in bind_ports:
                ip = bind_address(bind.get("address") or "", bind.get("peer"))
                if ip is None:
                    raise OSError(errno.EADDRNOTAVAIL, "the gang address %s is not an address of this node, and "
                                  "no route to %s shows one" % (bind.get("address"), bind.get("peer")))
                socks[p] = listen_socket(ip, p)
            else:
                socks[p] = _wildcard(p)
        except OSError as exc:
            for s in socks.values():
                s.close()
            why = "port in use (another process listens there)" if exc.errno == errno.EADDRINUSE else (
                exc.strerror or str(exc))
            return None, (p, why)
    return socks, None


def listen(req: ListenRequest):
    ports = [int(p) for p in req["ports"]]
    token = req["token"].encode("ascii")
    expect = int(req.get("expect") or 0)
    deadline = time.monotonic() + float(req.get("window") or 30)
    socks, failed = _open_listeners(ports, req.get("bind") or {})
    if failed:
        return {"ok": False, "port": failed[0], "error": failed[1], "peers": {}}
    peers: Dict[int, Set[str]] = dict((p, set()) for p in ports)
    pending = _Pending(members=member_ips(req.get("members")))
    sel = selectors.DefaultSelector()

    def drop(c):
        pending.drop(c)
        sel.unregister(c)
        _abort(c)

    try:
        for p, ls in socks.items():
            sel.register(ls, selectors.EVENT_READ, (True, p))
        while time.monotonic() < deadline and any(len(v) < expect for v in peers.values()):
            for key, _ in sel.select(0.2):
                listener, port = key.data
                c: socket.socket = key.fileobj  # type: ignore[assignment]  # registered sockets only
                if listener:
                    _accept_batch(c, port, pending, sel, drop)
                    continue
                line, _ = pending.feed(c)
                if line is None:
                    continue
                if line and line.startswith(HELLO + token + b" "):
                    rank = line[len(HELLO + token) + 1:].decode("ascii", "replace")
                    pending.drop(c)
                    sel.unregister(c)
                    try:
                        c.setblocking(True)
                        c.settimeout(2)
                        c.sendall(b"ok " + token + b"\n")
                        peers[port].add(rank)
                    except OSError:
                        pass
                    c.close()
                else:
                    drop(c)
            for c in pending.expired():
                drop(c)
        return {"ok": all(len(v) >= expect for v in peers.values()), "port": None, "error": None,
                "peers": dict((str(p), sorted(v)) for p, v in peers.items())}
    finally:
        for c in list(pending.conns):
            drop(c)
        sel.close()
        for s in socks.values():
            s.close()


def _accept_batch(ls, port, pending, sel, drop):
    for _ in range(64):  # a batch, then the pending connections get their turn
        try:
            c, addr = ls.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            if exc.errno not in ACCEPT_LATER:  # ECONNABORTED and the like: that connection only
                continue
            old = pending.oldest()  # out of descriptors for now: free the oldest pending one, back off
            if old is not None:
                drop(old)
            time.sleep(0.05)
            return
        ok, evicted = pending.admit(c, _peer_ip(addr))
        if evicted is not None:
            sel.unregister(evicted)
            _abort(evicted)
        if not ok:
            _abort(c)
            continue
        c.setblocking(False)
        sel.register(c, selectors.EVENT_READ, (False, port))


def _connect_once(address, port, token, rank, timeout):
    s = socket.create_connection((address, port), timeout=timeout)
    try:
        s.settimeout(timeout)
        s.sendall(HELLO + token + (" %s\n" % rank).encode("ascii"))
        buf = b""
        while b"\n" not in buf:
            chunk = s.recv(256)
            if not chunk:
                break
            buf += chunk
        return buf.split(b"\n")[0] == b"ok " + token
    finally:
        s.close()


def connect(req: ConnectRequest):
    address, token, rank = req["address"], req["token"].encode("ascii"), req.get("rank", "?")
    timeout = float(req.get("connect_timeout") or 5)
    deadline = time.monotonic() + float(req.get("window") or 30)
    for port in [int(p) for p in req["ports"]]:
        last = "no answer"
        while True:
            try:
                if _connect_once(address, port, token, rank, timeout):
                    break
                last = "something else answers on that port (not rank 0's check)"
            except socket.timeout:
                last = "connection timed out (a firewall drops it, or the address is wrong)"
            except socket.gaierror as exc:
                return {"ok": False, "port": port, "error": "cannot resolve %s: %s" % (address, exc.strerror)}
            except OSError as exc:
                last = {errno.ECONNREFUSED: "connection refused (nothing listens there: wrong address?)",
                        errno.EHOSTUNREACH: "no route to host", errno.ENETUNREACH: "network unreachable",
                        errno.ECONNRESET: "connection reset"}.get(exc.errno or 0, exc.strerror or str(exc))
            if time.monotonic() + 0.5 >= deadline:
                return {"ok": False, "port": port, "error": last}
            time.sleep(0.5)
    return {"ok": True, "port": None, "error": None}


# --------------------------------------------------------------------------- GLOO_SOCKET_IFNAME
def local_addresses():
    """{ip: ifname} of this node: `ip -o addr`, else /proc/net/if_inet6 plus SIOCGIFADDR per interface."""
    out = {}
    try:
        text = subprocess.run(["ip", "-o", "addr", "show"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              universal_newlines=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    for line in text.splitlines():
        m = re.match(r"\d+:\s+(\S+)\s+inet6?\s+([^/\s]+)", line)
        if m:
            out[m.group(2)] = m.group(1).split("@")[0]
    if out:
        return out
    import fcntl
    import struct
    for _, name in socket.if_nameindex():
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            out[socket.inet_ntoa(raw[20:24])] = name
        except OSError:
            pass
        finally:
            s.close()
    return out


def interface_for(address, peer=None):
    """The interface that holds ``address`` (this node's gang address); when it is not an address of
    this node (a NAT'd one), the interface this node uses to reach ``peer``. None when unknown."""
    addrs = local_addresses()
    ip = _ip(address)
    if ip in addrs:
        return addrs[ip]
    pip = _ip(peer) if peer else None
    if pip:
        fam = socket.AF_INET6 if ":" in pip else socket.AF_INET
        s = socket.socket(fam, socket.SOCK_DGRAM)
        try:
            s.connect((pip, 9))  # UDP: no packet leaves; the kernel picks the route and source address
            return addrs.get(s.getsockname()[0])
        except OSError:
            return None
        finally:
            s.close()
    return None


def iface(req: IfaceRequest):
    return {"ifname": interface_for(req["address"], req.get("peer"))}


OPS = {"facts": facts, "listen": listen, "connect": connect, "iface": iface}


if __name__ == "__main__":
    serve(OPS)
