"""Issue 32 item 7: every documented job and inventory loads as written, and every `dfo ...` line shown parses.

Every fenced block of README.md and docs/*.md is classified (``classify``):

- ``job``: a mapping of job fields with a ``name``: loaded by ``load_job`` from a file holding the block;
- ``job-fragment``: job fields without a ``name`` (a ``run:`` section, an ``outputs:`` one...): its own lines
  as written, plus the sections of a minimal job that it leaves out (and ``run.command`` when its ``run:``
  has none), then ``load_job``;
- ``inventory``: ``defaults`` / ``hosts`` / ``groups`` only: ``load_inventory`` on the block as written;
- ``inventory-fragment``: host entries alone (``gpu-1: {host: ...}``): put under ``hosts:``, then loaded;
- ``not-config``: a block tagged as anything but YAML (console, bash, json, python, mermaid), an untagged
  one that is none of the above (a transcript, a synopsis, a layout), and any block with a ``...`` elision
  (a transcript, whatever its tag).

A block tagged ```yaml that is none of the four config kinds, or a config block that does not load, fails
the test unless ``NOT_LOADABLE`` lists it with the reason; a listed block that has gone, or that loads
now, fails too. jobs/*.yaml, the demo's job and inventory.yaml are loaded as they are.

Every `dfo ...` command line shown is parsed by click against the real CLI, without running anything
(``parse``: make_context on the group, then on the command): a ``$ dfo`` line of a transcript or any
line of a bash block as the shell would split it; a synopsis line (``dfo tail -H HOST [RUN] [-n N|+N]``,
in a block or a job file's comment) with its optional parts taken and its numeric metavars given a
number. Every inline code span ``dfo ...`` in the prose names a real command and only its options.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
import yaml

from orchestrator.cli import COMMANDS, cli, load_command
from orchestrator.config.models import HostEntrySchema, InventorySchema, Job, load_inventory, load_job
from orchestrator.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
JOB_FILES = [*sorted((ROOT / "jobs").glob("*.yaml")), ROOT / "orchestrator" / "demo" / "job" / "demo.yaml"]

JOB_KEYS = frozenset(Job.model_fields)
INVENTORY_KEYS = frozenset(InventorySchema.model_fields)
HOST_KEYS = frozenset(HostEntrySchema.model_fields)

# (file, one line of the block as written, stripped) -> why it is shown though it does not load. Keep it
# small: a documented example should load as written; list one here only when it is deliberately wrong.
NOT_LOADABLE: dict[tuple[str, str], str] = {}

# what a job fragment is merged into: each section the fragment leaves out is appended as written here
MINIMAL_JOB = {
    "name": "name: doc-example\n",
    "model": "model: {source: s3://bucket/models/m/, dest: /dev/shm/m}\n",
    "data": "data: {source: s3://bucket/data/, dest: /workspace/data}\n",
    "outputs": "outputs: {dest: 's3://bucket/runs/{name}/'}\n",
    "run": "run:\n  command: \"true\"\n",
}

_FENCE = re.compile(r"(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[^\s`]*)")
_ELISION = re.compile(r"\.\.\.|…")


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository
    line: int  # 1-based, the block's first line of content
    lang: str
    text: str  # dedented by the fence's own indent

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def first(self) -> str:
        return next((ln.strip() for ln in self.text.splitlines() if ln.strip()), "")


def split_markdown(path: Path, text: str) -> tuple[list[Block], list[tuple[int, str]]]:
    """The fenced blocks of a Markdown file, and its other lines (1-based number, text)."""
    rel = str(path.relative_to(ROOT)) if path.is_absolute() and path.is_relative_to(ROOT) else str(path)
    lines = text.splitlines()
    blocks: list[Block] = []
    prose: list[tuple[int, str]] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        indent, fence = len(m["indent"]), m["fence"]
        close = re.compile(rf"[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*")
        j = i + 1
        while j < len(lines) and not close.fullmatch(lines[j]):
            j += 1
        body = [ln[min(indent, len(ln) - len(ln.lstrip(" "))):] for ln in lines[i + 1:j]]
        blocks.append(Block(rel, i + 2, m["lang"].lower(), "\n".join(body) + "\n"))
        i = j + 1
    return blocks, prose


def doc_blocks() -> list[Block]:
    return [b for p in DOCS for b in split_markdown(p, p.read_text(encoding="utf-8"))[0]]


# --------------------------------------------------------------------------- classification


def _top_keys(text: str) -> tuple[yaml.Node | None, list[str] | None]:
    """The composed document and its top-level keys as written (``on`` stays ``on``); None: not a mapping."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None, None
    if not isinstance(node, yaml.MappingNode):
        return node, None
    return node, [str(k.value) for k, _ in node.value]


def classify(block: Block) -> str:
    """job, job-fragment, inventory, inventory-fragment, not-config, or unknown (tagged YAML, none of those)."""
    content = [ln.split(" #")[0] for ln in block.text.splitlines() if not ln.lstrip().startswith("#")]
    if block.lang not in ("", "text", "yaml", "yml") or any(_ELISION.search(ln) for ln in content):
        return "not-config"  # console, bash, json, python, mermaid...; or a transcript with ... elisions
    node, keys = _top_keys(block.text)
    tagged = block.lang in ("yaml", "yml")
    if not keys:
        return "unknown" if tagged else "not-config"
    have = set(keys)
    if have <= INVENTORY_KEYS:
        return "inventory"
    if have <= JOB_KEYS:
        return "job" if "name" in have else "job-fragment"
    assert isinstance(node, yaml.MappingNode)
    if all(isinstance(v, yaml.MappingNode) and {str(k.value) for k, _ in v.value} <= HOST_KEYS for _, v in node.value):
        return "inventory-fragment" if tagged else "not-config"
    return "unknown" if tagged else "not-config"


def config_text(block: Block, kind: str) -> tuple[str, list[int | None]]:
    """The file a config block is loaded from, and for each of its lines the block's line it is (0-based;
    None: a line added here). A job fragment: its lines as written, then each section of MINIMAL_JOB it
    leaves out; a ``run:`` of its own without ``command`` gets ``command: "true"`` as its first entry. Host
    entries go under ``hosts:``."""
    lines = block.text.splitlines(keepends=True)
    origin: list[int | None] = list(range(len(lines)))
    if kind == "inventory-fragment":
        return "hosts:\n" + textwrap.indent(block.text, "  "), [None, *origin]
    if kind != "job-fragment":
        return block.text, origin
    node, keys = _top_keys(block.text)
    assert isinstance(node, yaml.MappingNode) and keys is not None
    run = next((v for k, v in node.value if k.value == "run"), None)
    if isinstance(run, yaml.MappingNode) and not any(k.value == "command" for k, _ in run.value):
        if run.flow_style:  # run: {a: 1} -> run: {command: "true", a: 1}, on the same line
            at = run.start_mark
            lines[at.line] = lines[at.line][:at.column + 1] + 'command: "true", ' + lines[at.line][at.column + 1:]
        else:  # a line before its first entry, at that entry's column
            first = run.value[0][0].start_mark
            lines.insert(first.line, " " * first.column + 'command: "true"\n')
            origin.insert(first.line, None)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    for key, section in MINIMAL_JOB.items():
        if key not in keys:
            lines.append(section)
            origin.extend([None] * section.count("\n"))
    return "".join(lines), origin


def load_block(block: Block, kind: str, tmp: Path) -> object:
    """Load a config block the way dfo loads its files; raises ConfigError when it does not load."""
    text, _ = config_text(block, kind)
    path = tmp / ("inventory.yaml" if kind.startswith("inventory") else "doc-example.yaml")
    path.write_text(text, encoding="utf-8")
    return load_inventory(path) if kind.startswith("inventory") else load_job(path)


def _doc_lines(message: str, folder: Path, block: Block, origin: list[int | None]) -> str:
    """``FOLDER/FILE:N:`` in a loader's message as the document's own ``path:line:``."""
    def at(m: re.Match[str]) -> str:
        n = int(m.group(1))
        line = origin[n - 1] if 0 < n <= len(origin) else None
        return f"{block.path}:{block.line + line}:" if line is not None else f"(a line the test adds: {n}):"

    return re.sub(rf"{re.escape(str(folder))}/[\w.-]+:(\d+):", at, message)


def check_blocks(blocks: list[Block], tmp: Path, not_loadable: dict[tuple[str, str], str]) -> list[str]:
    """What is wrong: each config block that does not load and is not listed (its error at the line of the
    document), and each stale listing."""
    problems: list[str] = []
    seen: set[tuple[str, str]] = set()
    for i, b in enumerate(blocks):
        kind = classify(b)
        if kind == "not-config":
            continue
        lines = {ln.strip() for ln in b.text.splitlines()}
        key = next((k for k in not_loadable if k[0] == b.path and k[1] in lines), (b.path, b.first))
        d = tmp / str(i)
        d.mkdir()
        try:
            if kind == "unknown":
                raise ConfigError(f"tagged yaml, but neither a job, a job fragment, an inventory nor host entries "
                                  f"(top-level keys: {', '.join(_top_keys(b.text)[1] or ['none'])})")
            load_block(b, kind, d)
        except ConfigError as exc:
            if key in not_loadable:
                seen.add(key)
                continue
            msg = _doc_lines(exc.message, d, b, config_text(b, kind)[1] if kind != "unknown" else [])
            problems.append(f"{b.where}: {kind} does not load: {msg}"
                            f"{f' ({exc.hint})' if exc.hint else ''}; fix it, or list it in NOT_LOADABLE with why")
        else:
            if key in not_loadable:
                seen.add(key)
                problems.append(f"{b.where}: listed in NOT_LOADABLE ({not_loadable[key]}) but loads: drop it there")
    for key in set(not_loadable) - seen:
        problems.append(f"NOT_LOADABLE lists {key} but no such config block is left")
    return problems


# --------------------------------------------------------------------------- dfo command lines


def parse(argv: list[str]) -> None:
    """Parse ``dfo ARGV`` with click against the real CLI, running nothing; raises click.UsageError."""
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            gctx = cli.make_context("dfo", list(argv))
            rest = [*getattr(gctx, "_protected_args", []), *gctx.args]
            if not rest:
                raise click.UsageError("no command", ctx=gctx)
            name, cmd, args = cli.resolve_command(gctx, rest)
            assert name is not None and cmd is not None
            cmd.make_context(name, args, parent=gctx)
        except click.exceptions.Exit as exc:  # --help, --version: parsed, and they end there
            if exc.exit_code != 0:
                raise


def _options(cmd: click.Command) -> dict[str, click.Parameter | None]:
    """A command's option names (with -h/--help, which dfo's context adds to every command)."""
    out: dict[str, click.Parameter | None] = {"-h": None, "--help": None}
    for p in cmd.params:
        if isinstance(p, click.Option):
            for o in [*p.opts, *p.secondary_opts]:
                out[o] = p
    return out


def _split_commands(shell_line: str) -> list[list[str]]:
    """A shell line's simple commands (split at ; && || |), without comments and redirections."""
    lex = shlex.shlex(shell_line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    lex.commenters = "#"
    commands: list[list[str]] = [[]]
    skip = False
    for tok in lex:
        if skip:
            skip = False
        elif tok in (";", "&&", "||", "|", "&"):
            commands.append([])
        elif tok in (">", ">>", "<", "2>", ">&", "2>&"):
            skip = True
        else:
            commands[-1].append(tok)
    return [c for c in commands if c]


def _is_dfo(word: str) -> bool:
    return word == "dfo" or word.endswith("/dfo")


def _synopsis_argv(words: list[str]) -> list[str]:
    """A synopsis (``-H HOST [RUN] [-n N|+N] [--delete/--no-delete] [PATH...]``) as one concrete line: each
    optional part taken, the first of alternatives, a numeric option's metavar given a number."""
    argv: list[str] = []
    for w in words:
        w = w.replace("[", "").replace("]", "")
        if w.endswith("..."):
            w = w[:-3]
        if w.startswith("-") and "/" in w:
            w = w.split("/")[0]
        if "|" in w:
            w = w.split("|")[0]
        if w:
            argv.append(w)
    group = _options(cli)
    cmd = None
    out: list[str] = []
    for w in argv:
        if cmd is None and w in COMMANDS:
            cmd = load_command(w)
        prev = out[-1] if out else ""
        opts = _options(cmd) if cmd is not None else group
        p = opts.get(prev)
        if p is not None and isinstance(p, click.Option) and not p.is_flag and re.fullmatch(r"[A-Z][A-Z0-9_]*", w):
            if isinstance(p.type, click.types.IntParamType | click.types.FloatParamType):
                w = "1"
            elif isinstance(p.type, click.Choice):
                w = str(p.type.choices[0])
        out.append(w)
    return out


def command_lines(text: str, lang: str) -> Iterator[tuple[int, list[str]]]:
    """(line index, dfo's argv) for each dfo command line of a block (or of a job file's comments)."""
    logical: list[tuple[int, str]] = []
    for n, raw in enumerate(text.splitlines()):  # a line ending in \\ goes on on the next one
        if logical and logical[-1][1].endswith("\\"):
            logical[-1] = (logical[-1][0], logical[-1][1][:-1] + " " + raw.strip())
        else:
            logical.append((n, raw.strip()))
    for n, line in logical:
        if lang == "yaml":  # a job file: only its comments show commands
            if "#" not in line:
                continue
            line = line.split("#", 1)[1].strip()
        if line.startswith("$ ") or lang in ("bash", "sh", "shell"):
            for words in _split_commands(line.removeprefix("$ ")):
                if _is_dfo(words[0]):
                    yield n, words[1:]
            continue
        words = line.split()
        if len(words) < 2 or not _is_dfo(words[0]) or not (words[1] in COMMANDS or words[1].startswith("-")):
            continue  # prose, or dfo's own output ("dfo top  04:56:54")
        # a synopsis or a line shown as dfo prints it: the command ends where two spaces start a description
        # (after the padded command name: "dfo verify-env  -H HOST [-j JOB]   what the node has")
        pieces = re.split(r"\s{2,}", line)
        shown = pieces[0]
        if len(shown.split()) == 2 and len(pieces) > 1 and pieces[1][:1] in "-[":
            shown += " " + pieces[1]
        if len(shown.split()) == 2:
            continue  # "dfo top  04:56:54": a header dfo printed, or a command named in a table
        yield n, _synopsis_argv(shown.split()[1:])


def inline_spans(lines: list[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    for n, line in lines:
        for m in re.finditer(r"`dfo ([^`]+)`", line):
            yield n, m.group(1)


def check_inline(span: str) -> str | None:
    """What is wrong with an inline ``dfo ...`` span: an unknown command, or an option it does not have."""
    words = _split_commands(span)[0] if _split_commands(span) else []
    cmd: click.Command = cli
    name = None
    for w in words:
        if w == "--":
            break
        if name is None and not w.startswith("-"):
            if re.fullmatch(r"[A-Z]+|\.\.\.|…", w):  # `dfo COMMAND --help`, `dfo ...`: any command
                return None
            if w not in COMMANDS:
                return f"no command {w!r}"
            name, cmd = w, load_command(w)
            continue
        if w.startswith("-"):
            for alt in re.split(r"[/|]", w.strip("[]").split("=")[0]):
                if alt.startswith("-") and alt not in _options(cmd):
                    return f"{'dfo ' + name if name else 'dfo'} has no option {alt}"
    return None


# --------------------------------------------------------------------------- the tests


def test_every_documented_job_and_inventory_loads_as_written(tmp_path: Path) -> None:
    blocks = doc_blocks()
    kinds = [classify(b) for b in blocks]
    # the classifier sees the examples that exist today (a change that hides them all would pass vacuously)
    assert kinds.count("job") >= 3 and kinds.count("job-fragment") >= 6 and kinds.count("inventory") >= 1, kinds
    problems = check_blocks(blocks, tmp_path, NOT_LOADABLE)
    assert not problems, "\n".join(problems)


def test_the_recovery_contract_loads_with_a_bare_on_key(tmp_path: Path) -> None:
    """docs/recovery.md's restarts block, bare ``on: [lost, signal]``: what it says is what the job gets."""
    block = next(b for b in doc_blocks() if b.path == "docs/recovery.md" and "restarts:" in b.text)
    job = load_block(block, classify(block), tmp_path)
    run = job.job.run  # type: ignore[attr-defined]
    assert run.restarts.on == ["lost", "signal"] and run.restarts.max == 3 and run.spares == ["gpu-5", "gpu-6"]


@pytest.mark.parametrize("path", [*JOB_FILES, ROOT / "inventory.yaml"], ids=lambda p: str(p.relative_to(ROOT)))
def test_job_files_and_the_inventory_load(path: Path) -> None:
    if path.name == "inventory.yaml":
        inv, _ = load_inventory(path)
        assert inv.hosts
    else:
        assert load_job(path).job.name


def test_a_new_example_that_does_not_load_fails_unless_listed(tmp_path: Path) -> None:
    """The guard itself: a broken block is caught, each kind is recognised, a stale listing is caught."""
    md = textwrap.dedent("""\
        ```yaml
        name: ok
        run: {command: "true"}
        ```
        ```yaml
        run:
          restarts: {max: 1, on: [lost]}
        ```
        ```yaml
        gpu-9: {host: 10.0.0.9, port: 22}
        ```
        ```yaml
        run:
          wait: -1
        ```
        ```yaml
        frobnicate: 1
        ```
        ```
        $ dfo status -H node-1
        name: not config, a transcript line
        ```
        ```yaml
        name: elided
        run: ...
        ```
        ```yaml
        name: commented  # a comment's ... is no elision
        run: {command: "true", wait: -2}   # waits...
        ```
        """)
    blocks, _ = split_markdown(Path("docs/x.md"), md)
    assert [classify(b) for b in blocks] == ["job", "job-fragment", "inventory-fragment", "job-fragment", "unknown",
                                            "not-config", "not-config", "job"]
    (tmp_path / "a").mkdir()
    problems = check_blocks(blocks, tmp_path / "a", {})
    assert len(problems) == 3, problems
    # the error names the line of the document, whatever the test added to the fragment
    assert problems[0].startswith("docs/x.md:13: job-fragment does not load: docs/x.md:14: run.wait: "
                                  "input should be greater than or equal to 0"), problems
    assert problems[1].startswith("docs/x.md:17: unknown does not load: tagged yaml, but neither"), problems
    assert problems[2].startswith("docs/x.md:28: job does not load: docs/x.md:29: run.wait:"), problems
    assert load_block(blocks[1], "job-fragment", tmp_path).job.run.restarts.on == ["lost"]  # type: ignore[attr-defined]
    listed = {("docs/x.md", "wait: -1"): "shown failing on purpose", ("docs/x.md", "frobnicate: 1"): "not dfo's",
              ("docs/x.md", "gone: 1"): "stale", ("docs/x.md", "restarts: {max: 1, on: [lost]}"): "loads now",
              ("docs/x.md", "name: commented  # a comment's ... is no elision"): "a negative wait, on purpose"}
    (tmp_path / "b").mkdir()
    assert check_blocks(blocks, tmp_path / "b", listed) == [
        "docs/x.md:6: listed in NOT_LOADABLE (loads now) but loads: drop it there",
        "NOT_LOADABLE lists ('docs/x.md', 'gone: 1') but no such config block is left"]


def test_every_dfo_command_line_shown_parses() -> None:
    seen = 0
    bad: list[str] = []
    for b in doc_blocks():
        if b.lang in ("mermaid", "json", "python"):
            continue
        for n, argv in command_lines(b.text, b.lang):
            seen += 1
            try:
                parse(argv)
            except click.UsageError as exc:
                bad.append(f"{b.path}:{b.line + n}: dfo {shlex.join(argv)}: {exc.format_message()}")
    for p in JOB_FILES:
        for n, argv in command_lines(p.read_text(encoding="utf-8"), "yaml"):
            seen += 1
            try:
                parse(argv)
            except click.UsageError as exc:
                bad.append(f"{p.relative_to(ROOT)}:{n + 1}: dfo {shlex.join(argv)}: {exc.format_message()}")
    assert seen >= 80, seen  # README's table, the transcripts, the synopses, the job files' comments
    assert not bad, "\n".join(bad)


def test_every_inline_dfo_span_names_real_commands_and_options() -> None:
    seen = 0
    bad: list[str] = []
    for p in [*DOCS, *JOB_FILES]:
        text = p.read_text(encoding="utf-8")
        prose = split_markdown(p, text)[1] if p.suffix == ".md" else list(enumerate(text.splitlines(), 1))
        for n, span in inline_spans(prose):
            seen += 1
            if (why := check_inline(span)) is not None:
                bad.append(f"{p.relative_to(ROOT)}:{n}: `dfo {span}`: {why}")
    assert seen >= 150, seen
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("argv, ok", [
    (["-i", "inventory.yaml", "tail", "-H", "node-1", "-n", "+1", "RUN"], True),
    (["exec", "-H", "a,b", "--timeout", "5", "--", "bash", "-c", "echo hi"], True),
    (["--help"], True),
    (["tail", "-H", "node-1", "--lines-of", "3"], False),  # no such option
    (["launch", "-H", "node-1", "-j", "job.yaml", "--wait", "soon"], False),  # not a number
    (["status"], False),  # -H is required
    (["stats", "-H", "node-1"], False),  # no such command
])
def test_parse_is_click_against_the_real_cli(argv: list[str], ok: bool) -> None:
    if ok:
        parse(argv)
    else:
        with pytest.raises(click.UsageError):
            parse(argv)


def test_synopsis_and_shell_lines_become_argv() -> None:
    text = ("dfo tail        -H HOST [RUN] [--no-follow] [-n N|+N]  follow the log\n"
            "dfo sync-data   -H HOST -j JOB [--delete/--no-delete] [--json]   data.source  -> data.dest\n"
            "$ dfo stage-model -H node-1 -j demo.yaml; echo \"exit $?\"   # a comment\n"
            "dfo top  04:56:54\n"
            "dfo: node-1: run x succeeded\n")
    assert list(command_lines(text, "")) == [
        (0, ["tail", "-H", "HOST", "RUN", "--no-follow", "-n", "N"]),
        (1, ["sync-data", "-H", "HOST", "-j", "JOB", "--delete", "--json"]),
        (2, ["stage-model", "-H", "node-1", "-j", "demo.yaml"])]
    assert list(command_lines("dfo launch -H HOST -j JOB [--wait SECONDS]\n", "")) == [
        (0, ["launch", "-H", "HOST", "-j", "JOB", "--wait", "1"])]
    assert list(command_lines("bash .ci/setup --demo && .venv/bin/dfo demo\n", "bash")) == [(0, ["demo"])]
    assert check_inline("status | head -1") is None and check_inline("...") is None
    assert check_inline("tail --folow") == "dfo tail has no option --folow"
    assert check_inline("stat -H x") == "no command 'stat'"
