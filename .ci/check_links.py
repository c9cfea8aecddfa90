"""Fail on a dangling relative link, or a repo path that does not exist, in the project's *.md files.

    python3 .ci/check_links.py [ROOT]        # exit 0: all good; 1: each fault as FILE:LINE: ...

Checked in every *.md that git tracks or would track (untracked, not ignored), outside fenced code
blocks (real output there may name files that only existed on the machine that printed it):

- links `[text](target)`, images, reference definitions `[id]: target`, and `href=` / `src=` in
  HTML: a relative target must exist inside the repository (a file or a folder), and a `#anchor`
  must be a heading of the target .md file (GitHub's slugs: lower case, punctuation dropped,
  spaces to hyphens, -1, -2 ... for repeats) or an explicit `<a name|id=...>`;
- a file name ending in .md in the text (`DESIGN.md`, `docs/x.md`): it must be in the repository
  (a bare name anywhere in it, a path relative to the root or to the file);
- inline code that names a repository path (`docs/x.md`, `jobs/demo.yaml`, `../x`, `tests/t.py::test_y`):
  it must exist (relative to the repository root or to the file), stay inside the repository, and
  a `::test_name` must be defined in that file. Spans with wildcards or placeholders are skipped.

URLs with a scheme (https:, mailto:) are not fetched. Standard library only.
"""

from __future__ import annotations

import re
import subprocess
import sys
import unicodedata
from pathlib import Path
from urllib.parse import unquote

FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
ATX = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
SETEXT = re.compile(r"^\s{0,3}(=+|-+)\s*$")
LINK = re.compile(r"!?\[(?P<text>(?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?(?P<target>[^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
REFDEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(?P<target>\S+?)>?(?:\s+.*)?$")
HTML_ATTR = re.compile(r"""\b(?:href|src)\s*=\s*["']([^"']+)["']""", re.I)
ANCHOR_ATTR = re.compile(r"""<a\s[^>]*\b(?:name|id)\s*=\s*["']([^"']+)["']""", re.I)
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:|^//")
TOP_DIRS = ("docs", "jobs", "bench", "tests", "orchestrator", "remote", ".ci", "scripts")
REPO_PATH = re.compile(r"^(?:\.\.?/)+\S+$|^(?:" + "|".join(re.escape(d) for d in TOP_DIRS) + r")/\S*$")
MD_WORD = re.compile(r"(?<![\w/.@:-])((?:\.\.?/)*[\w.-]+(?:/[\w.-]+)*\.md)\b")
PLACEHOLDER = re.compile(r"[*?<>{}\[\]$|]|\bNAME\b|\bRUN\b|\bJOB\b|\.\.\.")


def md_files(root: Path) -> list[Path]:
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard",
                              "--", "*.md"], capture_output=True, check=True, timeout=60).stdout
        names = sorted({n for n in out.decode().split("\0") if n})
        return [root / n for n in names if (root / n).is_file()]
    except (OSError, subprocess.CalledProcessError):
        return sorted(p for p in root.rglob("*.md") if ".git" not in p.parts)


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    out: list[tuple[int, str]] = []
    fence: str | None = None
    for n, line in enumerate(text.splitlines(), start=1):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * len(m.group(1))
        elif fence is not None and m and m.group(1).startswith(fence):
            fence = None
        elif fence is None:
            out.append((n, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # links and images: their text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = text.strip().lower()
    kept = "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    prev = ""
    for _, line in prose_lines(path.read_text(errors="replace")):
        text = None
        m = ATX.match(line)
        if m:
            text = m.group(2)
        elif SETEXT.match(line) and prev.strip() and not prev.lstrip().startswith(("|", "-", "*", ">")):
            text = prev.strip()
        if text is not None:
            base = slug(text)
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
        found.update(a.lower() for a in ANCHOR_ATTR.findall(line))
        prev = line
    return found


class Checker:
    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.faults: list[str] = []
        self.links = self.paths = 0
        self._anchors: dict[Path, set[str]] = {}
        self._md_names: set[str] | None = None

    def inside(self, p: Path) -> bool:
        return p == self.root or self.root in p.parents

    def fault(self, md: Path, n: int, msg: str) -> None:
        self.faults.append(f"{md.relative_to(self.root)}:{n}: {msg}")

    def check_link(self, md: Path, n: int, target: str) -> None:
        if not target or SCHEME.match(target):
            return
        self.links += 1
        raw_path, _, frag = target.partition("#")
        path = unquote(raw_path.split("?", 1)[0])
        if path:
            dest = (self.root / path.lstrip("/")) if path.startswith("/") else (md.parent / path)
            dest = Path(*dest.parts).resolve()
            if not self.inside(dest):
                self.fault(md, n, f"link ({target}) leads outside the repository")
                return
            if not dest.exists():
                self.fault(md, n, f"link ({target}): no such file or folder {dest.relative_to(self.root)}")
                return
        else:
            dest = md
        if frag and dest.suffix.lower() == ".md" and dest.is_file():
            if dest not in self._anchors:
                self._anchors[dest] = anchors(dest)
            if unquote(frag).lower() not in self._anchors[dest]:
                self.fault(md, n, f"link ({target}): no heading #{frag} in {dest.relative_to(self.root)}")

    def check_code_path(self, md: Path, n: int, span: str) -> None:
        span = span.strip()
        if not REPO_PATH.match(span) or PLACEHOLDER.search(span):
            return
        self.paths += 1
        path, _, test = span.partition("::")
        path = re.sub(r":\d+(-\d+)?$", "", path)
        cands = [Path(*(md.parent / path).parts).resolve(), Path(*(self.root / path).parts).resolve()]
        hits = [c for c in cands if c.exists()]
        if not hits:
            self.fault(md, n, f"`{span}`: no such file or folder in the repository")
            return
        if not any(self.inside(c) for c in hits):
            self.fault(md, n, f"`{span}`: outside the repository")
            return
        name = test.split("::")[-1].split("[")[0]
        if name and hits[0].is_file():
            if not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(name)}\b",
                             hits[0].read_text(errors="replace"), re.M):
                self.fault(md, n, f"`{span}`: {path} defines no {name}")

    def check_md_word(self, md: Path, n: int, word: str) -> None:
        if "/" not in word:
            if self._md_names is None:
                self._md_names = {p.name for p in md_files(self.root)}
            if word not in self._md_names:
                self.fault(md, n, f"{word}: no such file in the repository")
            return
        cands = [Path(*(md.parent / word).parts).resolve(), Path(*(self.root / word).parts).resolve()]
        if not any(c.is_file() and self.inside(c) for c in cands):
            self.fault(md, n, f"{word}: no such file in the repository")

    def check_file(self, md: Path) -> None:
        for n, line in prose_lines(md.read_text(errors="replace")):
            for m in CODE_SPAN.finditer(line):
                self.check_code_path(md, n, m.group(2))
            bare = CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)
            for m in LINK.finditer(bare):
                self.check_link(md, n, m.group("target"))
            m = REFDEF.match(bare)
            if m:
                self.check_link(md, n, m.group("target"))
            for target in HTML_ATTR.findall(bare):
                self.check_link(md, n, target)
            text = LINK.sub(lambda m: " " + m.group("text") + " ", bare)
            text = re.sub(r"<[^>]*>|\b[A-Za-z][A-Za-z0-9+.-]*://\S+", " ", text)  # HTML tags and URLs
            if not REFDEF.match(bare):
                for m in MD_WORD.finditer(text):
                    self.check_md_word(md, n, m.group(1))


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else Path(__file__).resolve().parent.parent)
    checker = Checker(root)
    files = md_files(checker.root)
    for md in files:
        checker.check_file(md)
    for f in checker.faults:
        print(f)
    verdict = f"{len(checker.faults)} dangling" if checker.faults else "ok"
    print(f"check_links: {len(files)} files, {checker.links} relative links, {checker.paths} repo paths in code: "
          f"{verdict}", file=sys.stderr)
    return 1 if checker.faults else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
