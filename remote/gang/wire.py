"""The gang watch's wire (python3 3.8+, stdlib): MAC'd, numbered lines over one TCP connection.

A line is ``SEQ PAYLOAD MAC``: MAC = HMAC-SHA256(secret, session|direction|SEQ|PAYLOAD) in hex, the
session being the two ends' fresh nonces, SEQ rising on each side, so a line cannot be forged,
altered, replayed, or moved to another connection or direction. See remote/gang/watch.py; the hub's
door (accepting, and bounding who has not joined yet) is remote/gang/door.py.
"""
import hashlib
import hmac
import socket
import threading
import time

MAX_LINE = 1024


def _mac(secret, *parts):
    return hmac.new(secret, "|".join(str(p) for p in parts).encode("utf-8"), hashlib.sha256).hexdigest()


def _same(got, want):
    """Constant-time, and safe on any text a stranger sends (compare_digest refuses non-ASCII str)."""
    return hmac.compare_digest(got.encode("utf-8", "replace"), want.encode("ascii"))


def _num(text):
    return text.isascii() and text.isdigit()


class _Chan(object):
    """One authenticated connection: numbered, MAC'd lines in both directions."""

    def __init__(self, sock, secret, session, out_dir, in_dir):
        self.sock, self.secret, self.session = sock, secret, session
        self.out_dir, self.in_dir = out_dir, in_dir
        self.seq_out, self.seq_in = 0, 0
        self.lock = threading.Lock()
        self.closed = False

    def send(self, payload):
        with self.lock:
            if self.closed:
                return False
            self.seq_out += 1
            line = "%d %s %s\n" % (self.seq_out, payload, _mac(self.secret, self.session, self.out_dir,
                                                                  self.seq_out, payload))
            try:
                self.sock.sendall(line.encode("utf-8"))
                return True
            except OSError:
                self.closed = True
                return False

    def check(self, line):
        """The payload of a valid line, else None."""
        parts = line.split(" ")
        if len(parts) < 3 or not _num(parts[0]):
            return None
        seq, mac, payload = int(parts[0]), parts[-1], " ".join(parts[1:-1])
        if seq <= self.seq_in or not _same(mac, _mac(self.secret, self.session, self.in_dir, seq, payload)):
            return None
        self.seq_in = seq
        return payload

    def close(self):
        with self.lock:
            self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _lines(sock, buf, timeout):
    """Read what is there within ``timeout``: (complete lines, rest, eof)."""
    try:
        sock.settimeout(timeout)
        chunk = sock.recv(4096)
    except socket.timeout:
        return [], buf, False
    except OSError:
        return [], buf, True
    if not chunk:
        return [], buf, True
    buf += chunk
    parts = buf.split(b"\n")
    rest = parts.pop()
    if len(rest) > MAX_LINE:
        return [], b"", True
    return [p.decode("utf-8", "replace") for p in parts], rest, False


def _read_line(sock, timeout):
    buf, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines, buf, eof = _lines(sock, buf, max(0.05, deadline - time.monotonic()))
        if lines:
            return lines[0]
        if eof:
            return None
    return None

