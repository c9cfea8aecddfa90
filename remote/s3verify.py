"""What a downloaded object is checked against, besides its size (stdlib only).

* a plain ETag (32 hex digits, object not encrypted with SSE-KMS/SSE-C): the MD5 of the bytes;
* a multipart ETag ("<hex>-N") when the size of part 1 is known (HEAD ?partNumber=1) and
  consistent with N equal parts: the MD5 of the concatenated MD5s of each part, then "-N";
* otherwise an S3 full-object checksum the object carries (x-amz-checksum-sha256, -sha1, -crc32;
  CRC32C and CRC64NVME need code the standard library lacks and are skipped);
* otherwise the size alone.

A ``Verifier`` is fed the object's bytes in order (``update``) and says whether they match.
"""
from __future__ import annotations

import base64
import hashlib
import re
import struct
import zlib

PLAIN_ETAG = re.compile(r"^[0-9a-fA-F]{32}$")
MULTI_ETAG = re.compile(r"^([0-9a-fA-F]{32})-(\d+)$")
CHECKSUM_HEADERS = (("x-amz-checksum-sha256", "sha256"), ("x-amz-checksum-sha1", "sha1"),
                    ("x-amz-checksum-crc32", "crc32"))


def encrypted_etag(headers):
    """True when the ETag is not an MD5 of the content (SSE-KMS, DSSE-KMS or SSE-C objects)."""
    sse = (headers.get("x-amz-server-side-encryption") or "").lower()
    return sse.startswith("aws:kms") or bool(headers.get("x-amz-server-side-encryption-customer-algorithm"))


class _Crc32:
    def __init__(self):
        self.value = 0

    def update(self, data):
        self.value = zlib.crc32(data, self.value)

    def b64(self):
        return base64.b64encode(struct.pack(">I", self.value & 0xFFFFFFFF)).decode()


class Verifier:
    """``kind``: md5 | md5-multipart | sha256 | sha1 | crc32."""

    def __init__(self, kind, expected, part_size=0):
        self.kind = kind
        self.expected = expected
        self.part_size = part_size
        self._digests = []
        self._left = part_size
        if kind in ("md5", "md5-multipart"):
            self._h = hashlib.md5()
        elif kind == "crc32":
            self._h = _Crc32()
        else:
            self._h = hashlib.new(kind)

    def update(self, data):
        if self.kind != "md5-multipart":
            self._h.update(data)
            return
        view = memoryview(data)
        while len(view):
            take = min(self._left, len(view))
            self._h.update(view[:take])
            view = view[take:]
            self._left -= take
            if self._left == 0:
                self._digests.append(self._h.digest())
                self._h, self._left = hashlib.md5(), self.part_size

    def actual(self):
        if self.kind == "md5":
            return self._h.hexdigest()
        if self.kind == "md5-multipart":
            digests = list(self._digests)
            if self._left != self.part_size:
                digests.append(self._h.digest())
            return "%s-%d" % (hashlib.md5(b"".join(digests)).hexdigest(), len(digests))
        if self.kind == "crc32":
            return self._h.b64()
        return base64.b64encode(self._h.digest()).decode()

    def ok(self):
        return self.actual().lower() == self.expected.lower() if self.kind.startswith("md5") else \
            self.actual() == self.expected


def for_whole_get(etag, headers):
    """The verifier for a single GET, chosen once its response headers are in."""
    if PLAIN_ETAG.match(etag) and not encrypted_etag(headers):
        return Verifier("md5", etag)
    return from_checksums(headers)


def from_checksums(headers):
    for name, kind in CHECKSUM_HEADERS:
        value = headers.get(name)
        if value and "-" not in value:  # "xxx-N" is a composite checksum of parts: not checkable here
            return Verifier(kind, value)
    return None


def for_ranged(etag, size, head, part1_size=None):
    """The verifier for an object fetched in ranged parts, from its HEAD headers."""
    if not encrypted_etag(head):
        if PLAIN_ETAG.match(etag):
            return Verifier("md5", etag)
        m = MULTI_ETAG.match(etag)
        if m and part1_size:
            n = int(m.group(2))
            if n >= 1 and (n - 1) * part1_size < size <= n * part1_size:
                return Verifier("md5-multipart", etag, part1_size)
    return from_checksums(head)
