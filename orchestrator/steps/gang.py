"""Gangs (issue 13): the plan of a run over several nodes, and the pure checks before its launch.

Nothing here opens a connection: ``plan_gang`` turns the loaded job and the ordered hosts into
what each node runs (its environment and, with ``launcher: torchrun``, its command);
``preflight_problems`` and ``address_problems`` turn what the nodes reported (remote/gang/ops.py ops
``facts``, ``listen`` and ``connect``) into one line per node that differs or cannot reach rank 0.
The design and the reasons are in docs/gangs.md; ``prepare`` (below) runs the checks on the
nodes before ``launch``/``up`` start a gang.
"""

from __future__ import annotations

import secrets
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import nodepath
from ..errors import ConfigError, UsageError
from .runs import render_command

if TYPE_CHECKING:
    from ..config.inventory import ResolvedHost
    from ..config.models import Job, RunConfig

WATCH_PORT_OFFSET = 1  # the gang watch's hub listens on rdzv_port + 1 on rank 0


JOIN_BASE_S = 30.0  # how long a hub waits for a member to join once every member has been started


def join_limit(nodes: int, connect_timeout: float) -> float:
    """Seconds rank 0's hub waits for a member's first join: JOIN_BASE_S after the last member can have been
    started. dfo starts every node of a gang at once, with at most hosts.PARALLEL connection set-ups at a time,
    each bounded by connect_timeout + 10 s (Transport.establish): a hub never gives up on a member that dfo
    has not started yet, however many nodes (issue 35)."""
    from ..hosts import PARALLEL

    waves = -(-max(nodes, 1) // PARALLEL)
    return JOIN_BASE_S + (waves - 1) * (float(connect_timeout) + 10.0) if nodes > PARALLEL else JOIN_BASE_S


@dataclass
class NodePlan:
    """What one node of the gang runs."""

    host: str                 # the inventory name
    rank: int                 # the order of -H (or of the group's members)
    address: str              # its gang address (private_address, else the SSH host name)
    nproc: int                # processes torchrun starts there (1 with launcher none)
    env: dict[str, str]       # added to the job's env (the job's own values win for GLOO_SOCKET_IFNAME)
    command: str              # shell text the supervisor runs
    gloo_ifname: bool         # True: the node sets GLOO_SOCKET_IFNAME to the interface holding `address`

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "rank": self.rank, "address": self.address, "nproc": self.nproc,
                "env": dict(self.env), "command": self.command, "gloo_ifname": self.gloo_ifname}


@dataclass
class GangPlan:
    run_id: str
    nodes: list[NodePlan]
    rdzv_port: int
    watch_port: int
    secret: str = field(repr=False)  # the gang watch's shared secret (hex): stdin only, never argv/logs
    generation: dict[str, Any] | None = None  # a recovering job's generation (steps/generation.py), set once
    join_timeout: float = JOIN_BASE_S  # rank 0's hub: seconds to wait for a member's first join (join_limit)

    @property
    def master(self) -> NodePlan:
        return self.nodes[0]

    def node(self, host: str) -> NodePlan:
        for n in self.nodes:
            if n.host == host:
                return n
        raise KeyError(host)


def nproc_for(run: RunConfig, gpus: int | None) -> int:
    """``nproc_per_node``: a number as given; auto = the node's GPU count, 1 on a node without GPUs."""
    if run.nproc_per_node != "auto":
        return int(run.nproc_per_node)
    return gpus if gpus and gpus > 0 else 1


def check_hosts(run: RunConfig, hosts: Sequence[ResolvedHost], job_name: str) -> None:
    """-H must name exactly run.nodes hosts, each once, with gang addresses that differ."""
    names = [h.name for h in hosts]
    if len(hosts) != run.nodes:
        raise UsageError(f"job {job_name}: run.nodes is {run.nodes} but -H names {len(hosts)} host"
                         f"{'' if len(hosts) == 1 else 's'} ({', '.join(names) or 'none'})",
                         hint=f"name exactly {run.nodes} hosts (a group works: -H GROUP), or change run.nodes")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UsageError(f"job {job_name}: -H names {', '.join(dup)} more than once",
                         hint="each node of a gang is a different host")
    seen: dict[str, str] = {}
    for h in hosts:
        addr = h.gang_address
        if addr in seen and run.nodes > 1:
            raise ConfigError(f"hosts {seen[addr]} and {h.name} have the same gang address {addr}",
                              hint=f"set hosts.{h.name}.private_address in the inventory: the address the "
                                   "other nodes use to reach it")
        seen[addr] = h.name


def torchrun_command(python: str, command: str, *, nodes: int, nproc: int, rank: int, master: str,
                     port: int, run_id: str, local_addr: str) -> str:
    """``{python} -m torch.distributed.run`` with the gang's rendezvous, then the job's command.

    One node: ``--standalone`` (a c10d store on localhost, a free port). Several: c10d on rank 0's
    address, rank 0 hosting the store (``is_host=1``; the others ``is_host=0``, so no node guesses
    from its own hostname, which may resolve to 127.0.0.1), and ``--local-addr`` = this node's gang
    address: torchrun publishes it as the workers' MASTER_ADDR when this node ends up first, where it
    would otherwise publish its FQDN. ``--node-rank`` is left out: the c10d backend ignores it."""
    argv = [python, "-m", "torch.distributed.run"]
    if nodes == 1:
        argv += ["--standalone", "--nnodes", "1", "--nproc-per-node", str(nproc)]
    else:
        argv += ["--nnodes", str(nodes), "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", f"{_host_port(master, port)}", "--rdzv-id", run_id,
                 "--rdzv-conf", f"is_host={1 if rank == 0 else 0}", "--local-addr", local_addr]
    return " ".join([nodepath.shell(python)] + [shlex.quote(a) for a in argv[1:]]) + " " + command


def _host_port(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr and not addr.startswith("[") else f"{addr}:{port}"


def plan_gang(job: Job, hosts: Sequence[ResolvedHost], run_id: str, *, gpus: Mapping[str, int | None] | None = None,
              workspace: str | None = None, secret: str | None = None) -> GangPlan:
    """Each node's env and command for a run of ``job`` over ``hosts`` (rank = their order).

    ``gpus`` maps a host name to its GPU count (from verify-env or the inventory's ``gpus``); a
    missing or None count means none found, so ``nproc_per_node: auto`` gives 1 there."""
    if job.run is None:
        raise ConfigError(f"job {job.name}: no 'run:' section", hint="add run: {command: ...} to the job file")
    run = job.run
    check_hosts(run, hosts, job.name)
    gpus = gpus or {}
    command = render_command(job, run_id=run_id, workspace=workspace)
    addrs = [h.gang_address for h in hosts]
    master, n = addrs[0], len(hosts)
    watch_port = run.rdzv_port + WATCH_PORT_OFFSET
    if watch_port > 65535:
        raise ConfigError(f"job {job.name}: run.rdzv_port {run.rdzv_port}: the gang watch needs the next port too",
                          hint="choose an rdzv_port below 65535")
    gloo_set = "GLOO_SOCKET_IFNAME" in run.env
    nodes = []
    for rank, h in enumerate(hosts):
        nproc = nproc_for(run, gpus.get(h.name)) if run.launcher == "torchrun" else 1
        env = {
            "DFO_RUN_ID": run_id, "DFO_NODE_RANK": str(rank), "DFO_NUM_NODES": str(n),
            "DFO_NODE_ADDRS": ",".join(addrs), "MASTER_ADDR": master, "MASTER_PORT": str(run.rdzv_port),
            # SkyPilot's names (docs.skypilot.co, distributed jobs): addresses one a line, rank 0 first
            "SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NUM_NODES": str(n), "SKYPILOT_NODE_IPS": "\n".join(addrs),
            "SKYPILOT_NUM_GPUS_PER_NODE": str(nproc),
            # dstack's names (dstack.ai, distributed tasks)
            "DSTACK_NODE_RANK": str(rank), "DSTACK_NODES_NUM": str(n), "DSTACK_NODES_IPS": "\n".join(addrs),
            "DSTACK_MASTER_NODE_IP": master,
        }
        if run.launcher == "torchrun":
            cmd = torchrun_command(job.venv_python, command, nodes=n, nproc=nproc, rank=rank, master=master,
                                   port=run.rdzv_port, run_id=run_id, local_addr=h.gang_address)
        else:
            cmd = command
        nodes.append(NodePlan(host=h.name, rank=rank, address=h.gang_address, nproc=nproc, env=env, command=cmd,
                              gloo_ifname=not gloo_set and n > 1))
    return GangPlan(run_id=run_id, nodes=nodes, rdzv_port=run.rdzv_port, watch_port=watch_port,
                    secret=secret or secrets.token_hex(32),
                    join_timeout=join_limit(n, max(float(h.connect_timeout) for h in hosts)))


# --------------------------------------------------------------------------- preflight
def _pkg_problems(host: str, ref_host: str, mine: Mapping[str, Any], ref: Mapping[str, Any]) -> list[str]:
    out = []
    for dist in sorted(set(mine) | set(ref), key=str.lower):
        a, b = mine.get(dist), ref.get(dist)
        if a == b:
            continue
        a_s = a if a is not None else "not installed"
        b_s = f"has {b}" if b is not None else "does not have it"
        out.append(f"{host}: {dist} {a_s}, {ref_host} {b_s}")
    return out


def _manifest_text(m: Mapping[str, Any]) -> str:
    return f"{m.get('files', 0)} files, {m.get('bytes', 0)} bytes from {m.get('source')}"


def preflight_problems(job_name: str, facts: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Every way a node differs from rank 0 (the first host in ``facts``), one line each, naming the
    node and the difference; empty when the gang may launch. ``facts`` maps host -> the node's
    ``remote.gang`` ``facts`` result, in rank order. A node without a provision record, or whose last
    provision failed, is a problem; so is a data or model manifest that differs (missing on every node
    is no difference)."""
    hosts = list(facts)
    if not hosts:
        return []
    problems: list[str] = []
    for h in hosts:
        prov = facts[h].get("provision")
        if prov is None:
            problems.append(f"{h}: no provision record for job {job_name} (run dfo provision -H {h} -j JOB)")
        elif not prov.get("ok"):
            problems.append(f"{h}: the last provision of job {job_name} failed (run dfo provision -H {h} -j JOB)")
    ref_host = next((h for h in hosts if facts[h].get("provision")), None)
    if ref_host is not None:
        ref = facts[ref_host]["provision"]
        for h in hosts:
            prov = facts[h].get("provision")
            if h == ref_host or prov is None:
                continue
            if prov.get("python") != ref.get("python"):
                problems.append(f"{h}: python {prov.get('python')}, {ref_host} has {ref.get('python')}")
            problems += _pkg_problems(h, ref_host, prov.get("packages") or {}, ref.get("packages") or {})
    for kind in ("data", "model"):
        ref_m = (facts[hosts[0]].get("manifests") or {}).get(kind)
        for h in hosts[1:]:
            m = (facts[h].get("manifests") or {}).get(kind)
            if (m or {}).get("digest") == (ref_m or {}).get("digest"):
                continue
            if m is None:
                problems.append(f"{h}: no {kind} manifest at {ref_m.get('path')}, {hosts[0]} has "  # type: ignore[union-attr]
                                f"{_manifest_text(ref_m)} (run dfo sync-data/stage-model -H {h} -j JOB)")  # type: ignore[arg-type]
            elif ref_m is None:
                problems.append(f"{h}: {kind} at {m.get('path')}: {_manifest_text(m)}, "
                                f"{hosts[0]} has no {kind} manifest")
            else:
                same_shape = (m.get("files"), m.get("bytes"), m.get("source")) == \
                    (ref_m.get("files"), ref_m.get("bytes"), ref_m.get("source"))
                tail = " (same count and size, other ETags)" if same_shape else ""
                problems.append(f"{h}: {kind} at {m.get('path')}: {_manifest_text(m)}, "
                                f"{hosts[0]} has {_manifest_text(ref_m)}{tail}")
    return problems


# --------------------------------------------------------------------------- address check
def address_problems(plan: GangPlan, results: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One line per node that could not reach rank 0, naming both nodes; ``results`` maps host ->
    the ``listen`` result (rank 0) or the ``connect`` result (the others)."""
    m = plan.master
    problems: list[str] = []
    lres = results.get(m.host) or {}
    if lres.get("error"):
        problems.append(f"{m.host}: cannot listen on port {lres.get('port')} for the gang: {lres['error']}")
    for n in plan.nodes[1:]:
        r = results.get(n.host) or {}
        if r.get("ok"):
            continue
        why = r.get("error") or "no answer"
        problems.append(f"{n.host} cannot reach {m.host} at {_host_port(m.address, r.get('port') or plan.rdzv_port)}:"
                        f" {why} (open TCP ports {plan.rdzv_port}-{plan.watch_port} on {m.host} to {n.host}, "
                        f"or set hosts.{m.host}.private_address)")
    return problems


# --------------------------------------------------------------------------- before the launch, on the nodes
CHECK_WINDOW_S = 20.0


def is_gang(job: Job) -> bool:
    """A run launched as a gang: several nodes, or torchrun (one node: --standalone)."""
    return job.run is not None and (job.run.nodes > 1 or job.run.launcher == "torchrun")


def _all_or_raise(outcomes: Sequence[Any]) -> dict[str, Any]:
    """host -> value; the first host's error (unreachable: exit 4) is raised, naming that host."""
    for o in outcomes:
        if o.error is not None:
            raise o.error
    return {o.host: o.value for o in outcomes}


def prepare(sess: Any, job: Job, run_id: str) -> GangPlan:
    """Plan the gang over the session's hosts (in -H order), then on every node at once: the
    preflight (provision record and manifests the same everywhere) and the address check (every node
    reaches rank 0's rdzv and watch ports). A difference or an unreachable port: VerifyError (exit 3)
    naming the nodes. Returns the plan to launch."""
    from ..agent import NODE, run_module
    from ..errors import VerifyError
    from .workspace import job_workspace

    assert job.run is not None
    hosts = [sess.hosts[n] for n in sess.names]
    check_hosts(job.run, hosts, job.name)
    workspace = job_workspace(job, hosts[0].workspace)
    manifests = {"data": job.data.dest if job.data else None, "model": job.model.dest if job.model else None}

    def facts(conn: Any) -> Any:
        return run_module(conn, NODE.gang, {"op": "facts", "workspace": job_workspace(job, conn.host.workspace),
                                              "job": job.name, "manifests": manifests}, timeout=60)

    got = _all_or_raise(sess.each(facts))
    # nproc_per_node auto: the inventory's hosts.NAME.gpus when set, else what the node's driver lists
    gpus = {h.name: h.gpus if h.gpus is not None else got[h.name].get("gpus") for h in hosts}
    plan = plan_gang(job, hosts, run_id, gpus=gpus, workspace=workspace)
    # one node (torchrun --standalone) has nothing to agree with: its own provision is its business
    problems = preflight_problems(job.name, {h.name: got[h.name] for h in hosts}) if len(hosts) > 1 else []
    if problems:
        raise VerifyError(f"gang preflight of job {job.name}: the nodes differ:\n  " + "\n  ".join(problems),
                          hint="provision, sync-data and stage-model every node of the gang with the same job "
                               "(dfo up -H GROUP -j JOB does all three)")
    if len(plan.nodes) < 2:
        return plan
    token = secrets.token_hex(8)
    ports = [plan.rdzv_port, plan.watch_port]

    def check(conn: Any) -> Any:
        node = plan.node(conn.host.name)
        if node.rank == 0:
            # the watch port listens where the gang watch will: rank 0's gang address only
            req = {"op": "listen", "ports": ports, "token": token, "expect": len(plan.nodes) - 1,
                   "window": CHECK_WINDOW_S, "bind": {"ports": [plan.watch_port], "address": plan.master.address,
                                                      "peer": plan.nodes[1].address},
                   "members": [n.address for n in plan.nodes[1:]]}  # admitted apart from strangers
        else:
            req = {"op": "connect", "address": plan.master.address, "ports": ports, "token": token,
                   "rank": node.rank, "window": CHECK_WINDOW_S - 2}
        return run_module(conn, NODE.gang, req, timeout=CHECK_WINDOW_S + 60)

    results = _all_or_raise(sess.each(check))
    problems = address_problems(plan, results)
    if problems:
        raise VerifyError(f"gang address check of job {job.name}:\n  " + "\n  ".join(problems),
                          hint="every node must reach rank 0 on the rendezvous port and the next one")
    return plan
