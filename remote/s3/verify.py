"""What a downloaded object is checked against, besides its size (stdlib only), cheapest first.

* a plain ETag (32 hex digits, object not encrypted with SSE-KMS/SSE-C): the MD5 of the bytes
  (the one check S3 semantics guarantee for single-PUT objects; always done);
* an object fetched in ranged parts whose upload parts are known (HEAD ?partNumber=1 gives part 1's
  size, consistent with N equal parts):
  - a COMPOSITE checksum "<b64>-N" (CRC32 as boto3 and the AWS CLI add by default, SHA1, SHA256):
    each upload part's checksum, computed inline in parallel, then combined;
* an S3 full-object checksum (x-amz-checksum-crc32, -sha1, -sha256), fed in order;
* a multipart ETag "<hex>-N" with known parts: each part's MD5, inline in parallel, then combined;
* otherwise the size alone (CRC32C and CRC64NVME need code the standard library lacks).

``Verifier`` is fed the whole object in order; ``PartsVerifier`` part by part, in any order.
"""
from __future__ import annotations

import base64
import hashlib
import re
import struct
import zlib
from typing import List, Optional

PLAIN_ETAG = re.compile(r"^[0-9a-fA-F]{32}$")
MULTI_ETAG = re.compile(r"^([0-9a-fA-F]{32})-(\d+)$")
CHECKSUM_HEADERS = (("x-amz-checksum-sha256", "sha256"), ("x-amz-checksum-sha1", "sha1"),
                    ("x-amz-checksum-crc32", "crc32"))


def encrypted_etag(headers):
    """True when the ETag is not an MD5 of the content (SSE-KMS, DSSE-KMS or SSE-C objects)."""
    sse = (headers.get("x-amz-server-side-encryption") or "").lower()
    return sse.startswith("aws:kms") or bool(headers.get("x-amz-server-side-encryption-customer-algorithm"))


class _Crc32:
    """CRC32 with hashlib's face (update, digest, hexdigest): 4 bytes big-endian, as S3 encodes it."""

    def __init__(self):
        self.value = 0

    def update(self, data):
        self.value = zlib.crc32(data, self.value)

    def digest(self):
        return struct.pack(">I", self.value & 0xFFFFFFFF)

    def hexdigest(self):
        return self.digest().hex()


class Verifier:
    """Fed the whole object in order (``update``). ``kind``: md5 | sha256 | sha1 | crc32."""

    def __init__(self, kind, expected):
        self.kind = kind
        self.expected = expected
        self._h = _Crc32() if kind == "crc32" else hashlib.new(kind)

    def update(self, data):
        self._h.update(data)

    def actual(self):
        if self.kind == "md5":
            return self._h.hexdigest()
        return base64.b64encode(self._h.digest()).decode()

    def ok(self):
        return self.actual().lower() == self.expected.lower() if self.kind == "md5" else self.actual() == self.expected


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


class PartsVerifier:
    """Checks a multipart object upload part by upload part: each part is hashed inline by whichever
    worker downloads it (any thread, any order: the work spreads over every core and nothing is read
    back), then the part digests are combined as S3 combines them.

    ``kind``: "md5-multipart" (the ETag "<md5 of part MD5s>-N"), or "<alg>-composite" for a COMPOSITE
    checksum "<base64 of alg(part checksums)>-N" (crc32, sha1, sha256).
    """

    def __init__(self, kind, expected, part_size, size):
        self.kind = kind
        self.expected = expected
        self.part_size = part_size
        self.count = max(1, -(-size // part_size))
        self.results: List[Optional[bytes]] = [None] * self.count  # each upload part's digest
        self._alg = kind.split("-")[0]

    def _new(self):
        return _Crc32() if self._alg == "crc32" else hashlib.new(self._alg)

    def segment(self, start, length):
        """A hasher for the bytes [start, start+length), which must begin on an upload part boundary."""
        return _Segment(self, start, length)

    def actual(self):
        parts = [r for r in self.results if r is not None]
        if len(parts) < self.count:
            return "(parts missing)"
        joined = b"".join(parts)
        if self.kind == "md5-multipart":
            return "%s-%d" % (hashlib.md5(joined).hexdigest(), self.count)
        h = self._new()
        h.update(joined)
        return "%s-%d" % (base64.b64encode(h.digest()).decode(), self.count)

    def ok(self):
        got = self.actual()
        return got.lower() == self.expected.lower() if self.kind == "md5-multipart" else got == self.expected


class _Segment:
    def __init__(self, pv, start, length):
        if start % pv.part_size:
            raise ValueError("segment must start on a part boundary")
        self.pv = pv
        self.index = start // pv.part_size
        self.end = start + length
        self.pos = start
        self.h = pv._new()

    def update(self, data):
        pv, view = self.pv, memoryview(data)
        while len(view):
            boundary = min((self.index + 1) * pv.part_size, self.end)
            take = min(boundary - self.pos, len(view))
            self.h.update(view[:take])
            view = view[take:]
            self.pos += take
            if self.pos == boundary:
                pv.results[self.index] = self.h.digest()
                self.index += 1
                self.h = pv._new()


def for_ranged(etag, size, head, part1_size=None):
    """The verifier for an object fetched in ranged parts, from its HEAD headers and, for a multipart
    object, the size of its first part (HEAD ?partNumber=1). Cheapest check that is there first."""
    plain_md5 = PLAIN_ETAG.match(etag) and not encrypted_etag(head)
    if plain_md5:
        return Verifier("md5", etag)
    m = MULTI_ETAG.match(etag)
    n = int(m.group(2)) if m else 0
    equal_parts = bool(part1_size) and n >= 1 and (n - 1) * part1_size < size <= n * part1_size
    if equal_parts:
        for name, kind in CHECKSUM_HEADERS:
            value = head.get(name) or ""
            if value.endswith("-%d" % n):
                return PartsVerifier(kind + "-composite", value, part1_size, size)
    whole = from_checksums(head)
    if whole is not None:
        return whole
    if equal_parts and not encrypted_etag(head):
        return PartsVerifier("md5-multipart", etag, part1_size, size)
    return None
