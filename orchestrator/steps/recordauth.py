"""The laptop's key for the records it keeps in S3 (issue 32: a node cannot forge the generation record).

A recovering run's generation record and the watcher's lease sit beside the outputs, under
``outputs.dest``, where every node of the job holds write keys. So each record dfo writes from a laptop
carries an HMAC-SHA256 over the document, made with a key that only the laptop holds, and dfo obeys
no record whose HMAC does not check. Nodes never see the key (a node's shipper only reads the
generation number from the record; what a forged number can do there is documented in
docs/recovery.md).

- The key: 32 random bytes, hex, in ``$DFO_RECORD_KEY_FILE`` else ``dfo's config folder/record.key``
  (``$XDG_CONFIG_HOME/dfo``, else ``~/.config/dfo``), created 0600 on first use, through a temporary
  name. A watcher on another machine needs the same file (copy it, 0600; docs/recovery.md).
- The document: ``auth: {"alg": "hmac-sha256", "key": KEY_ID, "mac": HEX}``, over the canonical JSON of
  the document without ``auth`` (sorted keys, no spaces, ASCII). KEY_ID names the key (not secret) so
  that a record signed by another machine's key says which.
- ``seq`` grows by one with every write; this machine remembers the highest ``seq`` it has seen per
  record (``dfo's config folder/records/``), so an old record a node saved and wrote back (a replay:
  its HMAC is genuine) is refused too.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import stat
import threading
from pathlib import Path
from typing import Any

from ..errors import ConfigError, VerifyError

ALG = "hmac-sha256"
_lock = threading.Lock()


class RecordForged(VerifyError):
    """A record in S3 that dfo on a laptop did not write (or an old one written back): never obeyed."""


def config_dir() -> Path:
    """dfo's config folder on this machine: $XDG_CONFIG_HOME/dfo, else ~/.config/dfo."""
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "dfo"


def key_path() -> Path:
    return Path(os.environ.get("DFO_RECORD_KEY_FILE") or config_dir() / "record.key").expanduser()


def _private_write(path: Path, text: str, exclusive: bool = False) -> None:
    """``text`` into ``path``, 0600, through a temporary name (nothing half-written). ``exclusive``: never
    replace a file that is there already (two processes creating the key: the first one wins)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if exclusive:
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
        else:
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def load_key(create: bool = True) -> bytes:
    """The key, made on first use when ``create``. A key file that others may read, or that is not 64 hex
    digits, is refused with what to do (exit 2)."""
    path = key_path()
    with _lock:
        if not path.exists() and create:
            _private_write(path, secrets.token_hex(32) + "\n", exclusive=True)
        try:
            st = path.stat()
            text = path.read_text().strip()
        except FileNotFoundError:
            raise ConfigError(f"{path}: no record key on this machine: the runs' records in S3 are signed with the "
                              "key of the machine that launched them",
                              hint="copy record.key from that machine's dfo config folder (0600), or set "
                                   "DFO_RECORD_KEY_FILE to it (docs/recovery.md#the-record-key)") from None
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read the record key ({exc.strerror})") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{path}: the record key may be read by others (mode {stat.S_IMODE(st.st_mode):o})",
                          hint=f"chmod 600 {path}")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise ConfigError(f"{path}: the record key is not owned by this user", hint=f"chown it, or chmod 600 {path}")
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) < 16:
        raise ConfigError(f"{path}: the record key is not 32 to 64 hex digits",
                          hint="copy it again from the machine that launched the run")
    return key


def key_id(key: bytes) -> str:
    """A name of the key (not the key): the first 12 hex digits of a hash of it."""
    return hashlib.sha256(b"dfo record key id\0" + key).hexdigest()[:12]


def _canonical(doc: dict[str, Any]) -> bytes:
    body = {k: v for k, v in doc.items() if k != "auth"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def mac_of(doc: dict[str, Any], key: bytes) -> str:
    return hmac.new(key, _canonical(doc), hashlib.sha256).hexdigest()


def seal(doc: dict[str, Any], key: bytes | None = None) -> dict[str, Any]:
    """``doc`` with its ``auth``."""
    key = key if key is not None else load_key()
    return dict(doc, auth={"alg": ALG, "key": key_id(key), "mac": mac_of(doc, key)})


def check(doc: Any, url: str, key: bytes | None = None) -> dict[str, Any]:
    """``doc`` if this machine's key made its HMAC, else RecordForged naming the record and what was wrong."""
    hint = ("a node holds write keys for outputs.dest: find which one wrote it; dfo up -H HOSTS -j JOB starts a "
            "new lineage with a fresh record (docs/recovery.md#the-record-key)")
    if not isinstance(doc, dict):
        raise RecordForged(f"record {url}: not a JSON object: not written by dfo; not obeyed", hint=hint)
    auth = doc.get("auth")
    if not isinstance(auth, dict) or auth.get("alg") != ALG or not isinstance(auth.get("mac"), str):
        raise RecordForged(f"record {url}: it carries no dfo signature (auth.{ALG}): not written by dfo on a laptop; "
                           "not obeyed", hint=hint)
    key = key if key is not None else load_key(create=False)
    mine = key_id(key)
    if auth.get("key") != mine:
        raise RecordForged(f"record {url}: signed with key {str(auth.get('key'))[:24]!r}, not this machine's key "
                           f"{mine} ({key_path()}); not obeyed",
                           hint="watching from another machine? copy record.key from the machine that launched the "
                                "run (docs/recovery.md#the-record-key); else " + hint)
    try:
        want = mac_of(doc, key)
    except (TypeError, ValueError):
        want = ""
    if not hmac.compare_digest(want, str(auth["mac"])):
        raise RecordForged(f"record {url}: its signature (key {mine}) does not match its content: changed by "
                           "something that does not hold the key; not obeyed", hint=hint)
    return doc


# --------------------------------------------------------------------------- replays


def _seen_path(url: str) -> Path:
    return config_dir() / "records" / (hashlib.sha256(url.encode()).hexdigest()[:24] + ".json")


def seen_seq(url: str) -> int:
    """The highest ``seq`` this machine has seen of the record at ``url`` (0: none)."""
    try:
        got = json.loads(_seen_path(url).read_text()).get("seq")
    except (OSError, ValueError, AttributeError):
        return 0
    return got if isinstance(got, int) and not isinstance(got, bool) else 0


def note_seq(url: str, seq: int) -> None:
    """Remember ``seq`` for ``url`` if it is higher than what this machine saw (best effort)."""
    with _lock:
        if seq <= seen_seq(url):
            return
        with contextlib.suppress(OSError):
            _private_write(_seen_path(url), json.dumps({"url": url, "seq": seq}) + "\n")


def fresh(doc: dict[str, Any], url: str) -> dict[str, Any]:
    """A checked record whose ``seq`` is not below what this machine has seen (else RecordForged: a replay)."""
    seq = doc.get("seq")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
        raise RecordForged(f"record {url}: field seq is {seq!r}, not a positive whole number; not obeyed")
    seen = seen_seq(url)
    if seq < seen:
        raise RecordForged(f"record {url}: seq {seq} is older than seq {seen} this machine has seen: an old "
                           "record written back (a node holds write keys for outputs.dest); not obeyed",
                           hint="find the node that wrote it; if you removed the record and launched from another "
                                f"machine since, remove {_seen_path(url)}")
    note_seq(url, seq)
    return doc
