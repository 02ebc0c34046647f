#!/usr/bin/env bash
# Multi-node scenarios over scripts/cluster (see CMakeLists.txt here). One scenario per run:
#
#   multinode_test.sh --cluster S --comm-run R --demo D --init I --probe P --train T --state DIR SCENARIO [SHAPE]
#
# SHAPE is NODESxRANKS (2x2, 3x1). Each scenario brings up its own cluster (namespaces named
# cmn<pid>-*), launches `comm-run --nnodes K --node-rank i --master-addr <node 0>` in every node,
# checks what the ranks print, and tears the cluster down through `scripts/cluster run` (also when
# it fails); the outer script then checks that no namespace of it is left. Exit 77: skipped.
set -Eeuo pipefail
# set -e ends the script at the first failing command; say which, or the failure is silent.
trap 'echo "FAIL: line $LINENO: \"$BASH_COMMAND\" exited $?" >&2' ERR
export LC_ALL=C  # a "." in $EPOCHREALTIME and in the numbers awk reads

cluster="" comm_run="" demo="" init="" probe="" train="" state=""
inner=0
while [[ ${1:-} == --* ]]; do
  case $1 in
    --cluster) cluster=$2 ;;
    --comm-run) comm_run=$2 ;;
    --demo) demo=$2 ;;
    --init) init=$2 ;;
    --probe) probe=$2 ;;
    --train) train=$2 ;;
    --state) state=$2 ;;
    --inner) inner=1; shift; continue ;;
    *) echo "multinode_test: unknown option $1" >&2; exit 2 ;;
  esac
  shift 2
done
scenario=${1:?scenario}
shape=${2:-}
self=$(readlink -f "$0")
all_args=(--cluster "$cluster" --comm-run "$comm_run" --demo "$demo" --init "$init" --probe "$probe" --train "$train"
  --state "$state")

fail() { echo "FAIL: $*" >&2; exit 1; }
say() { echo "multinode[$scenario${shape:+ $shape}]: $*"; }
now() { echo "$EPOCHREALTIME"; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", b - a }'; }
us() { echo "${EPOCHREALTIME/./}"; }
# within T0_US SECONDS: less than SECONDS (an integer) since T0_US. No fork: polling loops use it.
within() { (( ${EPOCHREALTIME/./} - $1 < $2 * 1000000 )); }
# lt A B: A < B, as real numbers
lt() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a < b) }'; }
# `... | matches RE`: grep -q stops reading at the first match and the writer's SIGPIPE then fails
# the pipeline (pipefail); this reads everything.
matches() { grep "$@" >/dev/null; }

nodes=1 per_node=1
if [[ -n $shape ]]; then
  [[ $shape =~ ^([0-9]+)x([0-9]+)$ ]] || fail "bad shape '$shape' (want NODESxRANKS)"
  nodes=${BASH_REMATCH[1]} per_node=${BASH_REMATCH[2]}
fi
world=$((nodes * per_node))

# ------------------------------------------------------------------------------------------------
# Outside the cluster: skip where it cannot run, bring it up around the inner run, check teardown.

leftovers() {
  "$cluster" check || exit $?
  local bad=0 p
  mkdir -p "$state"
  for f in "$state"/*; do
    [[ -e $f ]] || continue
    p=$(basename "$f")
    if ip netns list | awk '{print $1}' | matches "^$p-"; then
      echo "FAIL: namespaces of cluster $p are left: $(ip netns list | awk '{print $1}' | grep "^$p-" | tr '\n' ' ')"
      # (A test killed by CTest's TIMEOUT gets no chance to tear down.) Reported, then removed.
      "$cluster" down --prefix "$p" && rm -f "$f"
      bad=1
    else
      echo "cluster $p: removed"
      rm -f "$f"
    fi
  done
  # The root namespace must never see the clusters' networks.
  if ip -o addr | grep -E ' 10\.23[12]\.0\.' || ip route | grep -E '^10\.23[12]\.0\.'; then
    echo "FAIL: the root namespace has a cluster address or route"
    bad=1
  fi
  ((bad == 0)) && echo "no cluster left behind"
  exit $bad
}

if ((inner == 0)); then
  [[ $scenario == leftovers ]] && leftovers
  "$cluster" check || exit $?
  prefix="cmn$$"
  mkdir -p "$state"
  touch "$state/$prefix"
  shaping=()
  cluster_nodes=$nodes
  if [[ $scenario == seed ]]; then
    # The seed scenario also runs over shaped links: a rate limit, and latency where netem exists.
    shaping=(--rate 1gbit)
    ! "$cluster" check --netem >/dev/null || shaping+=(--delay 1ms --jitter 200us)
  fi
  case $scenario in
    cluster) cluster_nodes=3 ;;
    no_master | ifname) cluster_nodes=2 ;;
  esac
  start=$(now)
  rc=0
  if [[ $scenario == cluster ]]; then
    # The cluster self-test drives up/down itself as well.
    COMM_CLUSTER_PREFIX=$prefix bash "$self" --inner "${all_args[@]}" cluster || rc=$?
  else
    "$cluster" run --nodes "$cluster_nodes" --prefix "$prefix" "${shaping[@]}" -- \
      bash "$self" --inner "${all_args[@]}" "$scenario" ${shape:+"$shape"} || rc=$?
  fi
  left=$(ip netns list | awk '{print $1}' | grep "^$prefix-" || true)
  [[ -z $left ]] || { echo "FAIL: namespaces left after the test: $left"; rc=1; }
  ((rc != 0)) || rm -f "$state/$prefix"
  say "$( ((rc == 0)) && echo passed || echo "FAILED (rc $rc)") in $(elapsed "$start" "$(now)") s"
  exit $rc
fi

# ------------------------------------------------------------------------------------------------
# Inside: COMM_CLUSTER_PREFIX names the cluster (scripts/cluster run exported it).

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
master=10.231.0.1
port=$((20000 + RANDOM % 40000))  # any port: nothing else lives in these namespaces
export COMM_STORE_TOKEN="mn$$-$RANDOM$RANDOM"
declare -a launcher_pid=()
grace=2s

# launch NODE LOG [VAR=VALUE...] -- PROGRAM ARGS...: this node's comm-run, in the background.
launch() {
  local node=$1 log=$2
  shift 2
  local envs=()
  while [[ $1 != -- ]]; do envs+=("$1"); shift; done
  shift
  # --timeout: a backstop so that no job outlives the test, whatever the ranks do.
  "$cluster" exec "$node" -- env "${envs[@]}" "$comm_run" --nnodes "$nodes" --node-rank "$node" \
    --master-addr "$master" --master-port "$port" -n "$per_node" --grace-period "$grace" --timeout 60s "$@" \
    >"$log" 2>&1 &
  launcher_pid[node]=$!
}

# wait_exit PID SECONDS: sets exit_rc to the exit code, or to 200 when PID is still running at the
# deadline (a hang). Not in a $(...) subshell: only this shell can reap its children.
wait_exit() {
  local pid=$1 limit=$2 t0
  t0=$(us)
  while kill -0 "$pid" 2>/dev/null && within "$t0" "$limit"; do sleep 0.05; done
  if kill -0 "$pid" 2>/dev/null; then
    echo "FAIL: pid $pid still running after ${limit}s (hang)" >&2
    exit_rc=200
    return
  fi
  exit_rc=0
  wait "$pid" || exit_rc=$?
}

# Runs one job on every node, waits for all launchers, prints their logs; fails on a hang.
run_job() {  # run_job LIMIT [VAR=VALUE...] -- PROGRAM ARGS...
  local limit=$1
  shift
  local i
  for ((i = 0; i < nodes; i++)); do launch "$i" "$work/node$i.log" "$@"; done
  job_rc=()
  for ((i = 0; i < nodes; i++)); do wait_exit "${launcher_pid[i]}" "$limit"; job_rc[i]=$exit_rc; done
  for ((i = 0; i < nodes; i++)); do
    sed "s/^/node$i | /" "$work/node$i.log"
  done
  for ((i = 0; i < nodes; i++)); do
    [[ ${job_rc[i]} != 200 ]] || fail "node $i's launcher hung"
  done
}

all_logs() { cat "$work"/node*.log; }
# grep over the nodes' logs. Never `all_logs | grep -q`: grep -q quits at the first match, cat
# gets SIGPIPE, and pipefail turns the match into a failure.
logs_grep() { grep -h "$@" "$work"/node*.log; }

expect_line() {  # expect_line TEXT: some rank printed TEXT (fixed string)
  logs_grep -qF -- "$1" || fail "no line with '$1'"
}

jobs_ok() {
  local i
  for ((i = 0; i < nodes; i++)); do ((job_rc[i] == 0)) || fail "node $i's comm-run exited ${job_rc[i]}"; done
}

# ------------------------------------------------------------------------------------------------

scenario_seed() {
  run_job 60 COMM_TIMEOUT=30s -- "$demo"
  jobs_ok
  local r sum=$((world * (world - 1) / 2)) all="" gathered=""
  for ((r = 0; r < world; r++)); do all+="${all:+, }$r"; gathered+="${gathered:+, }$((r * 10))"; done
  for ((r = 0; r < world; r++)); do
    expect_line "[$r] rank $r: all_reduce      before [$r]  after [$sum]"
    local contrib="" k
    for ((k = 0; k < world; k++)); do contrib+="${contrib:+, }$r"; done
    expect_line "[$r] rank $r: reduce_scatter  before [$contrib]  after [$sum]"
    expect_line "[$r] rank $r: all_gather      before [$r]  after [$all]"
    expect_line "[$r] rank $r: broadcast       before [$( ((r == 0)) && echo "$world" || echo -1)]  after [$world]"
    expect_line "[$r] rank $r: async all_reduce before [$((r + 1))]  after [$((world * (world + 1) / 2))]"
  done
  expect_line "[0] rank 0: gather          before [0]  after [$gathered]"
  say "seed scenario correct on all $world ranks of $nodes nodes"
}

scenario_cdb() {
  run_job 60 COMM_TIMEOUT=30s COMM_DEBUG=INFO -- "$init"
  jobs_ok
  local r sum=$((world * (world - 1) / 2))
  for ((r = 0; r < world; r++)); do
    # auto must not take the ranks of different nodes for one host (Shm); gloo (or a hierarchical
    # backend over it) spans the nodes.
    logs_grep -qE "^\[$r\] rank $r of $world on (gloo|hierarchical): sum of ranks = $sum \(expected $sum\)$" ||
      fail "rank $r: no 'rank $r of $world on gloo|hierarchical: sum of ranks = $sum' line"
  done
  logs_grep -q "on shm:" && fail "backend auto chose shm across nodes"
  logs_grep -q "backend .*auto: the ranks span several hosts" || fail "no INFO line saying the ranks span several hosts"
  say "cdb (backend auto) joined all $world ranks across $nodes nodes"
}

scenario_split() {
  run_job 60 COMM_TIMEOUT=30s -- "$probe" split
  jobs_ok
  local r
  for ((r = 0; r < world; r++)); do
    logs_grep -q "^\[$r\] rank $r: split OK node=$((r / per_node)) node_size=$per_node .* cross_size=$nodes " ||
      fail "rank $r did not report 'split OK' with node $((r / per_node))"
  done
  logs_grep -q "FAIL" && fail "a rank reported FAIL"
  say "split by node and across nodes correct on all $world ranks"
}

# Fault scenarios: ranks loop on all_reduce; something is killed; every rank that was not killed
# must end with a comm::Error, soon (the probe outlives comm-run's SIGTERM so that ranks on the
# node of the first failing rank show their own error too; the grace period outlasts COMM_TIMEOUT). Gloo sees a dead peer through its closed connections
# (RemoteError, within a second or so); libgloo can miss it when a send was partly written, and
# that rank ends with Timeout at its deadline instead (the contract allows either; see
# tests/faults/collective_faults_test.cpp), so the bounds are: RemoteError within death_bound,
# anything within COMM_TIMEOUT + slack.
fault_timeout=6
death_bound=2
# Floats per all_reduce. On 2x2, 1 MiB messages keep sends in flight when the peer dies: that is
# when a write meets the reset connection (SIGPIPE before comm ignored it: one run in ten).
loop_count=4096
[[ $shape != 2x2 ]] || loop_count=262144
slack=3

start_loop_job() {
  local i
  grace=$((fault_timeout + slack))s
  mkdir -p "$work/ready"
  for ((i = 0; i < nodes; i++)); do launch "$i" "$work/node$i.log" COMM_TIMEOUT=${fault_timeout}s -- "$probe" loop "$work/ready" "$loop_count"; done
  local t0 r
  t0=$(us)
  for ((r = 0; r < world; r++)); do
    while [[ ! -e $work/ready/ready.$r ]]; do
      within "$t0" 30 || { all_logs; fail "rank $r not ready after 30 s"; }
      sleep 0.05
    done
  done
}

# check_survivors KILL_TIME FIRST_DEAD LAST_DEAD: every rank outside FIRST_DEAD..LAST_DEAD printed
# one ERROR line, a comm::Error naming its rank, in time.
check_survivors() {
  local t_kill=$1 first_dead=$2 last_dead=$3 r line kind at dt worst=0 n_remote=0 n_timeout=0 n=0
  for ((r = 0; r < world; r++)); do
    ((r < first_dead || r > last_dead)) || continue
    n=$((n + 1))
    line=$(logs_grep -m1 "^\[$r\] rank $r: ERROR " || true)
    [[ -n $line ]] || fail "rank $r (node $((r / per_node))) printed no comm::Error"
    kind=$(sed -E 's/.* kind=([^ ]+) .*/\1/' <<<"$line")
    at=$(sed -E 's/.* at=([0-9.]+) .*/\1/' <<<"$line")
    dt=$(elapsed "$t_kill" "$at")
    say "rank $r: $kind ${dt} s after the kill: ${line#*what=}"
    case $kind in
      comm::RemoteError) n_remote=$((n_remote + 1)); lt "$dt" "$death_bound" || fail "rank $r: RemoteError after $dt s (bound $death_bound s)" ;;
      comm::Timeout) n_timeout=$((n_timeout + 1)); lt "$dt" "$((fault_timeout + slack))" || fail "rank $r: Timeout after $dt s (bound $((fault_timeout + slack)) s)" ;;
      comm::*) lt "$dt" "$((fault_timeout + slack))" || fail "rank $r: $kind after $dt s" ;;
      *) fail "rank $r ended with $kind, not a comm::Error" ;;
    esac
    grep -q "rank $r" <<<"$line" || fail "rank $r's error does not name its rank"
    lt "$dt" "$worst" || worst=$dt
  done
  say "all $n survivors ended with a comm::Error: $n_remote RemoteError, $n_timeout Timeout; slowest ${worst} s after the kill (COMM_TIMEOUT ${fault_timeout} s)"
}

scenario_kill_rank() {
  start_loop_job
  # The last rank of node 1: never the store host (rank 0), and on another node than rank 0.
  local victim=$((2 * per_node - 1)) pid t_kill i
  pid=$(cat "$work/ready/pid.$victim")
  # The pid must be the rank itself, inside node 1's network namespace.
  [[ $(ip netns identify "$pid") == "$COMM_CLUSTER_PREFIX-n1" ]] || fail "pid $pid of rank $victim is not in node 1"
  t_kill=$(now)
  kill -9 "$pid"
  for ((i = 0; i < nodes; i++)); do wait_exit "${launcher_pid[i]}" $((fault_timeout + slack + 3)); job_rc[i]=$exit_rc; done
  all_logs | sed 's/^/  | /'
  for ((i = 0; i < nodes; i++)); do
    [[ ${job_rc[i]} != 200 ]] || fail "node $i's launcher hung"
    ((job_rc[i] != 0)) || fail "node $i's comm-run exited 0 after rank $victim was killed"
  done
  ((job_rc[1] == 137)) || fail "node 1's comm-run exited ${job_rc[1]}, want 137 (its rank was SIGKILLed)"
  grep -q "rank $victim was killed by signal SIGKILL" "$work/node1.log" || fail "node 1's comm-run does not name the killed rank"
  check_survivors "$t_kill" "$victim" "$victim"
  say "every launcher ended: exit codes ${job_rc[*]}"
}

scenario_kill_node() {
  start_loop_job
  # 2x2: node 1; 3x1: node 0, which hosts the store (rank 0).
  local dead=1
  ((nodes < 3)) || dead=0
  local lpid=${launcher_pid[dead]} t_kill i r
  [[ $(ip netns identify "$lpid") == "$COMM_CLUSTER_PREFIX-n$dead" && $(cat "/proc/$lpid/comm") == comm-run ]] ||
    fail "pid $lpid is not node $dead's comm-run"
  t_kill=$(now)
  kill -9 "$lpid"
  # Its ranks die with it (comm-run sets PR_SET_PDEATHSIG=SIGKILL): gone (or zombies) at once.
  for ((r = dead * per_node; r < (dead + 1) * per_node; r++)); do
    local p t0
    p=$(cat "$work/ready/pid.$r")
    t0=$(us)
    while [[ -e /proc/$p && $(cut -d' ' -f3 "/proc/$p/stat" 2>/dev/null) != Z ]]; do
      within "$t0" 2 || fail "rank $r (pid $p) outlived its killed launcher by 2 s"
      sleep 0.02
    done
    say "rank $r died with its launcher ($(elapsed "$t_kill" "$(now)") s)"
  done
  for ((i = 0; i < nodes; i++)); do wait_exit "${launcher_pid[i]}" $((fault_timeout + slack + 3)); job_rc[i]=$exit_rc; done
  all_logs | sed 's/^/  | /'
  for ((i = 0; i < nodes; i++)); do
    [[ ${job_rc[i]} != 200 ]] || fail "node $i's launcher hung"
    ((job_rc[i] != 0)) || fail "node $i's comm-run exited 0 after node $dead was lost"
  done
  check_survivors "$t_kill" $((dead * per_node)) $(((dead + 1) * per_node - 1))
  say "every launcher ended: exit codes ${job_rc[*]}"
}

# Node 1 only, pointed at a master where nothing listens: a clear error naming the master address,
# at the deadline (the store retries until then), not a hang.
scenario_no_master() {
  nodes=2 per_node=1
  local t=3 target t0 rc dt log
  for target in "$master" 10.231.0.77; do
    # 10.231.0.1: node 0 exists, nothing listens (refused); 10.231.0.77: no such host (no answer).
    log=$work/no_master_${target}.log
    t0=$(now)
    "$cluster" exec 1 -- env COMM_TIMEOUT=${t}s "$comm_run" --nnodes 2 --node-rank 1 --master-addr "$target" \
      --master-port "$port" -n 1 --timeout 60s "$demo" >"$log" 2>&1 &
    wait_exit $! $((t + slack + 3))
    rc=$exit_rc
    dt=$(elapsed "$t0" "$(now)")
    sed 's/^/  | /' "$log"
    [[ $rc != 200 ]] || fail "launcher hung with master $target"
    ((rc != 0)) || fail "job without a master exited 0"
    grep -q "store.connect" "$log" || fail "the error does not name the operation (store.connect)"
    grep -qF "$target:$port" "$log" || fail "the error does not name the master $target:$port"
    grep -q "rank 1" "$log" || fail "the error does not name the rank"
    lt "$dt" "$((t + slack))" || fail "took $dt s, COMM_TIMEOUT is $t s"
    lt "$((t - 1))" "$dt" || fail "gave up after $dt s, before COMM_TIMEOUT ($t s)"
    say "master $target: error after $dt s (COMM_TIMEOUT ${t} s), exit $rc"
  done
}

# Interface choice: eth0 (10.231/24) carries the store; the job's data goes where the variables say.
# Proven by the interfaces' transmit counters in both namespaces around each job.
tx_bytes() {  # sets tx0, tx1: bytes sent on eth0, eth1, summed over the nodes
  local i a b
  tx0=0 tx1=0
  for ((i = 0; i < nodes; i++)); do
    { read -r a && read -r b; } < <("$cluster" exec "$i" -- cat /sys/class/net/eth0/statistics/tx_bytes \
      /sys/class/net/eth1/statistics/tx_bytes)
    tx0=$((tx0 + a)) tx1=$((tx1 + b))
  done
}

ifname_case() {  # ifname_case LABEL WANT(eth0|eth1|both) [VAR=VALUE...]
  local label=$1 want=$2
  shift 2
  local e0 e1 d0 d1
  tx_bytes
  e0=$tx0 e1=$tx1
  run_job 60 COMM_TIMEOUT=30s "$@" -- "$probe" bytes $((4 << 20)) 4
  jobs_ok
  tx_bytes
  d0=$((tx0 - e0)) d1=$((tx1 - e1))
  say "$label: eth0 sent $d0 bytes, eth1 sent $d1 bytes (job moved 2 x 4 x 4 MiB)"
  local big=$((8 << 20)) small=$((1 << 20))
  case $want in
    eth0) ((d0 > big && d1 < small)) || fail "$label: want the data on eth0" ;;
    eth1) ((d1 > big && d0 < small)) || fail "$label: want the data on eth1 (eth0 only for the store)" ;;
    both) ((d0 > big / 2 && d1 > big / 2)) || fail "$label: want the data on both interfaces" ;;
  esac
}

scenario_ifname() {
  nodes=2 per_node=1 world=2
  ifname_case "default (route to MASTER_ADDR)" eth0
  ifname_case "GLOO_SOCKET_IFNAME=eth1" eth1 GLOO_SOCKET_IFNAME=eth1
  ifname_case "COMM_SOCKET_IFNAME=eth1 over GLOO_SOCKET_IFNAME=eth0" eth1 COMM_SOCKET_IFNAME=eth1 GLOO_SOCKET_IFNAME=eth0
  ifname_case "COMM_SOCKET_IFNAME=eth0,eth1" both COMM_SOCKET_IFNAME=eth0,eth1
  # A wrong name is a clear error that says where it came from.
  run_job 30 COMM_TIMEOUT=10s COMM_SOCKET_IFNAME=nosuch0 -- "$probe" bytes 1024 1
  local i
  for ((i = 0; i < nodes; i++)); do ((job_rc[i] != 0)) || fail "COMM_SOCKET_IFNAME=nosuch0: node $i exited 0"; done
  logs_grep "nosuch0" | grep "COMM_SOCKET_IFNAME" >/dev/null || fail "the error does not name nosuch0 and COMM_SOCKET_IFNAME"
  say "COMM_SOCKET_IFNAME=nosuch0: $(logs_grep -m1 "nosuch0" | head -1)"
}

# scripts/cluster itself: layout, isolation, shaping, and teardown on success, failure and signals.
scenario_cluster() {
  local p=$COMM_CLUSTER_PREFIX c
  c=$cluster
  local shaping=(--rate 20mbit) netem=0
  local why
  if why=$("$c" check --netem); then netem=1; shaping+=(--delay 20ms); else say "no delay check: ${why#SKIPPED: }"; fi
  # shellcheck disable=SC2064  # expanded now: the locals are gone when the trap runs
  trap "\"$c\" down --prefix \"$p\" >/dev/null 2>&1 || true; rm -rf \"$work\"" EXIT
  "$c" up --nodes 3 --prefix "$p" "${shaping[@]}"
  export COMM_CLUSTER_PREFIX=$p
  local n
  for n in sw n0 n1 n2; do ip netns list | awk '{print $1}' | matches -x "$p-$n" || fail "no namespace $p-$n"; done
  [[ $("$c" addr 2) == 10.231.0.3 && $("$c" addr 2 eth1) == 10.232.0.3 ]] || fail "addr gives the wrong address"
  "$c" exec 1 -- ip -o -4 addr show dev eth1 | matches "10.232.0.2/24" || fail "node 1 has no 10.232.0.2 on eth1"
  [[ $("$c" exec 2 -- hostname) == node2 ]] || fail "node 2's host name is not node2"
  # Isolation: no default route in a node (nothing can leave), nothing of ours in the root namespace.
  "$c" exec 0 -- ip route get 192.0.2.1 >/dev/null 2>&1 && fail "node 0 can route outside the cluster"
  ip -o addr | matches -E ' 10\.23[12]\.0\.' && fail "the root namespace got a cluster address"
  "$c" exec 0 -- tc qdisc show dev eth0 | matches "tbf .*rate 20Mbit" || fail "no tbf on node 0's eth0"
  # Reachability and shaping on both networks: 1 MB at 20 Mbit/s is at least 0.4 s.
  local net dst out bytes=1000000
  for net in eth0 eth1; do
    dst=$("$c" addr 2 "$net")
    "$c" exec 2 -- "$probe" sink "$dst" 5001 >"$work/sink" 2>&1 &
    local sink=$!
    for _ in $(seq 100); do grep -q listening "$work/sink" && break; sleep 0.05; done
    out=$("$c" exec 0 -- "$probe" source "$dst" 5001 "$bytes") || fail "node 0 cannot reach $dst"
    wait "$sink" || fail "sink on $dst failed: $(cat "$work/sink")"
    say "node 0 -> node 2 over $net: $out; $(grep bytes= "$work/sink")"
    grep -q "bytes=$bytes " "$work/sink" || fail "$dst received the wrong byte count"
    local s
    s=$(sed -nE 's/^sink: bytes=.* s=([0-9.]+).*/\1/p' "$work/sink")
    [[ -n $s ]] && lt 0.25 "$s" || fail "1 MB took $s s over a 20 Mbit/s link: the rate limit is not applied"
    if ((netem)); then
      local ms
      ms=$(sed -E 's/.*connect_ms=([0-9.]+).*/\1/' <<<"$out")
      lt 35 "$ms" || fail "connect took $ms ms with 20 ms delay each way"
    fi
  done
  # exec runs the command itself (no shell left between), so $! is the command's pid.
  "$c" exec 1 -- sleep 30 &
  local sleeper=$! t0
  t0=$(us)
  until [[ $(cat "/proc/$sleeper/comm" 2>/dev/null) == sleep ]]; do
    within "$t0" 10 || fail "exec never became the command"
    sleep 0.05
  done
  [[ $(ip netns identify "$sleeper") == "$p-n1" ]] || fail "exec's pid is not the command in node 1"
  "$c" down
  kill -0 "$sleeper" 2>/dev/null && [[ $(awk '{print $3}' "/proc/$sleeper/stat") != Z ]] && fail "down left a process running in node 1"
  wait "$sleeper" 2>/dev/null || true
  [[ -z $(ip netns list | grep "^$p-") ]] || fail "down left namespaces"
  say "up/exec/addr/down, isolation and shaping work"

  # run: torn down after success, failure and SIGTERM; up cleans up after itself when it fails.
  local rc=0
  "$c" run --nodes 2 --prefix "$p" -- bash -c '"$COMM_CLUSTER" exec 0 -- true && exit 3' || rc=$?
  ((rc == 3)) || fail "run did not pass on the command's exit code (got $rc)"
  [[ -z $(ip netns list | grep "^$p-") ]] || fail "run left namespaces after a failing command"
  "$c" run --nodes 2 --prefix "$p" -- sleep 30 >/dev/null 2>&1 &
  local runner=$!
  t0=$(us)
  until [[ -e /run/netns/$p-n1 ]]; do within "$t0" 10 || fail "run never brought the cluster up"; sleep 0.05; done
  sleep 0.2
  kill -TERM "$runner"
  rc=0
  wait "$runner" || rc=$?
  ((rc == 143)) || fail "run exited $rc on SIGTERM, want 143"
  [[ -z $(ip netns list | grep "^$p-") ]] || fail "run left namespaces after SIGTERM"
  rc=0
  "$c" up --nodes 2 --prefix "$p" --loss bogus >/dev/null 2>&1 || rc=$?
  ((rc != 0)) || fail "up accepted --loss bogus"
  [[ -z $(ip netns list | grep "^$p-") ]] || fail "a failed up left namespaces"
  rc=0
  "$c" up --nodes 2 --prefix "$p" --rate fast >/dev/null 2>&1 || rc=$?
  ((rc != 0)) || fail "up accepted --rate fast"
  [[ -z $(ip netns list | grep "^$p-") ]] || fail "a failed up left namespaces"
  for bad in "--rate 1gbit --burst 65536" "--rate 1gbit --burst 12x" "--burst 262144"; do
    rc=0
    # shellcheck disable=SC2086  # $bad is several words on purpose
    "$c" up --nodes 2 --prefix "$p" $bad >/dev/null 2>&1 || rc=$?
    ((rc != 0)) || fail "up accepted $bad"
    [[ -z $(ip netns list | grep "^$p-") ]] || fail "a failed up ($bad) left namespaces"
  done
  local q
  q=$("$c" run --nodes 1 --prefix "$p" --rate 1gbit --burst 262144 -- bash -c 'ip netns exec "$COMM_CLUSTER_PREFIX-n0" tc qdisc show dev eth0')
  # tc stores the bucket as time at the rate and prints it back rounded (262125b): within 1 %.
  [[ $q =~ burst\ ([0-9]+)b ]] && ((BASH_REMATCH[1] > 259500 && BASH_REMATCH[1] < 264800)) ||
    fail "--burst 262144 did not reach tbf: $q"
  say "run tears down after failure and SIGTERM; a failed up removes what it made; --burst sets tbf's bucket"
}

# Fault-tolerant training across nodes (docs/RELIABILITY.md, "Fault-tolerant communicators"):
# examples/data_parallel_training --elastic over Hierarchical<Shm, Gloo>, node 0's launcher hosting
# the store. "rank": the last rank of node 1 SIGKILLs itself at step 20; node 1's comm-run starts a
# replacement (--max-restarts 1) that grows back in. "node": both ranks of node 1 die at step 20
# and nobody replaces them, so the survivors go on as one node. Either way every survivor
# recovers (its RECOVERED line gives the time from its error to its first good step) and the job
# prints the fault-free run's final loss.
scenario_elastic() {
  local kind=${ELASTIC_KIND:-rank} steps=300 at=20 ref final kills restarts=() i
  run_job 120 COMM_TIMEOUT=30s -- "$train" --backend hierarchical --elastic --steps "$steps"
  jobs_ok
  ref=$(logs_grep -h "final loss " | sed -E 's/.*final loss //')
  [[ -n $ref ]] || fail "the fault-free run printed no final loss"
  rm -f "$work"/node*.log
  if [[ $kind == rank ]]; then
    kills="$((2 * per_node - 1)):$at"
    restarts=(--max-restarts 1)
  else
    kills="$per_node:$at"
    for ((i = per_node + 1; i < 2 * per_node; i++)); do kills+=",$i:$at"; done
  fi
  run_job 120 COMM_TIMEOUT=30s -- "${restarts[@]}" "$train" --backend hierarchical --elastic --steps "$steps" --kill "$kills"
  final=$(logs_grep -h "final loss " | sed -E 's/.*final loss //')
  [[ -n $final ]] || fail "the run with faults printed no final loss"
  awk -v a="$final" -v b="$ref" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 1e-5 * (b < 0 ? -b : b)) }' ||
    fail "final loss $final differs from the fault-free run's $ref"
  ((job_rc[0] == 0)) || fail "node 0's comm-run exited ${job_rc[0]}"
  local recovered worst
  recovered=$(logs_grep -c "RECOVERED " | awk '{ s += $1 } END { print s + 0 }')
  worst=$(logs_grep -h "RECOVERED " | sed -E 's/.* ms=([0-9.]+).*/\1/' | sort -n | tail -1)
  if [[ $kind == rank ]]; then
    jobs_ok  # the replacement finished the job on node 1
    ((recovered == 2 * per_node - 1)) || fail "$recovered survivors recovered, want $((2 * per_node - 1))"
    expect_line "grew from $((2 * per_node - 1)) to $((2 * per_node)) rank(s)"
  else
    ((job_rc[1] != 0)) || fail "node 1's comm-run exited 0 though its ranks were killed"
    ((recovered == per_node)) || fail "$recovered survivors recovered, want $per_node"
  fi
  say "elastic ($kind lost at step $at): final loss $final = fault-free $ref; $recovered survivors recovered, slowest ${worst} ms after its error"
}

"scenario_$scenario"

