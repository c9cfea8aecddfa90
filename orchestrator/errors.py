"""The DfoError tree. Each error carries what the user needs to act, and its exit code.

Exit codes (the CLI contract): 0 done; 1 unexpected error; 2 bad usage or invalid
inventory/job file; 3 verification failed; 4 host unreachable / auth / host key; 5 run failed.
"""

from __future__ import annotations

from typing import Any

EXIT_OK = 0
EXIT_UNEXPECTED = 1
EXIT_USAGE = 2
EXIT_VERIFY = 3
EXIT_HOST = 4
EXIT_RUN = 5


class DfoError(Exception):
    """Base of every error dfo reports to the user (one or two lines, no traceback)."""

    exit_code = EXIT_UNEXPECTED
    kind = "error"

    def __init__(self, message: str, *, host: str | None = None, hint: str | None = None,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.host = host
        self.hint = hint
        # the node's whole error document, when the error came from a remote module (else None)
        self.details: dict[str, Any] | None = details

    def render(self) -> str:
        head = f"{self.host}: {self.message}" if self.host else self.message
        return f"{head}\n  {self.hint}" if self.hint else head

    def to_json(self) -> dict:
        return {"kind": self.kind, "message": self.message, "host": self.host, "hint": self.hint}


class ConfigError(DfoError):
    """An invalid inventory or job file, or bad usage."""

    exit_code = EXIT_USAGE
    kind = "config"


class UsageError(ConfigError):
    kind = "usage"


class VerifyError(DfoError):
    """A version, a pin, a checksum or a capacity check failed."""

    exit_code = EXIT_VERIFY
    kind = "verify"


class HostError(DfoError):
    """The host could not be reached or authenticated."""

    exit_code = EXIT_HOST
    kind = "unreachable"


class ConnectionLost(HostError):
    """An open connection died while a call ran (no keepalive answer, reset, closed channel).
    Its JSON kind stays "unreachable" (the CLI contract); callers tell it apart by its class."""


class HostKeyError(HostError):
    """The host presented a key that differs from the one dfo recorded."""

    kind = "host_key"


class RemoteCommandError(DfoError):
    """A remote step failed in a way that is not a verification failure."""

    exit_code = EXIT_UNEXPECTED
    kind = "remote"


class NoResult(RemoteCommandError):
    """A remote module ended without its framed result (a crash, or a login file ate stdout)."""

    kind = "no_result"


class AgentMissing(RemoteCommandError):
    """dfo's remote code could not be put on the node (no writable $HOME, no tar)."""

    kind = "agent_missing"


class RunFailed(DfoError):
    """The run died early at launch, or ended non-zero while tailed."""

    exit_code = EXIT_RUN
    kind = "run_failed"


class NotBuilt(DfoError):
    exit_code = EXIT_UNEXPECTED
    kind = "not_built"


# --------------------------------------------------------------------------- node prerequisites and logins


class PythonTooOld(VerifyError):
    """The node's python3 is older than 3.8 (exit 3): remote/__init__.py says so before any module of
    dfo's is compiled, or agent.run_module recognises the SyntaxError an old interpreter gives."""

    kind = "python_too_old"

    def __init__(self, message: str, *, host: str | None = None, hint: str | None = None,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(message, host=host, hint=hint or PYTHON_TOO_OLD_HINT, details=details)


PYTHON_TOO_OLD_HINT = ("install python3 3.8 or newer on the node and point the host's python: at it in the "
                       "inventory (hosts.NAME.python: /usr/bin/python3.10)")


class AuthFailed(HostError):
    """The node refused every key offered, or none could be offered (exit 4). ``reason`` is a key of
    AUTH_HINTS. Its JSON kind stays "unreachable" (the CLI contract), as ConnectionLost's."""

    def __init__(self, message: str, *, reason: str, host: str | None = None, key: str | None = None,
                 login: str | None = None) -> None:
        super().__init__(message, host=host, hint=auth_hint(reason, key, login))
        self.reason = reason


# What to do, by why the login failed: one table for every transport (paramiko's connection.py and the
# OpenSSH client's), so that both say the same thing. {key} is the identity file concerned.
AUTH_HINTS: dict[str, str] = {
    "no_key": "no key was offered: load one into ssh-agent (ssh-add ~/.ssh/KEY) or set identity: for this host "
              "in the inventory (or IdentityFile in ~/.ssh/config); `ssh HOST true` should work first",
    "encrypted_key": "{key} is encrypted and no ssh-agent holds it: run ssh-add {key} (dfo never asks for a "
                     "passphrase)",
    "too_many_keys": "the node hung up after too many keys were offered (sshd's MaxAuthTries): set "
                     "IdentitiesOnly yes and IdentityFile for this host in ~/.ssh/config, or identity: in the "
                     "inventory",
    "refused": "the node refused every key offered: check the user and identity: in the inventory (or "
               "~/.ssh/config), and that the key's .pub is in the node's ~/.ssh/authorized_keys",
    "second_factor": "run `dfo login -H {host}` once: it asks for it on your terminal (or SSH_ASKPASS) and keeps "
                     "that connection, which dfo's commands then use with no prompt for ssh_persist (or "
                     "--persist SECONDS); a ControlMaster of your own ssh_config works too",
}
# the OpenSSH transport can also take a passphrase typed once, at dfo login's prompt (paramiko cannot)
_LOGIN_TOO = {"encrypted_key": "; or `dfo login -H {host}` to type its passphrase once"}


def auth_hint(reason: str, key: str | None = None, login: str | None = None) -> str:
    """What to do; ``login``: the host's name where `dfo login` is a way in (the OpenSSH transport)."""
    text = AUTH_HINTS.get(reason, AUTH_HINTS["refused"]) + (_LOGIN_TOO.get(reason, "") if login else "")
    return text.format(key=key or "the key", host=login or "HOST")
