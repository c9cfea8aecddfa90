"""JSON for node modules without importing ``json`` (python3 3.8+, stdlib only).

``import json`` costs a node call about 3.5 ms: its decoder and encoder compile regular expressions
at import, which pulls in ``re`` and ``enum``. Both only serve the pure-Python fallbacks; the work is
done by CPython's C accelerator ``_json`` (what ``json.loads`` and ``json.dumps`` call too). This
module calls ``_json`` directly, so the bytes are the same as ``json.dumps`` gives with the same
options and a value reads back as ``json.loads`` reads it. Where ``_json`` is missing or its calls
differ (another Python implementation), and for ``indent`` (which the C encoder of Python before 3.13
does not do), it hands the call to ``json`` itself.
"""

try:
    import _json
except ImportError:  # not CPython: json's pure-Python code does it all
    _json = None  # type: ignore[assignment]

_WS = " \t\n\r"  # JSON's whitespace (json.decoder.WHITESPACE)


class _Context(object):
    """What _json.make_scanner reads off a JSONDecoder: json.loads's defaults."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    memo = None

    @staticmethod
    def parse_constant(name):
        return float(name)  # "NaN", "Infinity", "-Infinity" (json.decoder._CONSTANTS)


_scan = None
if _json is not None:
    try:
        _scan = _json.make_scanner(_Context())  # type: ignore[arg-type]  # what it reads off a decoder
    except (AttributeError, TypeError):
        _scan = None


def loads(s):
    """``json.loads(s)`` for a str (a ValueError for text that is not one JSON value)."""
    if isinstance(s, (bytes, bytearray)):
        if s[:3] == b"\xef\xbb\xbf" or b"\x00" in s[:4]:  # a BOM, UTF-16 or -32: json tells them apart
            import json
            return json.loads(s)
        s = s.decode("utf-8", "surrogatepass")  # as json.loads decodes UTF-8
    if _scan is None:
        import json
        return json.loads(s)
    start = len(s) - len(s.lstrip(_WS))
    try:
        obj, end = _scan(s, start)
    except StopIteration:
        import json  # the error json gives, with its line and column
        return json.loads(s)
    if s[end:].strip(_WS):
        import json
        return json.loads(s)  # raises "Extra data"
    return obj


def load(f):
    return loads(f.read())


def dumps(obj, separators=None, sort_keys=False, default=None, indent=None):
    """``json.dumps(obj, ...)`` with these options (ASCII output, NaN allowed, circular values refused)."""
    if separators is None:
        separators = (",", ": ") if indent is not None else (", ", ": ")
    if _json is not None and indent is None and not isinstance(obj, (str, int, float)) and obj is not None:
        try:
            enc = _json.make_encoder({}, default or _fail, _json.encode_basestring_ascii, None,
                                     separators[1], separators[0], sort_keys, False, True)
        except (AttributeError, TypeError):
            enc = None
        if enc is not None:
            return "".join(enc(obj, 0))
    import json
    return json.dumps(obj, separators=separators, sort_keys=sort_keys, default=default, indent=indent)


def _fail(o):
    raise TypeError("Object of type %s is not JSON serializable" % o.__class__.__name__)
