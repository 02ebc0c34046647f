#!/usr/bin/env python3
"""Checks comm's Chrome trace files (COMM_TRACE, include/comm/detail/diagnostics/comms_log.hpp).

  check_trace.py file TRACE --rank R [--min-events N] [--track NAME]...
      TRACE is one rank's file: valid JSON, every event of pid R, at least N complete ("X") events,
      a thread_name for every track named.
  check_trace.py run --comm-run COMM_RUN --ranks N [--min-events K] [--track NAME]... -- PROGRAM [ARGS...]
      Runs `COMM_RUN -n N PROGRAM ARGS` with COMM_TRACE=<tmp>/trace.json, then checks the file
      comm-run merged (<tmp>/trace.json): valid JSON, pids 0..N-1, at least K complete events per
      rank, each rank's track names, and that each event's fields are what chrome://tracing and
      Perfetto read (name, ph, pid, tid, ts, dur >= 0).
  check_trace.py partial --comm-run COMM_RUN
      comm-run's merge when ranks fail to leave a trace: of 4 ranks, rank 0 writes a valid trace,
      rank 1 a truncated one, rank 2 none (an hour-old file of an earlier job is there), rank 3 a
      valid one; the merged file holds ranks 0 and 3 and comm-run names ranks 1 and 2.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile


def fail(msg):
    print("check_trace: FAILED: " + msg)
    sys.exit(1)


def check_events(doc, ranks, min_events, tracks):
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        fail("no traceEvents list")
    per_rank = {r: 0 for r in ranks}
    names = {r: set() for r in ranks}
    for e in doc["traceEvents"]:
        for k in ("name", "ph", "pid"):
            if k not in e:
                fail("event without '%s': %r" % (k, e))
        if e["pid"] not in per_rank:
            fail("event of unexpected pid %r: %r" % (e["pid"], e))
        if e["ph"] == "M":
            if e["name"] == "thread_name":
                names[e["pid"]].add(e["args"]["name"])
            continue
        if e["ph"] != "X":
            fail("event of phase %r: %r" % (e["ph"], e))
        for k in ("tid", "ts", "dur", "args"):
            if k not in e:
                fail("complete event without '%s': %r" % (k, e))
        if not isinstance(e["ts"], (int, float)) or not isinstance(e["dur"], (int, float)) or e["dur"] < 0:
            fail("bad ts/dur: %r" % e)
        for k in ("seq", "bytes", "count", "algbw_GBps", "busbw_GBps"):
            if k not in e["args"]:
                fail("event args without '%s': %r" % (k, e))
        per_rank[e["pid"]] += 1
    for r in ranks:
        if per_rank[r] < min_events:
            fail("rank %d has %d complete events, expected at least %d" % (r, per_rank[r], min_events))
        for t in tracks:
            if t not in names[r]:
                fail("rank %d has no track %r (tracks: %s)" % (r, t, sorted(names[r])))
    print("check_trace: ok: %s" % ", ".join("rank %d: %d events, tracks %s" % (r, per_rank[r], sorted(names[r]))
                                            for r in ranks))


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        fail("%s is not valid JSON: %s" % (path, e))


def partial(comm_run):
    event = ('{"name":"all_reduce","cat":"comm","ph":"X","pid":%d,"tid":0,"ts":1.5,"dur":2.25,'
             '"args":{"seq":0,"dtype":"float","count":1,"bytes":4,"peer":-1,"algbw_GBps":0,"busbw_GBps":0}}')
    valid = '{"traceEvents":[\n%s\n],"otherData":{"note":"a ] and a \\" in a string"}}\n'
    with tempfile.TemporaryDirectory(prefix="comm-trace-") as d:
        merged = os.path.join(d, "trace.json")
        # What each rank leaves (copied by the rank itself, during the job): 0 and 3 a valid trace,
        # 1 a truncated one, 2 nothing (but an hour-old trace of an earlier job is there).
        for rank, text in ((0, valid % (event % 0)), (1, '{"traceEvents":[\n%s,\n' % (event % 1)),
                           (3, valid % (event % 3))):
            with open(os.path.join(d, "tpl.%d" % rank), "w") as f:
                f.write(text)
        stale = merged + ".2"
        with open(stale, "w") as f:
            f.write(valid % (event % 2))
        old = os.path.getmtime(stale) - 3600
        os.utime(stale, (old, old))
        script = 'if [ -f "%s/tpl.$RANK" ]; then cp "%s/tpl.$RANK" "$COMM_TRACE.$RANK"; fi' % (d, d)
        r = subprocess.run([comm_run, "-n", "4", "sh", "-c", script], env=dict(os.environ, COMM_TRACE=merged),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        sys.stdout.write(r.stdout)
        if r.returncode != 0:
            fail("the job exited with %d" % r.returncode)
        if "trace of 2 rank(s) merged into %s (no trace from rank(s) 1, 2)" % merged not in r.stdout:
            fail("comm-run did not report the merge of ranks 0 and 3 without ranks 1 and 2")
        check_events(load(merged), [0, 3], 1, [])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["file", "run", "partial"])
    ap.add_argument("path", nargs="?")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--min-events", type=int, default=1)
    ap.add_argument("--track", action="append", default=[])
    ap.add_argument("--comm-run")
    argv = sys.argv[1:]
    cmd = argv[argv.index("--") + 1:] if "--" in argv else []
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if a.mode == "file":
        check_events(load(a.path), [a.rank], a.min_events, a.track)
        return
    if a.mode == "partial":
        partial(a.comm_run)
        return
    if not a.comm_run or not cmd:
        fail("run needs --comm-run and a program")
    with tempfile.TemporaryDirectory(prefix="comm-trace-") as d:
        merged = os.path.join(d, "trace.json")
        env = dict(os.environ, COMM_TRACE=merged)
        r = subprocess.run([a.comm_run, "-n", str(a.ranks)] + cmd, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
        sys.stdout.write(r.stdout)
        if r.returncode != 0:
            fail("the job exited with %d" % r.returncode)
        for rank in range(a.ranks):
            per_rank = merged + "." + str(rank)
            if not os.path.exists(per_rank):
                fail("no per-rank trace %s" % per_rank)
            check_events(load(per_rank), [rank], a.min_events, a.track)
        if not os.path.exists(merged):
            fail("comm-run did not merge the ranks' traces into %s (files: %s)" % (merged, sorted(os.listdir(d))))
        check_events(load(merged), list(range(a.ranks)), a.min_events, a.track)


if __name__ == "__main__":
    main()
