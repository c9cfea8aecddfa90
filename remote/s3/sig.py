"""AWS Signature Version 4 for S3 requests, and where the node finds its own credentials.

Standard library only (python3 3.8+): the transfer engine needs nothing installed on the node.

Credentials are a dict ``{"access_key", "secret_key", "session_token"?}``. They arrive from the
controller in the request on stdin, or (job ``s3.credentials: node``) are found on the node by
``node_credentials``: the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
AWS_SESSION_TOKEN), then the shared credentials file (AWS_SHARED_CREDENTIALS_FILE or
~/.aws/credentials, profile AWS_PROFILE or the job's ``s3.profile`` or "default"), then the EC2
instance profile through IMDSv2.
"""
from __future__ import annotations

import configparser
import datetime
import hashlib
import hmac
import http.client
import json
import os
from typing import Dict, Tuple
from urllib.parse import quote

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
_KEY_CACHE: Dict[Tuple[str, str, str, str], bytes] = {}  # (secret, date, region, service) -> signing key


def uri_encode(value, safe_slash):
    """RFC 3986 encoding as SigV4 wants it (unreserved characters kept; '/' kept in paths)."""
    return quote(value, safe="/~" if safe_slash else "~")


def canonical_query(query):
    """``query``: list of (name, value) pairs, not yet encoded."""
    pairs = sorted((uri_encode(k, False), uri_encode(v, False)) for k, v in query)
    return "&".join("%s=%s" % kv for kv in pairs)


def signing_key(secret, date, region, service):
    ck = (secret, date, region, service)
    key = _KEY_CACHE.get(ck)
    if key is None:
        k = hmac.new(("AWS4" + secret).encode(), date.encode(), hashlib.sha256).digest()
        for part in (region, service, "aws4_request"):
            k = hmac.new(k, part.encode(), hashlib.sha256).digest()
        if len(_KEY_CACHE) > 16:
            _KEY_CACHE.clear()
        _KEY_CACHE[ck] = key = k
    return key


def amz_date(now=None):
    now = now or datetime.datetime.now(datetime.timezone.utc)
    return now.strftime("%Y%m%dT%H%M%SZ")


def sign(method, path, query, headers, creds, region, service="s3", payload_hash=EMPTY_SHA256,
         timestamp=None, content_sha_header=True):
    """Add x-amz-date (and x-amz-content-sha256 for S3, x-amz-security-token when present) and an
    Authorization header to ``headers`` (a dict with at least "host"), in place; return it.

    ``path`` is the request path already URI-encoded once (S3 does not double-encode).
    ``timestamp`` ("YYYYMMDDTHHMMSSZ") is for tests; by default the current time.
    """
    ts = timestamp or amz_date()
    headers["x-amz-date"] = ts
    if content_sha_header:
        headers["x-amz-content-sha256"] = payload_hash
    token = creds.get("session_token")
    if token:
        headers["x-amz-security-token"] = token
    canon = {}
    for name, value in headers.items():
        canon[name.lower()] = " ".join(str(value).strip().split())
    names = sorted(canon)
    signed_headers = ";".join(names)
    canonical_request = "\n".join([
        method,
        path or "/",
        canonical_query(query),
        "".join("%s:%s\n" % (n, canon[n]) for n in names),
        signed_headers,
        payload_hash,
    ])
    date = ts[:8]
    scope = "%s/%s/%s/aws4_request" % (date, region, service)
    string_to_sign = "\n".join([
        "AWS4-HMAC-SHA256", ts, scope, hashlib.sha256(canonical_request.encode()).hexdigest(),
    ])
    key = signing_key(creds["secret_key"], date, region, service)
    signature = hmac.new(key, string_to_sign.encode(), hashlib.sha256).hexdigest()
    headers["Authorization"] = "AWS4-HMAC-SHA256 Credential=%s/%s, SignedHeaders=%s, Signature=%s" % (
        creds["access_key"], scope, signed_headers, signature)
    return headers


# --------------------------------------------------------------------------- node credentials


def _from_env(environ):
    ak, sk = environ.get("AWS_ACCESS_KEY_ID"), environ.get("AWS_SECRET_ACCESS_KEY")
    if ak and sk:
        return {"access_key": ak, "secret_key": sk, "session_token": environ.get("AWS_SESSION_TOKEN"),
                "source": "environment"}
    return None


def _from_file(environ, profile):
    path = environ.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.join(os.path.expanduser("~"), ".aws",
                                                                     "credentials")
    if not os.path.isfile(path):
        return None
    cp = configparser.RawConfigParser()
    try:
        cp.read(path)
    except configparser.Error:
        return None
    if not cp.has_section(profile):
        return None
    sec = cp[profile]
    ak, sk = sec.get("aws_access_key_id"), sec.get("aws_secret_access_key")
    if ak and sk:
        return {"access_key": ak.strip(), "secret_key": sk.strip(),
                "session_token": (sec.get("aws_session_token") or "").strip() or None,
                "source": "%s [%s]" % (path, profile)}
    return None


def _from_imds(environ, timeout=1.0):
    if environ.get("AWS_EC2_METADATA_DISABLED", "").lower() == "true":
        return None
    endpoint = environ.get("AWS_EC2_METADATA_SERVICE_ENDPOINT", "http://169.254.169.254").rstrip("/")
    hostport = endpoint.split("://", 1)[-1]
    try:
        conn = http.client.HTTPConnection(hostport, timeout=timeout)
        conn.request("PUT", "/latest/api/token", headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"})
        resp = conn.getresponse()
        token = resp.read().decode()
        if resp.status != 200:
            return None
        hdr = {"X-aws-ec2-metadata-token": token}
        base = "/latest/meta-data/iam/security-credentials/"
        conn.request("GET", base, headers=hdr)
        resp = conn.getresponse()
        role = resp.read().decode().strip().splitlines()
        if resp.status != 200 or not role:
            return None
        conn.request("GET", base + role[0], headers=hdr)
        resp = conn.getresponse()
        doc = json.loads(resp.read().decode())
        conn.close()
        if resp.status != 200:
            return None
        return {"access_key": doc["AccessKeyId"], "secret_key": doc["SecretAccessKey"],
                "session_token": doc.get("Token"), "source": "instance profile " + role[0]}
    except (OSError, ValueError, KeyError, http.client.HTTPException):
        return None


def node_credentials(profile=None, environ=None):
    """The node's own credentials (see the module doc), or None when it has none."""
    environ = os.environ if environ is None else environ
    prof = profile or environ.get("AWS_PROFILE") or "default"
    if not profile:
        found = _from_env(environ)
        if found:
            return found
    return _from_file(environ, prof) or _from_imds(environ)
