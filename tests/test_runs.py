"""dfo launch / tail / status / stop through the real CLI against testbed nodes (real sshd)."""

from __future__ import annotations

import hashlib
import json
import signal
import time
from pathlib import Path

import pytest

from tests._runs_fixtures import (
    AUTOTUNER_CRASH,
    COUNTER,
    GATED_COUNTER,
    TREE,
    RunsEnv,
    dfo_popen,
    expected_lines,
    inventory_copy,
    memory_cgroup,
)

on_testbed = pytest.mark.testbed


@pytest.fixture
def env(testbed, tmp_path: Path) -> RunsEnv:  # type: ignore[no-untyped-def]
    """The session's testbed node (shared: every test uses its own job name)."""
    return RunsEnv(testbed, testbed.nodes[0], inventory_copy(testbed, tmp_path), tmp_path)


@on_testbed
def test_tail_shows_every_line_once_while_the_connection_is_cut(make_testbed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    tb = make_testbed(s3=False)
    env = RunsEnv(tb, tb.nodes[0], inventory_copy(tb, tmp_path), tmp_path)
    n = 800
    job, _ = env.job(f"python3 count.py {n} 0.02", {"count.py": COUNTER})
    run = env.launch(job)["run"]
    tail = dfo_popen(env.inv, "tail", "-H", env.node.name, run, "-n", "+1", env={"DFO_TAIL_STALL_S": "2"})
    assert tail.stdout is not None and tail.stdout.readline() == "line 000000\n"  # it is following
    killed = 0
    for _ in range(3):  # the node side of the SSH session dies (sshd killed): the channel closes
        deadline = time.monotonic() + 10
        while not (cut := tb.kill_ssh_sessions(env.node)) and time.monotonic() < deadline:
            time.sleep(0.1)  # tail is between connections: wait for the next one
        killed += cut
        time.sleep(1.5)
    tb.link_down(env.node)  # a dead link: nothing arrives, not even an error, until the watchdog acts
    time.sleep(4)
    tb.link_up(env.node)
    out = tail.stdout.read()  # (not communicate(): it would skip what readline() buffered)
    err = tail.stderr.read() if tail.stderr else ""
    assert tail.wait(timeout=30) == 0, err
    assert killed >= 3
    assert ["line 000000", *out.splitlines()] == expected_lines(n)  # every line exactly once, in order
    assert err.count("reconnected to") >= 4, err  # three kills + the stalled link
    assert "nothing heard for 2s" in err


@on_testbed
def test_run_outlives_the_controller_and_tail_picks_it_up(env: RunsEnv) -> None:
    n, gate = 200, f"/root/runs-test/gate-{env.tmp.name}"
    job, name = env.job(f"python3 gated.py {n} 0.01 {gate}", {"gated.py": GATED_COUNTER})  # runs until the gate
    # launch watches for 30 s; kill the controller in the middle of it, hard
    p = dfo_popen(env.inv, "launch", "-H", env.node.name, "-j", str(job), "--wait", "30")
    # launch's "started run ... watching" line means the run is up and launch is watching it (no
    # fixed sleep: on a busy machine the start alone can take seconds)
    assert p.stdout is not None and "started run" in p.stdout.readline()
    p.kill()
    p.communicate(timeout=10)
    st = env.dfo("status", "-H", env.node.name, "-j", str(job), "--json")
    runs = json.loads(st.stdout)["hosts"][env.node.name]["runs"]
    assert len(runs) == 1 and runs[0]["state"] == "running" and runs[0]["job"] == name
    run = runs[0]["id"]
    # a tail killed hard leaves the run alone too
    t = dfo_popen(env.inv, "tail", "-H", env.node.name, run)
    time.sleep(2)
    t.kill()
    t.communicate(timeout=10)
    assert env.status(run)["state"] == "running"
    # a tail that gets Ctrl-C detaches (exit 130) and leaves the run alone
    t = dfo_popen(env.inv, "tail", "-H", env.node.name, run)
    assert t.stdout is not None and t.stdout.readline().startswith("line ")  # it is following now
    t.send_signal(signal.SIGINT)
    _, err = t.communicate(timeout=10)
    assert t.returncode == 130 and "detached" in err
    assert env.status(run)["state"] == "running"
    # a later tail, from the start, sees every line and ends with the run
    env.node_sh(f"touch {gate}")
    r = env.dfo("tail", "-H", env.node.name, run, "-n", "+1", timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == expected_lines(n)
    assert "succeeded" in r.stderr
    # --no-follow and --lines N behave as in tail
    r = env.dfo("tail", "-H", env.node.name, run, "--no-follow", "--lines", "3")
    assert r.returncode == 0 and r.stdout.splitlines() == expected_lines(n)[-3:]
    r = env.dfo("tail", "-H", env.node.name, "-j", str(job), "--no-follow", "-n", f"+{n - 1}")
    assert r.stdout.splitlines() == expected_lines(n)[-2:]


@on_testbed
def test_autotuner_crash_at_launch_exits_5_with_that_diagnosis(env: RunsEnv) -> None:
    job, _ = env.job("python3 train_dflash_online.py", {"train_dflash_online.py": AUTOTUNER_CRASH}, wait=20)
    t0 = time.monotonic()
    r = env.dfo("launch", "-H", env.node.name, "-j", str(job))
    assert r.returncode == 5, r.stdout + r.stderr
    assert time.monotonic() - t0 < 15  # it did not sit out the 20 s window
    assert "TypeError: 'NoneType' object is not a mapping" in r.stdout  # streamed first lines
    assert "failed" in r.stdout and "exit code 1" in r.stdout
    assert "diagnosis: Triton autotuner race between threads [triton-autotuner-race]" in r.stdout
    assert "run.autotune_guard: true" in r.stdout
    # the JSON contract carries the same
    j = env.dfo("launch", "-H", env.node.name, "-j", str(job), "--json")
    assert j.returncode == 5
    h = json.loads(j.stdout)["hosts"][env.node.name]
    assert h["state"] == "failed" and h["exit_code"] == 1 and isinstance(h["pid"], int)
    assert [d["name"] for d in h["diagnosis"]][0] == "triton-autotuner-race"
    assert h["last_lines"][-1] == "TypeError: 'NoneType' object is not a mapping"
    # status names it too
    s = env.dfo("status", "-H", env.node.name, "-j", str(job))
    assert s.returncode == 0 and "Triton autotuner race" in s.stdout


@on_testbed
def test_exit_codes_propagate(env: RunsEnv) -> None:
    job, _ = env.job("python3 count.py 3 0.01 7", {"count.py": COUNTER})
    run = env.launch(job)["run"]
    r = env.dfo("tail", "-H", env.node.name, run, "-n", "+1", timeout=60)
    assert r.returncode == 5 and r.stdout.splitlines() == expected_lines(3)
    assert "exit code 7" in r.stderr
    st = env.status(run)
    assert st["state"] == "failed" and st["exit_code"] == 7 and st["ended"]
    assert env.run_file(run, "end.json")["exit_code"] == 7
    ok, _ = env.job("python3 count.py 2 0.01 0", {"count.py": COUNTER})
    run = env.launch(ok)["run"]
    r = env.dfo("tail", "-H", env.node.name, run, timeout=60)
    assert r.returncode == 0 and env.status(run)["state"] == "succeeded" and env.status(run)["exit_code"] == 0


@on_testbed
def test_sigkill_is_flagged_as_likely_oom(env: RunsEnv) -> None:
    job, _ = env.job("python3 -c 'import os, signal; print(\"allocating\", flush=True); "
                     "os.kill(os.getpid(), signal.SIGKILL)'")
    h = env.launch(job, "--wait", "10")
    assert h["state"] == "failed" and h["signal"] == "SIGKILL" and h["exit_code"] is None
    assert h["diagnosis"][0]["name"] == "killed-sigkill"
    assert h["diagnosis"][0]["line"].startswith("ended by signal SIGKILL")
    end = env.run_file(h["run"], "end.json")
    assert end["oom_suspected"] is True and "kernel_source" in end


@on_testbed
def test_an_oom_kill_is_reported_with_the_kernels_word(env: RunsEnv) -> None:
    go = f"/root/runs-test/go-{env.tmp.name}"
    hog = ("import os, sys, time\n"
           "while not os.path.exists(sys.argv[1]):\n"  # until the test has put us in the small cgroup
           "    time.sleep(0.05)\n"
           "chunks = []\n"
           "for i in range(1024):\n"
           "    chunks.append(bytearray(1 << 20))\n"
           "    if i % 16 == 0:\n"
           "        print('allocated', i, 'MiB', flush=True)\n")
    with memory_cgroup(64) as procs:
        if procs is None:
            pytest.skip("no memory cgroup can be made here to trigger a real OOM kill")
        job, _ = env.job(f"python3 hog.py {go}", {"hog.py": hog})
        h = env.launch(job)
        Path(procs).write_text(str(h["pid"]))  # from this machine: the node does not mount cgroupfs
        env.node_sh(f"touch {go}")
        st = env.wait_state(h["run"], ("failed", "succeeded", "lost"), timeout=30)
    assert st["state"] == "failed" and st["signal"] == "SIGKILL", st
    assert st["diagnosis"][0]["name"] == "killed-sigkill"
    end = env.run_file(h["run"], "end.json")
    assert end["oom_suspected"] is True
    if end["kernel_source"] is not None:  # the node lets dfo read the kernel log: its word is quoted
        assert any(f"Killed process {h['pid']} " in k for k in end["kernel"]), end
        assert f"Killed process {h['pid']} (python3)" in st["diagnosis"][0]["line"]


@on_testbed
def test_second_launch_is_refused_unless_forced(env: RunsEnv) -> None:
    job, _ = env.job("python3 count.py 600 0.1", {"count.py": COUNTER})
    first = env.launch(job)["run"]
    r = env.dfo("launch", "-H", env.node.name, "-j", str(job))
    assert r.returncode == 2
    assert f"already has a live run here: {first}" in r.stderr and "--force" in r.stderr
    forced = env.launch(job, "--force")
    assert forced["state"] == "running" and forced["run"] != first
    for run in (first, forced["run"]):
        s = env.dfo("stop", "-H", env.node.name, run, "--grace", "5")
        assert s.returncode == 0 and "stopped" in s.stdout
    assert env.status(first)["state"] == "stopped"
    again = env.launch(job)  # nothing live any more: allowed
    assert again["state"] == "running"
    assert env.dfo("stop", "-H", env.node.name, again["run"], "--grace", "1").returncode == 0


@on_testbed
def test_stop_ends_the_whole_process_group(env: RunsEnv) -> None:
    job, _ = env.job("python3 tree.py", {"tree.py": TREE}, stop_grace=5)
    h = env.launch(job, "--wait", "1")
    assert h["state"] == "running"
    deadline = time.monotonic() + 20
    while True:  # until all three have printed their pids
        log = env.node_sh(f"cat /workspace/.dfo/runs/{h['run']}/log")
        pids = {line.split()[0]: int(line.split()[1]) for line in log.splitlines()}
        if len(pids) == 3 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert set(pids) == {"trainer", "child", "grandchild"} and pids["trainer"] == h["pid"]
    assert all(env.alive(p) for p in pids.values())
    r = env.dfo("stop", "-H", env.node.name, h["run"])
    assert r.returncode == 0, r.stderr
    assert "stopped" in r.stdout and "SIGTERM" in r.stdout
    assert not any(env.alive(p) for p in pids.values())
    st = env.status(h["run"])
    assert st["state"] == "stopped" and st["signal"] == "SIGTERM"
    r = env.dfo("stop", "-H", env.node.name, h["run"])
    assert r.returncode == 0 and "nothing to stop" in r.stdout


@on_testbed
def test_stop_escalates_to_sigkill_after_the_grace(env: RunsEnv) -> None:
    stubborn = ("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "print('ready', flush=True)\ntime.sleep(600)\n")
    job, _ = env.job("python3 stubborn.py", {"stubborn.py": stubborn})
    h = env.launch(job, "--wait", "1.5")
    r = env.dfo("stop", "-H", env.node.name, h["run"], "--grace", "1", "--json")
    doc = json.loads(r.stdout)["hosts"][env.node.name]
    assert doc["state"] == "stopped" and "SIGKILL" in doc["stop"] and doc["group_left"] == []
    assert not env.alive(h["pid"])


@on_testbed
def test_a_run_whose_processes_vanish_is_lost(env: RunsEnv) -> None:
    job, _ = env.job("python3 count.py 600 0.1", {"count.py": COUNTER})
    run = env.launch(job)["run"]
    meta = env.run_file(run, "meta.json")
    env.node_sh(f"kill -9 {meta['supervisor_pid']} {meta['pid']}")
    st = env.wait_state(run, ("lost",), timeout=10)
    assert st["state"] == "lost" and st["exit_code"] is None and st["ended"] is None
    assert st["diagnosis"][0]["name"] == "lost"
    r = env.dfo("tail", "-H", env.node.name, run, timeout=30)
    assert r.returncode == 5 and "lost" in r.stderr
    r = env.dfo("status", "-H", env.node.name, "-j", str(job))
    assert "lost" in r.stdout and run in r.stdout


@on_testbed
def test_secrets_reach_the_trainer_but_never_the_disk(env: RunsEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    secret, from_shell = "s3cr3t-" + "x" * 12, "sh3ll-" + "y" * 12
    show = ("import hashlib, os\n"
            "for k in ('HF_TOKEN', 'WANDB_KEY', 'PLAIN'):\n"
            "    print(k, hashlib.sha256(os.environ.get(k, '').encode()).hexdigest(), flush=True)\n"
            "print('unbuffered', os.environ.get('PYTHONUNBUFFERED'))\n")
    job, _ = env.job("python3 show.py", {"show.py": show}, env={"HF_TOKEN": secret, "PLAIN": "visible"},
                     secret_env=["WANDB_KEY"])
    monkeypatch.setenv("WANDB_KEY", from_shell)
    h = env.dfo("launch", "-H", env.node.name, "-j", str(job), "--json", "--wait", "5",
                env={"WANDB_KEY": from_shell})
    assert h.returncode == 0, h.stderr
    run = json.loads(h.stdout)["hosts"][env.node.name]["run"]
    r = env.dfo("tail", "-H", env.node.name, run, "-n", "+1")
    got = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert got["HF_TOKEN"] == hashlib.sha256(secret.encode()).hexdigest()
    assert got["WANDB_KEY"] == hashlib.sha256(from_shell.encode()).hexdigest()
    assert got["unbuffered"] == "1"
    meta = env.run_file(run, "meta.json")
    assert meta["env"]["PLAIN"] == "visible" and sorted(meta["secret_env"]) == ["HF_TOKEN", "WANDB_KEY"]
    assert "HF_TOKEN" not in meta["env"] and "WANDB_KEY" not in meta["env"]
    leak = env.tb.node_exec(env.node, f"grep -rl -e {secret} -e {from_shell} /workspace/.dfo /root/runs-test")
    assert leak.stdout == ""
    # a secret_env name missing from the controller's environment is a clear config error
    monkeypatch.delenv("WANDB_KEY")
    r = env.dfo("launch", "-H", env.node.name, "-j", str(job))
    assert r.returncode == 2 and "WANDB_KEY is not set" in r.stderr and from_shell not in r.stderr


@on_testbed
def test_uploads_only_when_changed(env: RunsEnv) -> None:
    workdir = f"/root/uploads-{env.tmp.name}"
    job, _ = env.job("python3 count.py 1 0", {"count.py": COUNTER}, workdir=workdir)
    first = env.launch(job, "--wait", "5")
    assert first["uploads"] == [{"path": "count.py", "sha256": hashlib.sha256(COUNTER.encode()).hexdigest(),
                                 "changed": True}]
    again = env.launch(job, "--wait", "5")
    assert again["uploads"][0]["changed"] is False and again["state"] == "succeeded"
    (env.tmp / "count.py").write_text(COUNTER + "print('v2')\n")
    third = env.launch(job, "--wait", "5")
    assert third["uploads"][0]["changed"] is True
    assert env.node_sh(f"tail -n 1 {workdir}/count.py").strip() == "print('v2')"


@on_testbed
def test_autotune_guard_is_put_on_the_trainers_path(env: RunsEnv) -> None:
    probe = ("import os, sys, tempfile\n"
             "import sitecustomize\n"
             "print('sitecustomize', sitecustomize.__file__, flush=True)\n"
             "print('log', os.environ['DFO_AUTOTUNE_GUARD_LOG'], flush=True)\n"
             "print('pythonpath', os.environ['PYTHONPATH'], flush=True)\n"
             "fake = tempfile.mkdtemp()\n"  # a 'triton' the guard was never checked against: it must refuse
             "os.mkdir(fake + '/triton')\n"
             "open(fake + '/triton/__init__.py', 'w').write('__version__ = \"0.0.1\"\\n')\n"
             "sys.path.insert(0, fake)\n"
             "import triton\n")
    job, _ = env.job("python3 probe.py", {"probe.py": probe}, autotune_guard=True, env={"PYTHONPATH": "/opt/mine"})
    h = env.launch(job, "--wait", "5")
    assert h["state"] == "succeeded"
    assert h["autotune_guard"]["enabled"] is True
    out = env.dfo("tail", "-H", env.node.name, h["run"], "-n", "+1").stdout
    got = dict(line.split(" ", 1) for line in out.splitlines())
    assert got["sitecustomize"].endswith("/remote/gpu/sitecustomize_guard/sitecustomize.py")
    assert got["log"] == f"/workspace/.dfo/runs/{h['run']}/autotune_guard.jsonl"
    parts = got["pythonpath"].split(":")
    assert parts[0].endswith("/remote/gpu/sitecustomize_guard") and parts[-1] == "/opt/mine"
    assert env.run_file(h["run"], "meta.json")["autotune_guard"] is True
    # the guard's record (appended when triton was imported) is read back into the run's report
    guard = h["autotune_guard"]
    assert guard["records"] == 1 and guard["installed"] is False and guard["last"]["installed"] is False
    r = env.dfo("status", "-H", env.node.name, h["run"])
    assert "NOT installed" in r.stdout, r.stdout
    assert env.status(h["run"])["autotune_guard"]["records"] == 1


# --------------------------------------------------------------------------- unit tests (no testbed)

RACE_TAIL = AUTOTUNER_CRASH.split("'''")[1].splitlines()


@pytest.mark.parametrize("lines,end,name", [
    (RACE_TAIL, {"exit_code": 1}, "triton-autotuner-race"),
    (["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"], {"exit_code": 1},
     "cuda-out-of-memory"),
    (["[rank1]:[E ProcessGroupNCCL.cpp:1182] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9)"],
     {"exit_code": 1}, "nccl-timeout"),
    (["torch.distributed.DistBackendError: NCCL error in: ../ProcessGroupNCCL.cpp:1970, unhandled system error"],
     {"exit_code": 1}, "nccl-error"),
    (["OSError: [Errno 28] No space left on device: '/workspace/checkpoints/step_5000.pt'"], {"exit_code": 1},
     "no-space-left"),
    (["RuntimeError: CUDA error: no kernel image is available for execution on the device"], {"exit_code": 1},
     "no-kernel-image"),
    (["triton.compiler.errors.CompilationError: at 12:8:"], {"exit_code": 1}, "triton-compile-error"),
    (["ModuleNotFoundError: No module named 'fla'"], {"exit_code": 1}, "import-error"),
    (["bash: line 1: /root/venv/bin/python: No such file or directory"], {"exit_code": 127}, "command-not-found"),
    (["step 900 loss 1.2"], {"exit_code": None, "signal": "SIGKILL", "oom_suspected": True,
                             "kernel": ["Out of memory: Killed process 4242 (python)"], "kernel_source": "dmesg"},
     "killed-sigkill"),
    (["step 900 loss 1.2"], {"exit_code": None, "signal": "SIGSEGV"}, "segfault"),
    (["step 900 loss 1.2"], {"state": "lost"}, "lost"),
])
def test_diagnose_finds_each_signature(lines: list[str], end: dict, name: str) -> None:
    from orchestrator.diagnosis import diagnose

    found = diagnose(["step 1 loss 2.0", *lines], end)
    assert found and found[0].name == name
    assert found[0].meaning and found[0].action and found[0].line


def test_diagnose_details() -> None:
    from orchestrator.diagnosis import diagnose, render

    race = diagnose(RACE_TAIL, {"exit_code": 1})[0]
    assert race.line == "TypeError: 'NoneType' object is not a mapping"
    assert "run.autotune_guard: true" in race.action and "sequential warmup" in race.action
    # the same TypeError elsewhere is not the autotuner race
    assert diagnose(["TypeError: 'NoneType' object is not a mapping"], {"exit_code": 1}) == []
    # the kernel's word is quoted for a SIGKILL; a SIGKILL that dfo stop sent is not a failure signature
    kill = diagnose([], {"signal": "SIGKILL", "kernel": ["Killed process 4242 (python)"], "kernel_source": "dmesg"})
    assert kill[0].line == "ended by signal SIGKILL; kernel (dmesg): Killed process 4242 (python)"
    assert diagnose([], {"signal": "SIGKILL", "stopped": True}) == []
    assert diagnose(["all good"], {"exit_code": 0}) == []
    text = "\n".join(render([race]))
    assert text.startswith("diagnosis: Triton autotuner race between threads [triton-autotuner-race]")


def test_render_command_fills_placeholders(tmp_path: Path) -> None:
    from orchestrator.config.models import load_job
    from orchestrator.errors import ConfigError
    from orchestrator.steps.runs import render_command

    job_file = tmp_path / "j.yaml"
    job_file.write_text(
        "name: j\nvenv: /root/my venv\nmodel: {source: 's3://b/m/', dest: /dev/shm/M}\n"
        "data: {source: 's3://b/d/', dest: /workspace/d}\n"
        "run: {command: '{python} t.py --m {model.dest} --d {data.dest}/x --o {run_dir} --id {run_id} "
        "--ws {workspace} --home ${HOME} {a,b}'}\n")
    job = load_job(job_file).job
    assert render_command(job, run_id="j-1", workspace="/ws") == (
        "'/root/my venv/bin/python' t.py --m /dev/shm/M --d /workspace/d/x --o /ws/.dfo/runs/j-1 --id j-1 "
        "--ws /ws --home ${HOME} {a,b}")
    assert "--o {run_dir} --id {run_id}" in render_command(job)  # no run yet: left for later
    job_file.write_text("name: j\nrun: {command: 'python3 t.py --m {model.dest}'}\n")
    with pytest.raises(ConfigError, match="no 'model:' section"):
        render_command(load_job(job_file).job)
    job_file.write_text("name: j\nrun: {command: 'python3 t.py --m {model.path}'}\n")
    with pytest.raises(ConfigError, match=r"unknown placeholder \{model.path\}"):
        render_command(load_job(job_file).job)


def test_render_command_of_the_real_job() -> None:
    from orchestrator.config.models import load_job
    from orchestrator.steps.runs import render_command

    job = load_job(Path(__file__).resolve().parent.parent / "jobs" / "dflash-qwen3.6-27b.yaml").job
    cmd = render_command(job, run_id="r1")
    assert cmd.startswith("/root/venv/bin/python train_dflash_online.py --target-model /dev/shm/Qwen3.6-27B ")
    assert "--data-dir /workspace/tokenized_completions " in cmd and "{" not in cmd


def test_env_split_and_uploads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator.config.models import load_job
    from orchestrator.errors import ConfigError
    from orchestrator.steps.runs import collect_uploads, split_env

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "t.py").write_text("x")
    (tmp_path / "t.py").write_text("y")
    job_file = tmp_path / "j.yaml"
    job_file.write_text("name: j\nrun: {command: c, upload: [a/t.py], env: {A: '1', HF_TOKEN: t, X: s}, "
                        "secret_env: [X, FROM_SHELL]}\n")
    monkeypatch.setenv("FROM_SHELL", "v")
    plain, secret = split_env(load_job(job_file))
    assert plain == {"A": "1"} and secret == {"HF_TOKEN": "t", "X": "s", "FROM_SHELL": "v"}
    monkeypatch.delenv("FROM_SHELL")
    with pytest.raises(ConfigError, match="FROM_SHELL is not set"):
        split_env(load_job(job_file))
    ups = collect_uploads(load_job(job_file))
    assert [u["path"] for u in ups] == ["t.py"]  # lands in run.workdir under its file name
    job_file.write_text("name: j\nrun: {command: c, upload: [a/t.py, t.py]}\n")
    with pytest.raises(ConfigError, match="would both land as t.py"):
        collect_uploads(load_job(job_file))


def test_line_splitter_keeps_lines_whole_across_any_chunking() -> None:
    import random

    from orchestrator.steps.runs import LineSplitter

    text = "".join(f"línea {i} ✓ {'x' * (i % 37)}\n" for i in range(500)) + "partial"
    data = text.encode()
    rng = random.Random(5)
    for _ in range(20):
        got: list[str] = []
        split = LineSplitter(got.append)
        i = 0
        while i < len(data):  # chunk boundaries fall anywhere, also inside a UTF-8 character
            j = min(len(data), i + rng.randint(1, 300))
            split.feed(data[i:j])
            i = j
        assert got == text.splitlines()[:-1]
        split.flush()
        assert got == text.splitlines()


def test_log_offsets(tmp_path: Path) -> None:
    from remote.runs.record import offset_of_last_lines, offset_of_line, tail_lines

    p = tmp_path / "log"
    body = b"".join(b"l%d\n" % i for i in range(100000))
    p.write_bytes(body)
    assert body[offset_of_last_lines(str(p), 3):] == b"l99997\nl99998\nl99999\n"
    assert offset_of_last_lines(str(p), 0) == len(body)
    assert offset_of_last_lines(str(p), 10**6) == 0
    assert body[offset_of_line(str(p), 99999):] == b"l99998\nl99999\n"
    assert offset_of_line(str(p), 1) == 0 and offset_of_line(str(p), 10**6) == len(body)
    p.write_bytes(b"a\nb\nhalf")
    assert offset_of_last_lines(str(p), 1) == 4 and tail_lines(str(p), 2) == ["b", "half"]
