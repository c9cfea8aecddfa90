"""dfo verify-env: what the node has, and whether the job's environment holds."""

from __future__ import annotations

from typing import Any

import click
from rich.table import Table

from remote.lib.fsutil import human_bytes

from ..cli_common import console, each_and_emit, hosts_option, job_option, json_option, safe, session
from ..config.models import load_job
from ..steps.verify_env import VerifyReport, verify_env
from .runs_view import dfo_cmd


def _gib(n: int | None) -> str:
    if n is None:
        return "?"
    return human_bytes(n)


def render(host: str, r: VerifyReport) -> None:
    f = r.facts
    t = Table(title=f"{safe(host)}: {'ok' if r.ok else 'PROBLEMS'}", title_justify="left", show_header=False,
              box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column()

    def row(key: str, value: str) -> None:
        t.add_row(safe(key), safe(value))  # what the node says is text, never markup, never a control code

    row("os", f"{f.os}, kernel {f.kernel}, {f.arch}")
    row("cpus / memory", f"{f.cpus} / {_gib(f.memory.total)} ({_gib(f.memory.available)} available)")
    row("python3", f"{f.python} ({f.python_executable})")
    if f.user is not None:
        row("user", f"{f.user.name} (uid {f.user.uid}, home {f.user.home})")
    if f.workspace is not None:
        ws = f.workspace
        row("workspace", ws.path + (f" (default: {ws.why})" if ws.default else f" (given: {ws.given})"))
    for name, d in f.disk.items():
        row(f"free {name}", f"{_gib(d.free)} of {_gib(d.total)} at {d.path}"
            + ("" if d.exists else " (not created yet)") + (" (not writable)" if d.writable is False else ""))
    if f.nvidia.present:
        row("nvidia",
            f"driver {f.nvidia.driver}, CUDA {f.nvidia.cuda}" + (f" ({f.nvidia.error})" if f.nvidia.error else ""))
        for g in f.nvidia.gpus:
            row(f"  gpu {g.index}", f"{g.name}, {_gib(g.memory)}, sm_{(g.capability or '?').replace('.', '')}")
    else:
        row("nvidia", "no nvidia-smi")
    tc = f.triton_cache
    row("triton cache", f"{tc.path}: " + (f"{tc.bytes / 2**20:.1f} MiB in {tc.files} files" if tc.exists else "absent"))
    if f.venv_python:
        row("job python", f.venv_python + ("" if f.venv_python_exists else " (missing)"))
    if r.provision:
        prov = r.provision
        row("provisioned", f"{prov.get('finished') or prov.get('time') or '?'} ({len(prov.get('steps', []))} steps, "
                                 f"{len(prov.get('warnings', []))} warnings)")
    console.print(t)
    if r.packages:
        pt = Table("package", "installed", box=None, pad_edge=False, header_style="bold")
        for name, ver in r.packages.items():
            pt.add_row(safe(name), safe(ver) if ver else "[red]not installed[/]")
        console.print(pt)
    if r.gpu:
        gt = Table("gpu", "name", "arch", "in build", "triton", "fla", "seconds", box=None, pad_edge=False,
                   header_style="bold")
        for g in r.gpu.get("gpus", []):
            fla = g.get("fla_ok")
            gt.add_row(safe(g.get("index")), safe(g.get("name")), safe(g.get("arch")),
                       "yes" if g.get("arch_in_build") else "[red]NO[/]",
                       "ok" if g.get("triton_ok") else "[red]FAIL[/]",
                       "-" if fla is None else ("ok" if fla else "[red]FAIL[/]"), f"{g.get('seconds', 0):.2f}")
        console.print(gt)
    if r.health:
        render_health(r.health)
    for w in r.warnings:
        extra = f" (override: {w.reason})" if w.reason and w.reason not in w.message else ""
        console.print(f"[yellow]warning[/]: {safe(w.message + extra)}", soft_wrap=True)
    for p in r.problems:
        console.print(f"[red]problem[/]: {safe(p.message)}", soft_wrap=True)


_VERDICT = {"pass": "[green]pass[/]", "fail": "[red]FAIL[/]", "warn": "[yellow]warn[/]", "info": "info",
            "skip": "[dim]skip[/]"}


def render_health(data: dict[str, Any]) -> None:
    """The gate's figures beside what they should be, then every check that did not pass."""
    from ..steps.health import verdict_line

    checks = [c for c in data.get("checks") or [] if isinstance(c, dict)]
    ok = bool(data.get("ok"))
    console.print(f"[bold]health[/]: {'[green]' if ok else '[red]'}{safe(verdict_line(data))}[/]", soft_wrap=True)
    figs = [c for c in checks if c.get("unit") and isinstance(c.get("value"), int | float)]

    def num(v: Any, unit: Any = None) -> str:
        if not isinstance(v, int | float):
            return "-"
        return human_bytes(v) if unit == "bytes" else f"{v:.4g}"
    if figs:
        t = Table("gpu", "figure", "value", "passes at", "expected", "verdict", box=None, pad_edge=False,
                  header_style="bold")
        for c in figs:
            unit = c.get("unit")
            value = num(c.get("value"), unit) + ("" if unit == "bytes" else f" {unit}")
            bound = (("<= " if c.get("bound") == "max" else ">= ") + num(c.get("threshold"), unit)
                     if c.get("threshold") is not None else "-")
            t.add_row(safe("all" if c.get("gpu") is None else c.get("gpu")), safe(c.get("check")), safe(value),
                      safe(bound), safe(num(c.get("expected"), unit)),
                      _VERDICT.get(str(c.get("verdict")), safe(c.get("verdict"))))
        console.print(t)
    passed = [c for c in checks if c.get("verdict") == "pass"]
    for c in checks:
        if c.get("verdict") in ("fail", "warn") or (c.get("verdict") != "pass" and c not in figs):
            console.print(f"  {_VERDICT.get(str(c.get('verdict')), '?')} {safe(c.get('message'))}", soft_wrap=True)
    phases = ", ".join(f"{k} {v:.1f}s" for k, v in (data.get("phases") or {}).items() if isinstance(v, int | float))
    console.print(f"  [dim]{len(passed)} of {len(checks)} checks passed; {safe(phases)}[/]", soft_wrap=True)


@click.command("verify-env")
@hosts_option
@job_option(required=False)
@click.option("--gpu", is_flag=True, help="Also run the GPU preflight with the job's interpreter: each GPU seen by "
              "torch, its arch in the torch build, a Triton kernel, and an FLA Gated DeltaNet op when FLA is "
              "installed.")
@click.option("--health", is_flag=True, help="Also run the GPU health gate with the job's interpreter (about a "
              "minute for 8 GPUs): other processes and memory on each GPU, ECC, XIDs, reset state, power limit, "
              "throttling under load, the PCIe link, and bf16 matmul, memory copy, host<->device and NCCL "
              "all-reduce figures beside what the GPU model should give (docs/gpu.md). run.health's thresholds "
              "apply when -j has them.")
@json_option
@click.pass_context
def verify_env_cmd(ctx: click.Context, hosts: tuple[str, ...], job_path: str | None, gpu: bool, as_json: bool,
                   health: bool = False) -> int:
    """Probe nodes and check the job's environment; change nothing.

    Reports OS, kernel, CPUs, memory, python3, free space of the workspace and of /dev/shm,
    the GPUs (nvidia-smi), and the Triton cache. With -j it reads package versions from the
    job's venv interpreter (the one the trainer uses), checks them against the job's pins and
    checks that every installed distribution's own requirements hold, naming the pin that
    breaks (a job override with a reason turns a break into a warning). Also reports known-bad
    combinations (GPU arch x package versions). Hosts are probed in parallel.

    Shows the node's user and the workspace dfo uses there: the one given (job, else inventory),
    else the node's default, /workspace when the user may write it and ~/workspace when not. With
    -j, every path of the job (workspace, venv, model.dest, data.dest, run.workdir, code.dest,
    outputs.path; ~ is the node user's home) that the user cannot write is a problem naming the
    field, and a warning names what provision would miss: ensurepip (the python3.X-venv package)
    when it must create the venv with `python3 -m venv`, uv, or the job's python.

    \b
    Exit codes: 0 no problem; 2 bad usage or job file; 3 a problem remains (a pin, a broken
    requirement, a missing venv, a path the user cannot write, a known-bad combination, a GPU
    check, a failed health check, python3 older than 3.8); 4 host unreachable or login refused.
    """
    job = load_job(job_path).job if job_path else None

    def one(conn: Any) -> VerifyReport:
        report = verify_env(conn, job, gpu=gpu, health=health)
        for p in report.problems:
            if p.kind == "venv_missing" and job_path:  # the command to run, as it works when pasted
                p.message = (f"the job's interpreter {p.expected} does not exist; run: "
                             f"{dfo_cmd(ctx, 'provision', conn.name, job_path=job_path)}")
        return report

    with session(ctx, hosts) as s:
        return each_and_emit(s, one, as_json, VerifyReport.model_dump, render, command="verify-env")


COMMANDS = [verify_env_cmd]
