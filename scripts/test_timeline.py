#!/usr/bin/env python3
"""How a test run used its workers, from the file DFO_TEST_TIMELINE=FILE made (tests/conftest.py).

    DFO_TEST_TIMELINE=/tmp/tl.jsonl .venv/bin/python -m pytest -q
    python3 scripts/test_timeline.py /tmp/tl.jsonl [--last 10] [--durations-out tests/durations.json]

Per worker: tests, busy seconds, when its first test started and its last ended (from the run's first
start); then the run's span, the workers' idle time inside it, and the tests that ended last."""
from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("timeline")
    ap.add_argument("--last", type=int, default=10, help="how many of the tests that ended last to list")
    ap.add_argument("--durations-out", metavar="FILE", help="also write {test id: seconds} (tests/durations.json)")
    a = ap.parse_args()
    try:
        rows = [json.loads(ln) for ln in open(a.timeline) if ln.strip()]
    except (OSError, ValueError) as e:
        print(f"test_timeline: {a.timeline}: {e}", file=sys.stderr)
        return 2
    if not rows:
        print(f"test_timeline: {a.timeline}: no tests", file=sys.stderr)
        return 2
    t0, t1 = min(r["start"] for r in rows), max(r["end"] for r in rows)
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["w"], []).append(r)
    idle = 0.0
    print(f"{'worker':8} {'tests':>5} {'busy s':>8} {'first':>7} {'last end':>9}")
    for w in sorted(by):
        rs = by[w]
        busy = sum(r["end"] - r["start"] for r in rs)
        idle += (t1 - t0) - busy
        print(f"{w:8} {len(rs):5d} {busy:8.1f} {min(r['start'] for r in rs) - t0:7.1f} "
              f"{max(r['end'] for r in rs) - t0:9.1f}")
    print(f"span {t1 - t0:.1f} s over {len(by)} workers; idle inside the span {idle:.1f} worker-s")
    print(f"the {a.last} tests that ended last (start, seconds, id):")
    for r in sorted(rows, key=lambda r: r["end"])[-a.last:]:
        print(f"  {r['start'] - t0:7.1f} {r['end'] - r['start']:7.1f}  {r['w']}  {r['id']}")
    if a.durations_out:
        out = {r["id"]: round(r["end"] - r["start"], 1) for r in sorted(rows, key=lambda r: r["id"])}
        tmp = a.durations_out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=0)
            f.write("\n")
        os.replace(tmp, a.durations_out)
        print(f"wrote {len(out)} durations to {a.durations_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
