"""What counts as a secret, and hiding credentials in text (stdlib only, python3 3.8+).

One place for both, used on the node (provision, pkgcheck, runs) and on the controller
(orchestrator.config.models.is_secret_env, provision's errors):

* ``redact(text)``: every URL's userinfo becomes ``***``: ``https://user:token@host/x`` ->
  ``https://***@host/x``. The whole userinfo goes, user included, because some services take the
  token as the user name (``https://TOKEN@github.com``, ``https://TOKEN:x-oauth-basic@...``);
* ``redact_obj(doc)``: the same for every string (and key) of a JSON-like document;
* ``has_credentials(value)``: the value holds a URL with userinfo (what ``redact`` would hide);
* ``secret_name(name)``: the variable name is one of a secret, matched by whole words: the name
  is split at every character other than a letter or digit, and one word must be a secret word
  (``HF_TOKEN``, ``WANDB_API_KEY``, ``DB_PASSWORD``; also ``PGPASSWORD``, ``HFTOKEN``: a word that
  ends in TOKEN, SECRET, PASSWORD, PASSWD, PASSPHRASE, APIKEY, ACCESSKEY, PRIVATEKEY, CREDENTIAL(S)).
  ``TOKENIZERS_PARALLELISM``, ``MAX_NEW_TOKENS``, ``KEYBOARD``, ``AUTHOR`` are not secret.
"""
import re

# scheme://, then the userinfo: everything up to the last '@' before the host's end (/ ? # or space),
# so a password with an unescaped '@' is hidden whole
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/?#\s]*@")

SECRET_WORDS = (r"[A-Z0-9]*(?:TOKEN|SECRET|PASSWORD|PASSWD|PASSPHRASE|APIKEY|ACCESSKEY|PRIVATEKEY|CREDENTIALS?)"
                r"|SECRETS|KEY|PASS|PWD|CREDS|AUTH|PAT|COOKIE|SESSION|PRIVATE|DSN")
# applied with fullmatch to the upper-cased name: one whole word of it is a secret word
SECRET_NAME = re.compile(r"(?:.*[^A-Z0-9])?(?:%s)(?:[^A-Z0-9].*)?" % SECRET_WORDS, re.S)
NOT_SECRET = frozenset(["PWD"])  # the shell's working directory, not a password


def redact(text):
    """``text`` with the userinfo of every URL in it replaced by ``***``."""
    return _USERINFO.sub(r"\1***@", text)


def redact_obj(obj):
    """A copy of a JSON-like document (dict, list, tuple, str, scalars) with every string redacted."""
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, dict):
        return dict((redact_obj(k), redact_obj(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return [redact_obj(v) for v in obj]
    return obj


def has_credentials(value):
    """The value holds a URL with userinfo (``scheme://user:pass@...`` or ``scheme://token@...``)."""
    return isinstance(value, str) and redact(value) != value


def secret_name(name):
    """Is ``name`` the name of a secret variable? (whole words; see the module's docstring)"""
    up = name.upper()
    return up not in NOT_SECRET and SECRET_NAME.fullmatch(up) is not None


def is_secret(name, value=None):
    """A secret by its name, or by its value (a URL with credentials)."""
    return secret_name(name) or (value is not None and has_credentials(value))
