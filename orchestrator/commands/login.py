"""dfo login / dfo logout: a node's shared connection made once with your terminal (second factors, passphrases)."""

from __future__ import annotations

import time

import click

from ..cli_common import clean, json_option, print_json, report_error
from ..errors import EXIT_HOST, DfoError, UsageError


def _ago(seconds: float) -> str:
    s = int(max(0, seconds))
    return f"{s}s" if s < 120 else f"{s // 60}m" if s < 7200 else f"{s // 3600}h{s % 3600 // 60:02d}m"


def _session(ctx: click.Context, hosts: tuple[str, ...]) -> object:
    from ..hosts import HostSession

    return HostSession(ctx.obj.get("inventory"), hosts)


def _say(text: str) -> None:
    click.echo(clean(text))


def _state_line(s: object) -> str:
    from ..transport.openssh_login import Shared

    assert isinstance(s, Shared)
    if not s.open:
        return f"{s.host}: not logged in: no shared connection (dfo login -H {s.host} makes one)"
    if s.since is not None and s.persist is not None:
        return (f"{s.host}: logged in {_ago(time.time() - s.since)} ago (ssh pid {s.pid}); it ends once idle for "
                f"{_ago(s.persist)} (dfo logout -H {s.host} ends it now)")
    if s.own:
        return f"{s.host}: logged in: a shared connection a dfo command made (ssh pid {s.pid}); it ends once idle " \
               "for ssh_persist"
    return f"{s.host}: logged in: your ssh_config's shared connection at {s.control} (ssh pid {s.pid})"


@click.command("login")
@click.option("-H", "--host", "hosts", multiple=True, metavar="HOST",
              help="A host, a group, or 'all' from the inventory; may repeat. --check without it: every host.")
@click.option("--persist", type=click.FloatRange(min=1), default=None, metavar="SECONDS",
              help="Keep the connection this long once idle (default: the inventory's ssh_persist).")
@click.option("--check", is_flag=True, help="Say which hosts have a shared connection, and for how long; change "
                                           "nothing (exit 4 when one has none).")
@json_option
@click.pass_context
def login_cmd(ctx: click.Context, hosts: tuple[str, ...], persist: float | None, check: bool, as_json: bool) -> int:
    """Log in once with your terminal (password, one-time code, passphrase) for dfo's later commands.

    dfo's commands then go over that connection with no prompt until it has been idle for ssh_persist
    (or --persist).

    \b
    For nodes that ask for a second factor after the key (sshd AuthenticationMethods), or keys no ssh-agent
    holds. Without a terminal, ssh asks SSH_ASKPASS (dfo sets SSH_ASKPASS_REQUIRE=force). dfo never sees what
    you type. Hosts are logged in one after another.
    """
    from ..transport import openssh_login

    if not hosts and not check:
        raise UsageError("dfo login needs -H HOST (which hosts to log in to)",
                         hint="dfo login -H HOST; dfo login --check says which hosts have a shared connection")
    if as_json and not check:
        raise UsageError("--json goes with --check", hint="dfo login --check --json")
    s = _session(ctx, hosts or ("all",))
    names: list[str] = list(getattr(s, "names", []))
    code, doc = 0, {}
    for name in names:
        host = s.hosts[name]  # type: ignore[attr-defined]
        try:
            got = openssh_login.check(host) if check else openssh_login.login(host, persist)
        except DfoError as exc:
            if exc.host is None:
                exc.host = name
            code = max(code, exc.exit_code)
            doc[name] = {"ok": False, "error": exc.to_json()}
            if not as_json:
                report_error(exc)
            continue
        doc[name] = got.to_json()
        if not got.open:
            code = max(code, EXIT_HOST)
        if not as_json:
            _say(_state_line(got))
    if as_json:
        print_json({"hosts": doc})
    return code


@click.command("logout")
@click.option("-H", "--host", "hosts", multiple=True, required=True, metavar="HOST",
              help="A host, a group, or 'all' from the inventory; may repeat (or comma-separate).")
@click.pass_context
def logout_cmd(ctx: click.Context, hosts: tuple[str, ...]) -> int:
    """End each host's shared connection (the one dfo login made, or a command's).

    The next command connects anew, and asks for dfo login again where the node wants a second factor."""
    from ..transport import openssh_login

    s = _session(ctx, hosts)
    code = 0
    for name in getattr(s, "names", []):
        try:
            was = openssh_login.logout(s.hosts[name])  # type: ignore[attr-defined]
        except DfoError as exc:
            if exc.host is None:
                exc.host = name
            report_error(exc)
            code = max(code, exc.exit_code)
            continue
        _say(f"{name}: logged out (its shared connection ended)" if was else
             f"{name}: not logged in: no shared connection to end")
    return code


COMMANDS = [login_cmd, logout_cmd]
