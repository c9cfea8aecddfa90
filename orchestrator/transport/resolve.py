"""Where a host of the inventory really is: its entry, the inventory's defaults and the user's ssh_config
(paramiko: read here; OpenSSH: asked of ``ssh -G``) resolved into one ResolvedHost. This is the transport
layer's half of the inventory: orchestrator/config/models.py holds the files' shapes, and knows no transport."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

from ..config.inventory import HostEntry, Inventory, ResolvedHost
from ..errors import ConfigError, UsageError

# transport: ssh prefers the OpenSSH client (issue 18); False: paramiko unless `transport: openssh`
PREFER_OPENSSH = True
_PICKED: list[str] = []


def ssh_transport() -> str:
    """What ``transport: ssh`` means here: "openssh" when an OpenSSH client >= 8.0 is on PATH (and
    PREFER_OPENSSH), else "paramiko" (said once on stderr under ``dfo -v``). DFO_SSH_TRANSPORT=openssh
    or paramiko decides instead (the tests run the same cases on both)."""
    forced = os.environ.get("DFO_SSH_TRANSPORT", "").strip().lower()
    if forced in ("openssh", "paramiko"):
        return forced
    if not PREFER_OPENSSH:
        return "paramiko"
    if not _PICKED:
        from .openssh_setup import usable_ssh

        _PICKED.append("openssh" if usable_ssh() else "paramiko")
        if _PICKED[0] == "paramiko" and os.environ.get("DFO_VERBOSE"):
            sys.stderr.write("dfo: no OpenSSH client (ssh 8.0 or newer) on PATH: using paramiko for transport: ssh\n")
    return _PICKED[0]


def ssh_config_only(explicit: str | None = None) -> str | None:
    """The one ssh_config file dfo is told to read (like ``ssh -F``): the inventory's
    defaults.ssh_config (``explicit``), else $DFO_SSH_CONFIG, else None (ssh's own files)."""
    only = explicit or os.environ.get("DFO_SSH_CONFIG")
    return str(Path(only).expanduser()) if only else None


def ssh_config_path(explicit: str | None = None) -> Path:
    """The ssh_config file dfo reads: ssh_config_only (only that file, like ``ssh -F``), else
    ~/.ssh/config then /etc/ssh/ssh_config, as OpenSSH and fabric read them."""
    return Path(ssh_config_only(explicit) or "~/.ssh/config").expanduser()


_SSH_CONFIGS: dict[tuple[object, ...], object] = {}


def ssh_configuration(explicit: str | None = None) -> Any:
    """fabric's Config with the ssh_config file(s) loaded (fabric's own loading, see ssh_config_path);
    read again when a file changes. The connection layer builds every ProxyJump hop from it."""
    import fabric  # local import: ssh config only

    only = ssh_config_only(explicit) is not None
    path = ssh_config_path(explicit)
    files = [path] if only else [path, Path("/etc/ssh/ssh_config")]
    key = tuple((str(f), f.stat().st_mtime_ns if f.is_file() else None) for f in files)
    if key not in _SSH_CONFIGS:
        if only:
            kw: dict[str, Any] = ({"runtime_ssh_path": str(path)} if path.is_file()
                                  else {"overrides": {"load_ssh_configs": False}})
        else:
            kw = {"user_ssh_path": str(path)}
        cfg = fabric.Config(lazy=True, **kw)  # lazy: fabric's own files (~/.fabric.yaml) play no part
        try:
            cfg.load_ssh_config()
        except Exception as exc:  # noqa: BLE001 - paramiko's ConfigParseError, an unreadable file
            raise _ssh_config_error(files, exc) from None
        _SSH_CONFIGS.clear()
        _SSH_CONFIGS[key] = cfg
    return _SSH_CONFIGS[key]


def _ssh_config_error(files: list[Path], exc: Exception) -> ConfigError:
    where = " or ".join(str(f) for f in files if f.is_file()) or str(files[0])
    return ConfigError(f"{where}: cannot read ssh_config: {exc}",
                       hint="fix the line (see ssh_config(5)), or point DFO_SSH_CONFIG at another file")


def _ssh_config_lookup(alias: str, explicit: str | None = None) -> dict[str, Any]:
    """ssh_config's options for ``alias`` (lower-case keys; ProxyCommand's %h/%p/%r expanded). Values
    are strings, but lists for the keys that may repeat (identityfile)."""
    cfg = ssh_configuration(explicit)
    try:
        return dict(cfg.base_ssh_config.lookup(alias))
    except Exception as exc:  # noqa: BLE001 - a Match that paramiko cannot evaluate
        path = ssh_config_path(explicit)
        raise _ssh_config_error([path] if ssh_config_only(explicit)
                                else [path, Path("/etc/ssh/ssh_config")], exc) from None


def _proxy(own: str | None, sshc: dict[str, Any], default: str | None) -> tuple[str | None, str | None]:
    """(ProxyJump, ProxyCommand): the host's own proxy_jump, else ~/.ssh/config's ProxyJump or
    ProxyCommand, else defaults.proxy_jump. ``none`` is a direct connection."""
    if own:
        jump, command = own, None
    elif "proxyjump" in sshc:
        jump, command = str(sshc["proxyjump"]), None
    elif "proxycommand" in sshc:
        jump, command = None, str(sshc["proxycommand"])
    else:
        jump, command = default, None

    def given(v: str | None) -> str | None:
        return None if v is None or v.strip().lower() == "none" else v

    return given(jump), given(command)


def resolve_host(inv: Inventory, name: str, inv_path: Path) -> ResolvedHost:
    """The host's connection settings. Precedence: the host's own entry, then ~/.ssh/config for
    its alias (HostName, Port, User, IdentityFile, ProxyJump or ProxyCommand), then the inventory's
    defaults. A proxy of ``none`` (ProxyJump none) means a direct connection."""
    entry = inv.hosts.get(name)
    if entry is None:
        raise UsageError(f"unknown host {name!r}", hint=f"hosts in {inv_path}: {', '.join(inv.hosts) or 'none'}")
    d = inv.defaults
    alias = entry.host or name
    base = inv_path.parent

    def absolute(path: str) -> str:
        p = os.path.expanduser(path)
        return p if os.path.isabs(p) else str((base / p).resolve())

    transport = entry.transport or d.transport or "ssh"
    if transport == "ssh":
        transport = "openssh" if ssh_transport() == "openssh" else "paramiko"
    explicit = ssh_config_only(absolute(d.ssh_config) if d.ssh_config else None)
    if entry.identity and transport != "local" and not os.path.exists(absolute(entry.identity)):
        raise ConfigError(f"{inv_path}: hosts.{name}.identity: {absolute(entry.identity)} does not exist",
                          hint="point it at the private key for this host")
    if transport == "openssh":
        return _resolve_openssh(inv, name, entry, alias, explicit, absolute)
    if transport == "paramiko" and _ssh_g_usable():
        # `ssh -G` says where the host is (Include, Match, tokens: as ssh reads them); paramiko connects there
        got = _resolve_openssh(inv, name, entry, alias, explicit, absolute)
        _say_unhonoured(name, _top_level_lookup(alias, explicit), got.ssh_resolved)
        jump = _fabric_jump(got.proxy_jump) if got.proxy_jump else None
        strict = (got.ssh_resolved.get("stricthostkeychecking") or [""])[0].lower() in ("true", "yes")
        return got.replace(transport="paramiko", proxy_jump=jump, ssh_options=[], ssh_resolve=None, ssh_resolved={},
                           strict_host_keys=strict)
    sshc = _ssh_config_lookup(alias, explicit) if transport == "paramiko" else {}
    _say_unhonoured(name, sshc)
    identities: list[str] = []
    if entry.identity:
        identities.append(absolute(entry.identity))
    identities += [absolute(str(i)) for i in sshc.get("identityfile", []) or []]
    if d.identity and os.path.exists(absolute(d.identity)):
        identities.append(absolute(d.identity))  # a missing default key falls back to ssh's own keys/agent
    kh = absolute(d.known_hosts)
    port = entry.port or (int(sshc["port"]) if "port" in sshc else None) or d.port or 22
    proxy_jump, proxy_command = _proxy(entry.proxy_jump, sshc, d.proxy_jump)
    return ResolvedHost(
        name=name,
        transport=transport,
        hostname=str(sshc.get("hostname", alias)),
        port=port,
        user=entry.user or (str(sshc["user"]) if "user" in sshc else None) or d.user,
        identities=list(dict.fromkeys(identities)),
        known_hosts=kh,
        proxy_jump=proxy_jump,
        proxy_command=proxy_command,
        python=entry.python or d.python,
        workspace=entry.workspace or d.workspace,
        connect_timeout=d.connect_timeout,
        command_timeout=d.command_timeout,
        start_timeout=d.start_timeout if entry.start_timeout is None else entry.start_timeout,
        gpus=entry.gpus,
        private_address=entry.private_address,
        alias=alias,
        ssh_config=explicit,
        ssh_persist=d.ssh_persist,
        user_known_hosts=[os.path.expanduser(f) for f in
                          str(sshc.get("userknownhostsfile") or "~/.ssh/known_hosts ~/.ssh/known_hosts2").split()],
        strict_host_keys=str(sshc.get("stricthostkeychecking", "")).lower() == "yes",
    )


def _resolve_openssh(inv: Inventory, name: str, entry: HostEntry, alias: str, explicit: str | None,
                     absolute: Any) -> ResolvedHost:
    """The OpenSSH transport's view of a host: `ssh -G` with dfo's config (orchestrator/transport/openssh_setup.py)
    says what ssh will use; the host's own fields are -o options (they win), the inventory's defaults
    fill what ssh_config leaves unset."""
    from .openssh_setup import bare, pct, q, resolve

    d = inv.defaults
    own: list[str] = []
    if entry.port:
        own.append(f"Port={entry.port}")
    if entry.user:
        own.append(f"User={q(entry.user)}")
    if entry.identity:
        own.append(f"IdentityFile={q(pct(absolute(entry.identity)))}")
    if entry.proxy_jump:
        own.append(f"ProxyJump={bare('ProxyJump', entry.proxy_jump)}")  # ssh takes no quotes here (no blanks in it)
    fill: dict[str, str] = {}
    if d.user:
        fill["User"] = d.user
    if d.port:
        fill["Port"] = str(d.port)
    if d.identity and os.path.exists(absolute(d.identity)):
        fill["IdentityFile"] = pct(absolute(d.identity))  # a missing default key: ssh's own keys and agent
    if d.proxy_jump:
        fill["ProxyJump"] = d.proxy_jump
    config, got = resolve(alias, own, fill, explicit, d.connect_timeout)

    def one(key: str) -> str | None:
        v = got.get(key)
        return v[0] if v else None

    def given(v: str | None) -> str | None:
        return None if v is None or v.strip().lower() == "none" else v

    hostname, port, user = one("hostname") or alias, int(one("port") or 22), one("user")
    command = given(one("proxycommand"))
    if command:  # as ssh runs it (tokens expanded), for messages
        command = re.sub(r"%[%hpr]", lambda m: {"%%": "%", "%h": hostname, "%p": str(port),
                                                "%r": user or ""}[m.group(0)], command)
    return ResolvedHost(
        name=name, transport="openssh", hostname=hostname, port=port,
        user=user, identities=_configured_keys(got.get("identityfile", [])),
        known_hosts=absolute(d.known_hosts), proxy_jump=given(one("proxyjump")),
        proxy_command=command, python=entry.python or d.python,
        workspace=entry.workspace or d.workspace, connect_timeout=d.connect_timeout,
        command_timeout=d.command_timeout, gpus=entry.gpus, private_address=entry.private_address,
        start_timeout=d.start_timeout if entry.start_timeout is None else entry.start_timeout,
        alias=alias, ssh_options=own, ssh_config=explicit, ssh_resolve=str(config), ssh_resolved=got,
        ssh_persist=d.ssh_persist, user_known_hosts=[f for v in got.get("userknownhostsfile", []) for f in v.split()])


# ssh_config keywords the paramiko transport does not apply (OpenSSH's does): named on stderr, never ignored
# in silence. dfo's own policy replaces StrictHostKeyChecking, ServerAlive*, ConnectTimeout, HashKnownHosts.
_PARAMIKO_IGNORES = {
    "include": "Include", "identitiesonly": "IdentitiesOnly", "identityagent": "IdentityAgent",
    "certificatefile": "CertificateFile", "controlmaster": "ControlMaster", "controlpath": "ControlPath",
    "controlpersist": "ControlPersist", "hostkeyalias": "HostKeyAlias", "pkcs11provider": "PKCS11Provider",
    "securitykeyprovider": "SecurityKeyProvider", "canonicalizehostname": "CanonicalizeHostname",
    "addressfamily": "AddressFamily", "bindaddress": "BindAddress", "forwardagent": "ForwardAgent",
    "pubkeyacceptedalgorithms": "PubkeyAcceptedAlgorithms", "hostkeyalgorithms": "HostKeyAlgorithms",
    "kexalgorithms": "KexAlgorithms", "ciphers": "Ciphers", "macs": "MACs",
}
_SAID: set[str] = set()


# `ssh -G` prints every keyword; these values are OpenSSH's defaults (not the user's doing). The algorithm
# lists always print, so for those only paramiko's own reading of the top-level files can tell.
_SSH_G_DEFAULTS = {
    "identitiesonly": {"no"}, "controlmaster": {"false", "no"}, "controlpersist": {"no"}, "controlpath": {"none"},
    "forwardagent": {"no"}, "canonicalizehostname": {"false", "no"}, "addressfamily": {"any"},
    "securitykeyprovider": {"internal", "$SSH_SK_PROVIDER"}, "identityagent": {"SSH_AUTH_SOCK", "none"},
    "pkcs11provider": {"none"},
}


def _fabric_jump(spec: str) -> str:
    """``ssh -G``'s ProxyJump (``root@[10.0.0.2]:22``) as fabric parses one (``root@10.0.0.2:22``): no
    brackets around a name or an IPv4 address (an IPv6 address keeps none either, and loses a port)."""
    from .openssh_setup import jump_hops

    hops = []
    for user, host, port in jump_hops(spec):
        hop = f"{host}:{port}" if port and ":" not in host else host
        hops.append(f"{user}@{hop}" if user else hop)
    return ",".join(hops)


def _ssh_g_usable() -> bool:
    """The paramiko transport resolves hosts with `ssh -G` when an OpenSSH client is on PATH."""
    from .openssh_setup import usable_ssh

    return usable_ssh() is not None


def _top_level_lookup(alias: str, explicit: str | None) -> dict[str, Any]:
    """paramiko's own reading of the user's files (for naming keywords only): {} where it cannot read them
    (`ssh -G` did, and that is what counts)."""
    try:
        return _ssh_config_lookup(alias, explicit)
    except ConfigError:
        return {}


def _say_unhonoured(name: str, sshc: dict[str, Any], resolved: dict[str, list[str]] | None = None) -> None:
    """On the paramiko transport: name, once per host, the ssh_config keywords it does not apply. With
    ``resolved`` (`ssh -G`'s answer, which already applied Include), keywords set anywhere count too."""
    import glob
    import sys

    def set_by_user(k: str) -> bool:
        if resolved is not None and k == "include":
            return False  # ssh -G read the included files: what they say of this host was applied
        if k in sshc and (k != "include" or any(glob.glob(os.path.expanduser(f)) for f in str(sshc[k]).split())):
            return True
        if resolved is None or k not in _SSH_G_DEFAULTS or k not in resolved:
            return False
        return any(v not in _SSH_G_DEFAULTS[k] for v in resolved[k])

    keys = [v for k, v in _PARAMIKO_IGNORES.items() if set_by_user(k)]
    if keys and name not in _SAID:
        _SAID.add(name)
        sys.stderr.write(f"dfo: {name}: the paramiko transport does not apply {', '.join(keys)} from ssh_config "
                         "(transport: openssh does)\n")


_SSH_DEFAULT_KEYS = ["id_rsa", "id_ecdsa", "id_ecdsa_sk", "id_ed25519", "id_ed25519_sk", "id_xmss", "id_dsa"]


def _configured_keys(files: list[str]) -> list[str]:
    """ssh -G's IdentityFile list, less ssh's own defaults (listed when nothing names a key)."""
    if [os.path.basename(f) for f in files] == _SSH_DEFAULT_KEYS:
        return []
    return [os.path.expanduser(f) for f in files]
