#!/usr/bin/env python3
"""torch's TCPStore under the rendezvous of comm-bench-store-scale (benchmarks/store_scale.cpp).

N simulated ranks, each on its own TCPStore client connection, publish a record, wait for all
(one wait request on every key) and read all (torch 1.13, Debian's python3-torch, has no
multi_get: one get per key). The server (is_master) runs in a child process; the ranks run from
--threads Python threads (the blocking calls release the GIL). A run that passes --bound seconds
is reported as such (timed_out) rather than waited for. One JSON line per N:

    /usr/bin/python3 benchmarks/peers/torch_store_scale.py --ranks 256,1024 --threads 8
"""

import argparse
import datetime
import json
import multiprocessing as mp
import os
import resource
import threading
import time

import torch.distributed as dist


def serve(port_q, stop_ev):
    store = dist.TCPStore("127.0.0.1", 0, -1, True, datetime.timedelta(seconds=300), wait_for_workers=False)
    port_q.put(store.port)
    stop_ev.wait()


def cpu_of(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(n, threads, bound):
    port_q, stop_ev = mp.Queue(), mp.Event()
    server = mp.Process(target=serve, args=(port_q, stop_ev))
    server.start()
    port = port_q.get()
    run_id = f"torch{n}"
    keys = [f"{run_id}/member/{q}" for q in range(n)]
    deadline = time.monotonic() + bound
    timed_out = threading.Event()
    cpu0 = cpu_of(server.pid)
    t0 = time.perf_counter()
    clients = [None] * n

    def connect_and_set(ranks):
        for r in ranks:
            s = dist.TCPStore("127.0.0.1", port, -1, False, datetime.timedelta(seconds=bound))
            clients[r] = s
            s.set(keys[r], f"{n}|{100000 + r}|node-{r // 8}.cluster.example")

    def wait_and_read(ranks):
        for r in ranks:
            s = clients[r]
            others = [k for q, k in enumerate(keys) if q != r]
            s.wait(others)
            for k in others:
                s.get(k)
                if time.monotonic() > deadline:
                    timed_out.set()
                    return

    shares = [list(range(t, n, threads)) for t in range(threads)]
    for phase in (connect_and_set, wait_and_read):
        ts = [threading.Thread(target=phase, args=(sh,)) for sh in shares]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    elapsed = time.perf_counter() - t0
    cpu = cpu_of(server.pid) - cpu0
    del clients
    stop_ev.set()
    server.join()
    print(json.dumps({"schema": "store-scale/1", "store": "torch.TCPStore " + __import__("torch").__version__,
                      "ranks": n, "pattern": "wait-all+per-key-get", "threads": threads,
                      "rendezvous_s": round(elapsed, 3), "rendezvous_server_cpu_s": round(cpu, 2),
                      "timed_out": timed_out.is_set(), "bound_s": bound}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="256,1024")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--bound", type=float, default=120.0)
    a = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    for n in (int(x) for x in a.ranks.split(",")):
        run(n, a.threads, a.bound)


if __name__ == "__main__":
    main()
