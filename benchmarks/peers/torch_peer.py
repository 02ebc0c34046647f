#!/usr/bin/env python3
"""torch.distributed (gloo) peer of benchmarks/compare.

Same command line subset, methodology and JSON lines (schema comm-bench/1) as comm-bench:
every rank times each call back to back with perf_counter; the time of an iteration is the max
over ranks; the reported time is the median over iterations. Launched like comm-bench, e.g.

    comm-run -n 2 --no-agent-store /usr/bin/python3 benchmarks/peers/torch_peer.py --op all_reduce --json

(env:// rendezvous: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the launcher; torch's rank 0
hosts its own store on MASTER_PORT, so comm-run must not host comm's there: --no-agent-store).

Every op of comm-bench (--op all), on Debian's python3-torch 1.13, whose gloo process group lacks
some of them; where it does, the row's "algo" names what is timed instead:
  reduce_scatter  no reduce_scatter in gloo: all_reduce of the whole buffer, then a copy of this
                  rank's block ("all_reduce+copy"), the usual workaround;
  all_to_all      no all_to_all of tensor lists in gloo ("ProcessGroup gloo does not support
                  alltoall"): all_to_all_single, gloo's alltoall ("all_to_all_single");
  all_to_all_v    all_to_all_single with input/output split sizes, gloo's alltoallv;
  reduce          in place only: out of place (comm-bench's default) copies the input into the
                  output first ("copy+reduce"), as all_reduce out of place does;
  scatter         out of place only (its output is its own tensor): --inplace is refused;
  send_recv       dist.send/dist.recv ping-pong between ranks (0,1), (2,3)..., one way (half the
                  round trip), as comm-bench;
  barrier         dist.barrier, once, at size 0.
With -c 1 every rank verifies its result against comm-bench's inputs (benchmarks/common/data.hpp);
the row's "wrong" is the sum over ranks.
"""

import argparse
import datetime
import json
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

SCHEMA = "comm-bench/1"
OPS = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "gather", "reduce", "scatter", "all_to_all",
       "all_to_all_v", "send_recv", "barrier"]
REDUCTIONS = ("all_reduce", "reduce_scatter", "reduce")
ROOTED = ("broadcast", "gather", "reduce", "scatter")
DTYPES = {
    "float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16,
    "int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64,
}
REDOPS = {
    "sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
    "band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR,
}


def parse_bytes(s):
    s = s.strip()
    for suf in ("iB", "B", "b"):
        if s.endswith(suf):
            s = s[: -len(suf)]
            break
    mult = {"K": 1 << 10, "k": 1 << 10, "M": 1 << 20, "m": 1 << 20, "G": 1 << 30, "g": 1 << 30}
    if s and s[-1] in mult:
        return int(s[:-1]) * mult[s[-1]]
    return int(s)


def size_list(a):
    if a.sizes:
        return [parse_bytes(x) for x in a.sizes.split(",")]
    out, s = [], a.minbytes
    while s <= a.maxbytes and s:
        out.append(s)
        s *= a.stepfactor
    return out


def layout(op, nbytes, elem, n):
    """Same rules as benchmarks/common/bench.hpp: `bytes` is the whole buffer (nccl-tests)."""
    if op == "barrier":
        return {"block": 0, "count": 0, "bytes": 0}
    if op in ("all_reduce", "broadcast", "reduce", "send_recv"):
        block = max(1, nbytes // elem)
        count = block
    else:
        block = max(1, nbytes // (elem * n))
        count = block * n
    return {"block": block, "count": count, "bytes": count * elem}


def bus_factor(op, n):
    if op == "barrier":
        return 0.0
    if op in ("broadcast", "reduce", "send_recv"):
        return 1.0
    if n <= 1:
        return 0.0
    f = (n - 1) / n
    return 2 * f if op == "all_reduce" else f


def a2av_count(frm, to, block):
    """Elements rank `frm` sends to rank `to` in all_to_all_v (bench.hpp's a2av_count)."""
    return block + block // 2 if (frm + to) % 2 else block - block // 2


def input_values(reduction, rank, first, count):
    i = torch.arange(first, first + count, dtype=torch.int64)
    if reduction:
        return ((rank + i) % 3 + 1).to(torch.float64)
    return ((rank * 5 + i) % 97 + 1).to(torch.float64)


def expected_reduction(redop, n, first, count):
    acc = input_values(True, 0, first, count)
    for r in range(1, n):
        v = input_values(True, r, first, count)
        if redop == "sum":
            acc = acc + v
        elif redop == "prod":
            acc = acc * v
        elif redop == "min":
            acc = torch.minimum(acc, v)
        elif redop == "max":
            acc = torch.maximum(acc, v)
        elif redop == "band":
            acc = (acc.long() & v.long()).double()
        elif redop == "bor":
            acc = (acc.long() | v.long()).double()
        elif redop == "bxor":
            acc = (acc.long() ^ v.long()).double()
    return acc


def wrong(got, want):
    return int((got.to(torch.float64) != want).sum().item())


def default_inplace(a, op):
    """comm-bench's rule (cli.hpp in_place): all_reduce in place unless told; never the ops whose buffers
    may not alias."""
    if op in ("all_to_all", "all_to_all_v", "send_recv", "barrier"):
        return False
    return a.placement == "in" if a.placement else op == "all_reduce"


def algo_of(op, inplace):
    """What the row times where torch's call is not the op itself."""
    if op == "reduce_scatter":
        return "all_reduce+copy"
    if op == "all_to_all":
        return "all_to_all_single"
    if op == "all_to_all_v":
        return "all_to_all_single(splits)"
    if op == "reduce" and not inplace:
        return "copy+reduce"
    return ""


class Case:
    """One op at one size: buffers (views into preallocated ones), call, fill, verify."""

    def __init__(self, a, op, l, bufs, rank, n, dtype):
        self.a, self.op, self.l, self.rank, self.n, self.dtype = a, op, l, rank, n, dtype
        b, c = l["block"], l["count"]
        self.root = a.root
        self.redop = REDOPS.get(a.redop) if op in ("all_reduce", "reduce_scatter", "reduce") else None
        inplace = default_inplace(a, op)
        self.inplace = inplace
        self.peer = -1
        if op == "all_reduce" or op == "reduce":
            self.out = bufs["out"][:c]
            self.inp = self.out if inplace else bufs["in"][:c]
        elif op == "reduce_scatter":
            self.inp = bufs["in"][: b * n]
            self.out = self.inp[rank * b:(rank + 1) * b] if inplace else bufs["out"][:b]
            self.mine = self.inp[rank * b:(rank + 1) * b]
        elif op == "all_gather":
            self.out = bufs["out"][: b * n]
            self.inp = self.out[rank * b:(rank + 1) * b] if inplace else bufs["in"][:b]
            self.outs = list(self.out.split(b))
        elif op == "broadcast":
            self.inp = self.out = bufs["out"][:c]
        elif op == "gather":
            self.inp = bufs["in"][:b]
            self.out = bufs["out"][: b * n]
            self.outs = list(self.out.split(b)) if rank == self.root else None
        elif op == "scatter":
            # Only the root's input exists (comm-bench's view: in_n is 0 off the root).
            self.inp = bufs["in"][: b * n] if rank == self.root else bufs["in"][:0]
            self.out = bufs["out"][:b]
            self.ins = list(self.inp.split(b)) if rank == self.root else None
        elif op == "all_to_all":
            self.inp = bufs["in"][:c]
            self.out = bufs["out"][:c]
        elif op == "all_to_all_v":
            self.in_counts = [a2av_count(rank, p, b) for p in range(n)]
            self.out_counts = [a2av_count(p, rank, b) for p in range(n)]
            self.inp = bufs["in"][: sum(self.in_counts)]
            self.out = bufs["out"][: sum(self.out_counts)]
        elif op == "send_recv":
            self.inp = bufs["in"][:c]
            self.out = bufs["out"][:c]
            self.peer = rank ^ 1 if (rank ^ 1) < n else -1
        else:  # barrier
            self.inp = self.out = None

    def call(self):
        op = self.op
        if op == "all_reduce":
            if self.inp is not self.out:
                self.out.copy_(self.inp)  # torch's all_reduce is in place only
            dist.all_reduce(self.out, op=self.redop)
        elif op == "reduce_scatter":
            # torch 1.13's gloo group has no reduce_scatter: all_reduce + copy, the usual workaround.
            dist.all_reduce(self.inp, op=self.redop)
            if not self.inplace:
                self.out.copy_(self.mine)
        elif op == "all_gather":
            dist.all_gather(self.outs, self.inp)
        elif op == "broadcast":
            dist.broadcast(self.out, src=self.root)
        elif op == "gather":
            dist.gather(self.inp, gather_list=self.outs, dst=self.root)
        elif op == "reduce":
            if self.inp is not self.out:
                self.out.copy_(self.inp)  # torch's reduce is in place only
            dist.reduce(self.out, dst=self.root, op=self.redop)
        elif op == "scatter":
            dist.scatter(self.out, scatter_list=self.ins, src=self.root)
        elif op == "all_to_all":
            # torch 1.13's gloo group has no all_to_all of tensor lists; all_to_all_single is its form.
            dist.all_to_all_single(self.out, self.inp)
        elif op == "all_to_all_v":
            dist.all_to_all_single(self.out, self.inp, output_split_sizes=self.out_counts,
                                   input_split_sizes=self.in_counts)
        elif op == "send_recv":
            if self.peer < 0:
                return
            if self.rank < self.peer:
                dist.send(self.inp, self.peer)
                dist.recv(self.out, self.peer)
            else:
                dist.recv(self.out, self.peer)
                dist.send(self.inp, self.peer)
        else:
            dist.barrier()

    def fill(self):
        if self.op == "barrier":
            return
        red = self.op in ("all_reduce", "reduce_scatter", "reduce")
        overlap = self.inp is self.out or (self.op in ("reduce_scatter", "all_gather") and self.inplace)
        if not overlap or self.op == "all_gather":
            self.out.zero_()
        self.inp.copy_(input_values(red, self.rank, 0, self.inp.numel()).to(self.dtype))

    def verify(self):
        op, l, n, rank = self.op, self.l, self.n, self.rank
        b = l["block"]
        if op == "barrier":
            return 0
        if op == "all_reduce":
            return wrong(self.out, expected_reduction(self.a.redop, n, 0, l["count"]))
        if op == "reduce_scatter":
            return wrong(self.out, expected_reduction(self.a.redop, n, rank * b, b))
        if op == "reduce":
            return wrong(self.out, expected_reduction(self.a.redop, n, 0, l["count"])) if rank == self.root else 0
        if op == "broadcast":
            return wrong(self.out, input_values(False, self.root, 0, l["count"]))
        if op == "scatter":
            return wrong(self.out, input_values(False, self.root, rank * b, b))
        if op == "all_to_all":
            return wrong(self.out, torch.cat([input_values(False, q, rank * b, b) for q in range(n)]))
        if op == "all_to_all_v":
            # Block q came from rank q, which packed this rank's share at the prefix sum of its counts.
            want = torch.cat([input_values(False, q, sum(a2av_count(q, p, b) for p in range(rank)),
                                           a2av_count(q, rank, b)) for q in range(n)])
            return wrong(self.out, want)
        if op == "send_recv":
            return wrong(self.out, input_values(False, self.peer, 0, l["count"])) if self.peer >= 0 else 0
        if op == "gather" and rank != self.root:
            return 0
        want = torch.cat([input_values(False, q, 0, b) for q in range(n)])
        return wrong(self.out, want)


def cross_max(values):
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def cross_sum(values):
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def plan_iters(iters, min_iters, budget, warm_us):
    if budget <= 0 or warm_us <= 0:
        return iters
    fit = budget * 1e6 / warm_us
    return max(min(min_iters, iters), iters if fit >= iters else int(fit))


def measure(a, case):
    wrong_count = -1
    if a.check:
        case.fill()
        case.call()
        wrong_count = int(cross_sum([case.verify()])[0])
    case.fill()
    warm = []
    for _ in range(a.warmup):
        t0 = time.perf_counter()
        case.call()
        warm.append((time.perf_counter() - t0) * 1e6)
    warm_us = cross_max([statistics.median(warm) if warm else 0.0])[0]
    iters = plan_iters(a.iters, a.min_iters, a.budget, warm_us)
    t = []
    for _ in range(iters):
        t0 = time.perf_counter()
        case.call()
        t.append((time.perf_counter() - t0) * 1e6)
    t = cross_max(t)
    return iters, t, wrong_count


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Short flags as comm-bench's and nccl-tests' (-o is the reduction, -d the type, -r the root).
    p.add_argument("--op", default="all_reduce", help=f"{'|'.join(OPS)}, a comma list, or all")
    p.add_argument("-d", "--dtype", default="float")
    p.add_argument("-o", "--redop", default="sum")
    p.add_argument("-r", "--root", type=int, default=0)
    p.add_argument("-b", "--minbytes", type=parse_bytes, default=8)
    p.add_argument("-e", "--maxbytes", type=parse_bytes, default=64 << 20)
    p.add_argument("-f", "--stepfactor", type=int, default=4)
    p.add_argument("--sizes", default="")
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-w", "--warmup", type=int, default=5)
    p.add_argument("--min-iters", type=int, default=5)
    p.add_argument("--budget", type=float, default=0.0)
    p.add_argument("-c", "--check", nargs="?", type=int, choices=(0, 1), const=1, default=0,
                   help="verify every size (-c, --check or -c 1)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--inplace", dest="placement", action="store_const", const="in")
    p.add_argument("--out-of-place", dest="placement", action="store_const", const="out")
    p.add_argument("--system", default="torch-gloo")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    a = p.parse_args()

    ops = OPS if a.op == "all" else a.op.split(",")
    for op in ops:
        if op not in OPS:
            sys.exit(f"torch_peer: unknown op '{op}' ({'|'.join(OPS)}, a comma list, or all)")
        if op == "scatter" and default_inplace(a, op):
            sys.exit("torch_peer: torch's scatter has no in-place form (its output is its own tensor)")
    if a.dtype not in DTYPES:
        sys.exit(f"torch_peer: dtype '{a.dtype}' is not available in torch {torch.__version__}")
    if a.redop not in REDOPS:
        sys.exit(f"torch_peer: redop '{a.redop}' is not supported by torch's gloo group")
    torch.set_num_threads(a.threads)
    dtype = DTYPES[a.dtype]
    elem = torch.tensor([], dtype=dtype).element_size()
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(minutes=30))
    rank, n = dist.get_rank(), dist.get_world_size()
    sizes = size_list(a)

    total_wrong = 0
    for op in ops:
        # A barrier moves no data: it runs once, at size 0 (cli.hpp sizes_for).
        ls = [layout(op, s, elem, n) for s in ([0] if op == "barrier" else sizes)]
        # Only the buffers this op and placement use (as benchmarks/common/views.hpp).
        inplace = default_inplace(a, op)
        in_used = op in ("reduce_scatter", "gather", "scatter", "all_to_all", "all_to_all_v", "send_recv") or (
            op in ("all_reduce", "all_gather", "reduce") and not inplace)
        out_used = op != "barrier" and not (op == "reduce_scatter" and inplace)
        if op == "all_to_all_v":  # room for the largest row or column of counts (bench.hpp)
            in_cap = out_cap = max((l["block"] + l["block"] // 2) * n for l in ls)
        else:
            in_cap = max(l["block"] if op in ("all_gather", "gather") else l["count"] for l in ls)
            out_cap = max(l["count"] for l in ls)
        bufs = {"in": torch.zeros(in_cap if in_used else 0, dtype=dtype),
                "out": torch.zeros(out_cap if out_used else 0, dtype=dtype)}
        if rank == 0 and not a.json:
            print(f"# {a.system} {op}: world {n}, dtype {a.dtype}, torch {torch.__version__}")
            print(f"# {'size':>12} {'count':>12} {'type':>9} {'time(us)':>10} {'algbw':>8} {'busbw':>8} {'#wrong':>7}")
        for l in ls:
            case = Case(a, op, l, bufs, rank, n, dtype)
            iters, t, wrong_count = measure(a, case)
            if op != "barrier":
                total_wrong += max(0, wrong_count)
            if op == "send_recv":
                t = [x / 2 for x in t]  # a round trip timed: the row is one way, as osu_latency
            med = statistics.median(t)
            algbw = l["bytes"] / (med * 1e3) if med > 0 else 0.0
            row = {
                "schema": SCHEMA, "kind": "result", "system": a.system,
                "algo": algo_of(op, case.inplace),
                "op": op, "dtype": a.dtype, "redop": a.redop if op in REDUCTIONS else "none",
                "root": a.root if op in ROOTED else -1, "world": n,
                "placement": "in" if case.inplace else "out",
                "bytes": l["bytes"], "count": l["count"], "block": l["block"], "iters": iters,
                "time_us": round(med, 3), "mean_us": round(statistics.fmean(t), 3), "min_us": round(min(t), 3),
                "max_us": round(max(t), 3), "algbw_gbs": round(algbw, 6),
                "busbw_gbs": round(algbw * bus_factor(op, n), 6),
                "wrong": wrong_count if wrong_count >= 0 and op != "barrier" else None,
            }
            if rank == 0:
                if a.json:
                    print(json.dumps(row, separators=(",", ":")), flush=True)
                else:
                    w = "N/A" if wrong_count < 0 or op == "barrier" else str(wrong_count)
                    print(f"  {l['bytes']:>12} {l['count']:>12} {a.dtype:>9} {med:>10.2f} {algbw:>8.3f} "
                          f"{row['busbw_gbs']:>8.3f} {w:>7}", flush=True)
    rss = [0.0] * n
    rss[rank] = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    rss = cross_max(rss)
    if rank == 0 and a.json:
        print(json.dumps({"schema": SCHEMA, "kind": "memory", "system": a.system, "world": n,
                          "peak_rss_kb": [int(x) for x in rss]}, separators=(",", ":")), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if total_wrong:  # every rank holds the same sum, as comm-bench -c 1 exits 1
        if rank == 0:
            print(f"torch_peer: {total_wrong} wrong elements", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
