"""S3 errors on the node (python3 3.8+, stdlib): ``S3Error`` and how an error answer is read.

An error becomes ``S3Error`` with a kind ("verify": S3 said no; "unreachable": no answer), a message
naming the object and the endpoint, whether a retry may help (``retryable``; ``remote.lib.retry`` honours
it, and the answer's ``retry_after``), and a hint. A response body is quoted only when it is short
printable text (an S3 XML error's Code and Message); anything else is described by its status,
content type and length, and never read past ``ERR_READ_MAX``.
"""
import re
import xml.etree.ElementTree as ET

ERR_READ_MAX = 64 << 10  # an error body bigger than this is not read (the connection is dropped instead)
ERR_TEXT_MAX = 300  # a non-XML error body is quoted only when it is printable text this short
RETRYABLE_STATUS = (408, 429, 500, 502, 503, 504)


class S3Error(Exception):
    def __init__(self, kind, message, status=None, code=None, retryable=False, hint=None, retry_after=None):
        Exception.__init__(self, message)
        self.kind = kind
        self.message = message
        self.status = status
        self.code = code
        self.retryable = retryable
        self.hint = hint
        self.retry_after = retry_after  # seconds, from the answer's Retry-After header (remote.lib.retry honours it)
        self.attempts = 1  # how many times it was asked (remote.lib.retry sets it when it gives up)

    def described(self):
        """The message, and how many attempts it took to give up when there were several."""
        if self.attempts > 1:
            return "%s (gave up after %d attempts)" % (self.message, self.attempts)
        return self.message


class RangeIgnored(Exception):
    """A ranged GET was answered 200 with no Content-Range: the server sent the whole object."""


def strip_ns(tag):
    return tag.rsplit("}", 1)[-1]


def as_int(value):
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def short_text(raw, limit=ERR_TEXT_MAX):
    """``raw`` (bytes or str) as one line of printable text of at most ``limit`` characters, or None."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError:
            return None
    text = " ".join(raw.split())
    if not text or not text.isprintable():
        return None
    return text if len(text) <= limit else text[:limit - 3] + "..."


def error_fields(body, ctype, length, complete):
    """(Code, Message, Region) from an error response: an S3 XML error's fields when it has them
    (printable, short); else the body when it is short text; else a description of it, never its bytes."""
    if complete and body.lstrip()[:1] == b"<":
        try:
            root = ET.fromstring(body)
        except ET.ParseError:
            root = None
        if root is not None:
            fields = {}
            for child in root:
                fields[strip_ns(child.tag)] = short_text(child.text or "")
            code = fields.get("Code")
            if code is not None and not re.match(r"^[A-Za-z0-9.]{1,64}$", code):
                code = None
            if code or fields.get("Message"):
                return code, fields.get("Message"), fields.get("Region")
    ctype = (ctype or "").split(";")[0].strip().lower()
    textual = not ctype or ctype.startswith("text/") or ctype in ("application/xml", "application/json")
    if not body and complete:
        return None, None, None
    if complete and textual and len(body) <= ERR_TEXT_MAX:
        text = short_text(body)
        if text is not None:
            return None, text, None
    return None, "body not shown (%s, %s%d bytes)" % (
        short_text(ctype, 60) or "no content type", "" if complete or length is not None else "at least ",
        length or len(body)), None


def parse_content_range(value):
    """``bytes START-END/TOTAL`` (TOTAL may be ``*``) -> (start, end, total or None), else None."""
    m = re.match(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$", value or "")
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), None if m.group(3) == "*" else int(m.group(3))
