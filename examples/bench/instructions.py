#!/usr/bin/env python3
"""Instructions per event of the bench's trace section, traced vs untraced, counted by
callgrind: the relay process's whole work (every thread: the relay's workers, sqlx,
OpenTelemetry's batch processor), not the server's.

On a shared machine a rate moves by more than the 5% this section looks for; callgrind
counts the instructions a piece of work executes, the same from run to run. The bench
marks each measured enqueue and drain (`cpu::marks`), callgrind dumps its counts before
each mark, and each dump a drain's end triggers holds that drain alone.

    cargo build --release --features otel --example bench
    python3 examples/bench/instructions.py target/release/examples/bench --runs 3 --events 5000

The bench must be built without the broker features (their runs are not marked, and
would take long under callgrind). Its arguments after the binary go to the bench.
"""

import glob
import os
import re
import statistics
import subprocess
import sys
import tempfile

ENQUEUED = 1_000  # events per enqueue run (`trace_enqueue`)


def option(args, name, default):
    """The value of `--name N` in `args`."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return int(args[i + 1])
        if arg.startswith(name + "="):
            return int(arg.split("=", 1)[1])
    return default


def parts(out):
    """(traced?, instructions) of each marked piece of work, in order."""
    dumps = sorted(glob.glob(out + ".*"), key=lambda f: int(f.rsplit(".", 1)[1]))
    found, begun = [], None
    for dump in dumps:
        with open(dump) as f:
            text = f.read()
        trigger = re.search(r"^desc: Trigger: (.*)$", text, re.M).group(1)
        total = int(re.search(r"^totals: (\d+)", text, re.M).group(1))
        if trigger.endswith("marks::ends"):
            if begun is not None:
                found.append((begun, total))
            begun = None
        elif trigger.endswith("marks::traced_begins"):
            begun = True
        elif trigger.endswith("marks::untraced_begins"):
            begun = False
    return found


def row(name, measured, events):
    traced = [ir / events for t, ir in measured if t]
    untraced = [ir / events for t, ir in measured if not t]
    t, u = statistics.median(traced), statistics.median(untraced)
    spread = lambda xs: f"{min(xs):,.0f}–{max(xs):,.0f}"
    return (
        f"| {name} | {t:,.0f} ({spread(traced)}) | {u:,.0f} ({spread(untraced)}) "
        f"| **{t / u:.3f}** | {t - u:,.0f} |"
    )


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    bench, args = sys.argv[1], sys.argv[2:]
    runs = option(args, "--runs", 3)
    drained = max(min(option(args, "--events", 50_000), 100_000), 200)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        command = [
            "valgrind", "--tool=callgrind", "--callgrind-out-file=" + out,
            "--dump-before=*::marks::traced_begins",
            "--dump-before=*::marks::untraced_begins",
            "--dump-before=*::marks::ends",
            bench, "--only", "trace", *args,
        ]
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            sys.exit(f"the bench failed under callgrind:\n{done.stdout}\n{done.stderr[-4000:]}")
        found = parts(out)
    if len(found) != 6 * runs:
        sys.exit(f"expected {6 * runs} marked runs (enqueue, drain at 1 and 4 workers), found {len(found)}")
    each = 2 * runs
    print("Instructions per event (callgrind, the relay process), median (range) of "
          f"{runs} runs each:\n")
    print("| work | traced | untraced | traced / untraced | more per traced event |")
    print("|---|---|---|---|---|")
    print(row(f"enqueue, one per transaction ({ENQUEUED:,})", found[:each], ENQUEUED))
    print(row(f"drain, no-op sink, 1 worker ({drained:,})", found[each:2 * each], drained))
    print(row(f"drain, no-op sink, 4 workers ({drained:,})", found[2 * each:], drained))


if __name__ == "__main__":
    main()
