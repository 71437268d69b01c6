"""Renders docs/benchmarks.md from the outputs of scripts/bench (criterion estimates, BENCH lines);
with the argument `accuracy`, docs/accuracy.md from the accuracy bench's."""
import datetime
import json
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def machine():
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    rustc = subprocess.run(["rustc", "--version"], capture_output=True, text=True).stdout.strip()
    return f"{os.cpu_count()} cores ({cpu}), {platform.system()} {platform.release()}, {rustc}"


def criterion_means():
    base = os.path.join(ROOT, "target", "criterion")
    means = {}
    if not os.path.isdir(base):
        return means
    for name in sorted(os.listdir(base)):
        path = os.path.join(base, name, "new", "estimates.json")
        bench = os.path.join(base, name, "new", "benchmark.json")
        if os.path.exists(path) and os.path.exists(bench):
            with open(path) as f, open(bench) as g:
                title = json.load(g).get("title", name)
                means[title] = json.load(f)["mean"]["point_estimate"]
    return means


def table_header(*columns, left=None):
    """Prints a Markdown table's header row and its alignment row, one cell per column: the columns
    named in `left` (by default the first) left-aligned as text, the rest right-aligned as numbers."""
    if left is None:
        left = columns[:1]
    print("| " + " | ".join(columns) + " |")
    print("| " + " | ".join("---" if column in left else "---:" for column in columns) + " |")


def bench_lines(log):
    rows = []
    path = os.path.join(ROOT, "target", "bench", log)
    if not os.path.exists(path):
        return rows
    with open(path) as f:
        for line in f:
            if line.startswith("BENCH "):
                rows.append(json.loads(line[len("BENCH "):]))
    return rows


def number(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def targets():
    """The performance targets measured per core and per instruction: each figure beside its
    ceiling from this run, met or not, whether it holds across machines, and the command."""
    agent = [r for r in bench_lines("agent.log") if r.get("bench", "agent") == "agent"]
    opened = [r for r in bench_lines("agent.log") if r.get("bench") == "agent_open"]
    instructions = [r for r in bench_lines("peer.log") if r.get("bench") == "peer_instructions"]
    if not (agent or instructions):
        return
    agent_command = "`cargo bench -p allot-region-agent --bench agent`"

    def at_most(figure, measured, ceiling, ratio, limit, holds, command):
        """A row of a figure whose ratio to its ceiling must be at most `limit`."""
        return (figure, measured, ceiling, f"{ratio:.2f}x", f"<= {limit}x",
                "met" if ratio <= limit else "not met", holds, command)

    peer_command = "`scripts/bench-peer` (`--instructions` half)"
    rows = []

    def agent_row(path, callers=64):
        return next((r for r in agent if r.get("path") == path and r.get("callers") == callers), None)

    for path, transport, ceiling_path, limit in [
        ("lease-only", "TCP", "trivial", 1.5),
        ("lease-only uds", "UDS", "trivial uds", 1.5),
        ("lease+3-redis", "TCP", "trivial", 2.0),
        ("lease+3-redis uds", "UDS", "trivial uds", 2.0),
    ]:
        row, ceiling = agent_row(path), agent_row(ceiling_path)
        ratio = number(row.get("agentCpuXTrivial")) if row else None
        if row is None or ceiling is None or ratio is None:
            continue
        rows.append(at_most(f"`{path.replace(' uds', '')}` agent CPU per decision, {transport}, 64 callers",
                            f"{row.get('agentCpuUsPerDecision', '-')} us",
                            f"`{ceiling_path}` {ceiling.get('agentCpuUsPerDecision', '-')} us",
                            ratio, limit, "ratio: roughly; the microseconds: no", agent_command))
    rls, trivial = agent_row("grpc+3-redis"), agent_row("trivial")
    per_core = number(rls.get("decisionsPerAgentCoreSecond")) if rls else None
    trivial_per_core = number(trivial.get("decisionsPerAgentCoreSecond")) if trivial else None
    if per_core is not None:
        rows.append(("Envoy RLS `ShouldRateLimit` decisions per agent core-second (`grpc+3-redis`)",
                     f"{per_core:,.0f}", f"`trivial` {trivial_per_core:,.0f}" if trivial_per_core is not None else "-",
                     f"{rls.get('agentCpuUsPerDecision', '-')} us a decision", ">= 40,000", "met" if per_core >= 40000 else "not met",
                     "no: CPU time of this machine's cores", agent_command))
    by_path = {(r.get("rules"), r.get("path")): r for r in instructions}
    for rules, path, limit, label in [
        (1, "allot", 0.8, "sent alone"),
        (3, "allot", 0.7, "sent alone"),
        (1, "allot coalescing", 0.60, "coalesced"),
        (3, "allot coalescing", 0.34, "coalesced"),
    ]:
        row, peer = by_path.get((rules, path)), by_path.get((rules, "limitador"))
        ratio = number(row.get("ratioToLimitador")) if row else None
        if row is None or peer is None or ratio is None:
            continue
        rows.append(at_most(f"Redis instructions per decision, {rules} rule{'s' if rules > 1 else ''}, {label}, 32 callers",
                            f"{row['redisInstructionsPerDecision']:,.0f}",
                            f"Limitador {peer['redisInstructionsPerDecision']:,.0f}",
                            ratio, limit, "yes: instructions, for the same Redis build", peer_command))
    for fraction in (0.5, 0.8):
        row = next((r for r in opened if number(r.get("fraction")) == fraction), None)
        unavailable = number(row.get("unavailablePercent")) if row else None
        if unavailable is None:
            continue
        rows.append((f"LIMITER_UNAVAILABLE open loop at {fraction}x of the closed-loop peak (`lease+3-redis`)",
                     f"{row['unavailablePercent']} %", f"the generator sent {row.get('lateSendPercent', '-')} % late (up to {row.get('maxLateMs', '-')} ms)",
                     "-", "0 %", "met" if unavailable == 0 else "not met",
                     "no: it moves with what shares the cores", agent_command))
    if not rows:
        return
    print("## Targets: CPU per decision and instructions per decision")
    print()
    print("Each target of the agent's and the store's cost per decision, from this run, beside the ceiling")
    print("measured with it. Which figures hold on another machine: instructions Redis executes per")
    print("decision (counted under callgrind) repeat exactly for the same Redis build and inputs, whatever")
    print("else the machine runs; CPU time per decision is this machine's (its cores, its kernel, what")
    print("shares them), so its ratio to a ceiling measured in the same run travels better than its")
    print("microseconds, and throughput and open-loop refusals depend on the cores the processes share. The")
    print("decision of each algorithm is written once in `decide.lua` (`--@inline` steps, expanded where")
    print("they are called; `scripts/decide-instructions` counts the library the store loads).")
    print()
    table_header("figure", "measured", "ceiling", "ratio", "target", "met", "holds across machines", "command",
                 left=("figure", "ceiling", "met", "holds across machines", "command"))
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")
    print()


def main():
    print("# Benchmarks")
    print()
    print("Reproduce with `scripts/bench` (rewrites this file). Benchmarks are not tests: nothing in the")
    print("test suite asserts a timing. Every figure stands beside a ceiling measured in the same run.")
    print("How often the decisions differ from an ideal global limiter's, through real agents, is on its")
    print("own page: [accuracy.md](accuracy.md).")
    print()
    print(f"Last run: {datetime.date.today().isoformat()} on {machine()}.")
    print()
    targets()
    means = criterion_means()
    if means:
        print("## Decision core (`allot-shared`, criterion)")
        print()
        ceiling = means.get("ceiling: copy the state")
        table_header("decision", "ns per decision", "x ceiling")
        for title, ns in means.items():
            ratio = f"{ns / ceiling:.1f}" if ceiling else "-"
            print(f"| {title} | {ns:.1f} | {ratio} |")
        print()
        print("The ceiling is reading a stored state and returning it: the floor any decision pays.")
        print()
    grants = bench_lines("grants.log")
    if grants:
        print("## Allocator grants against raw etcd transaction loops")
        print()
        print(f"Run {datetime.date.today().isoformat()} on {machine()}.")
        print("One etcd member (started by the bench), grants of 1 token from pools that never run out,")
        print("4 s per figure. Three raw loops with the same keys and client count, in the same run:")
        print("`blind` is one unconditional single-put transaction per operation (etcd's ceiling);")
        print("`shaped` is the etcd work of one committed grant without the allocator: one transaction")
        print("that requires a new record key to be absent and puts the window key and the record;")
        print("`CAS` reads the key and compares-and-puts it, as a naive allocator would per grant.")
        print("`x` columns are allocator grants/s divided by that loop's transactions/s. `per pool` is the")
        print("limit on one pool's grants per commit (1 = no per-pool batching); commits of different pools")
        print("are merged into one transaction by the committer in both cases. `pools`: `warm` when every")
        print("pool had a grant from the same grant service before the run (its worker holds the pool's")
        print("configuration and window, the steady state), `cold` when none had (each pool's first grant")
        print("reads them from etcd, as after a failover: the loads of cold pools waiting at the same moment")
        print("are merged into one etcd read, as commits are). `p50`/`p99`: each grant's latency through the")
        print("grant service.")
        print()
        print("What to look for: on one hot pool, per-pool group commit is what keeps throughput far above")
        print("a compare-and-put loop (whose transactions mostly conflict); on many pools, merging pool")
        print("commits into shared transactions is what takes the allocator past the blind single-put")
        print("ceiling (the targets: at least 0.8 of it at 64 clients on 10,000 cold pools, and 1.0 on")
        print("100,000 warm ones).")
        print()
        setup = [r for r in grants if r.get("bench") == "allocator_pools" and "createSeconds" in r]
        memory = [r for r in grants if r.get("bench") == "allocator_pools" and "residentBytesPerWarmPool" in r]
        for r in setup:
            per_pool = (r["etcdDbInUseBytes"] - r["etcdDbEmptyBytes"]) / max(r["pools"], 1)
            print(f"The bench creates its {r['pools']:,} pools through the bulk path (`put_pools`, 128 a transaction) in "
                  f"{r['createSeconds']:.1f} s ({r['pools'] / max(r['createSeconds'], 1e-9):,.0f} pools/s); etcd's database holds "
                  f"{r['etcdDbInUseBytes'] / 2**20:.1f} MiB in use with them ({per_pool:,.0f} B a pool, its configuration and its history).")
        for r in memory:
            print(f"The allocator's resident memory grows {r['residentBytesPerWarmPool']:,} B per warm pool "
                  f"(per-pool batch {r['maxBatch']}: its worker task, queue and cached configuration and window; "
                  f"{r['residentBytesPerWarmPool'] * r['pools'] / 2**20:,.0f} MiB at {r['pools']:,} pools).")
        if setup or memory:
            print()
        table_header("shape", "pools", "clients", "per pool", "grants/s", "p50 ms", "p99 ms", "blind txn/s", "x blind", "shaped txn/s", "x shaped", "CAS txn/s", "x CAS", "CAS conflicts", left=("shape", "pools"))
        for r in [r for r in grants if r.get("bench", "allocator_grants") == "allocator_grants"]:
            print(f"| {r['shape']} | {r.get('pools', 'cold')} | {r['clients']} | {r['maxBatch']} | {r['grantsPerSecond']:.0f} | "
                  f"{r.get('p50Ms', float('nan')):.2f} | {r.get('p99Ms', float('nan')):.2f} | "
                  f"{r['blindTxnPerSecond']:.0f} | {r['ratioToBlind']:.2f} | "
                  f"{r['shapedTxnPerSecond']:.0f} | {r['ratioToShaped']:.2f} | {r['casTxnPerSecond']:.0f} | "
                  f"{r['ratioToCas']:.2f} | {r['casConflictShare']:.0f}% |")
        print()
    limiter_all = bench_lines("limiter.log")
    limiter = [r for r in limiter_all if r.get("bench") == "limiter"]
    principals = [r for r in limiter_all if r.get("bench") == "limiter_principals"]
    if limiter:
        print("## Regional limiter: client path against raw FCALL")
        print()
        print("One Redis (started by the bench), a 3-rule batch (the same function and arguments on both")
        print("paths). `raw` calls FCALL with the redis crate, one call per decision; `client` goes through")
        print("`Limiter::decide` with the defaults (deadline, breaker, adaptive in-flight bound, negative")
        print("cache, fail modes) but coalescing off, so both paths make one call per decision. Rounds of")
        print("the two paths alternate within the run;")
        print("`ratio` is the row's decisions/s over raw's at the same callers (the target is at least 0.9).")
        print()
        table_header("callers", "path", "decisions/s", "p50 us", "p99 us", "ratio", "degraded", left=("path",))
        for r in limiter:
            print(f"| {r['callers']} | {r['path']} | {r['decisionsPerSecond']:.0f} | {r['p50Us']} | "
                  f"{r['p99Us']} | {r['ratio']:.2f} | {r.get('degraded', 0)} |")
        print()
        for r in limiter:
            if r.get('degraded', 0) > 0:
                print(f"In this run the client path at {r['callers']} callers degraded {r['degraded']} decisions: the")
                print("store did not decide them (an overrun of the 10 ms budget, a wait for a place in flight in")
                print("vain, or a shed), so that row's ratio is not a like-for-like figure; see the overload section.")
                print()

    hot = [r for r in limiter_all if r.get("bench") == "limiter_hot_tenant"]
    if hot:
        print("## A hot tenant: coalescing")
        print()
        print("64 callers, each one user of one tenant; every request is the user's token bucket and the")
        print("tenant's (one key all callers share), through the client path of stores on the same Redis in")
        print("alternating rounds: one that sends every decision alone (`off`, `--coalesce-hot-keys false`)")
        print("and ones that coalesce (the default: decisions of a slot that arrive while its calls are in")
        print("flight go together in the next call) with 1 (the default), 2 and 3 calls of a slot in flight at")
        print("once, all with a patient decision budget (250 ms) so that the store decides every one")
        print("(`degraded` counts those it did not). Redis CPU from `INFO cpu`, per decision the store made;")
        print("`x off` is that over the uncoalesced store's (the target is at most 0.5, with p99 no worse);")
        print("`coalesced` counts decisions sent in coalesced calls, `per call` how many a coalesced call")
        print("carried on average (the batch a call's fixed cost is spread over), `alone %` the share of")
        print("the measured decisions that went alone (a call of their slot free, nothing waiting). Reproduce with")
        print("`cargo bench -p allot-region-agent --bench limiter` (`ALLOT_BENCH_HOT_TENANT_ONLY=1`: this")
        print("section alone).")
        print()
        table_header("coalescing", "calls in flight", "decisions/s", "p50 us", "p99 us", "Redis CPU us/decision", "x off", "coalesced decisions", "per call", "alone %", "degraded")
        for r in hot:
            in_flight = r.get("callsInFlight", 0) or "-"
            print(f"| {r['coalescing']} | {in_flight} | {r['decisionsPerSecond']:.0f} | {r['p50Us']} | {r['p99Us']} | "
                  f"{r['redisCpuUsPerDecision']} | {r['ratioToOff']:.2f} | {r['coalescedDecisions']} | "
                  f"{r.get('decisionsPerCall', '-')} | {r.get('alonePercent', '-')} | {r.get('degraded', 0)} |")
        print()

    overload = [r for r in limiter_all if r.get("bench") == "limiter_overload"]
    if overload:
        print("## Overload: shedding early instead of timing out late")
        print()
        print("Through the client path, on the 3-rule batch and on a 4-rule one (three sliding counters: a store")
        print("that saturates sooner). The peak is the goodput (decisions the store made,")
        print("per second) of 64 callers in a closed loop with the defaults; then decisions arrive open-loop")
        print("(one task each, whatever the answers) at 0.5x, 1x and 2x that peak for 3 s (after 0.5 s in")
        print("which the in-flight bound settles), with the defaults (adaptive bound of at least 64, 4 ms wait, shedding),")
        print("and at 2x with a fixed bound of 128 and a 1 ms wait (the earlier defaults). `x peak` is the")
        print("goodput over the peak (the target under 2x is at least 0.9); latencies are of the decisions")
        print("the store made, from arrival (the target: p99 within the 10 ms budget); `shed` were refused at")
        print("once, `waited` waited for a place in vain, `overran` missed the budget after being sent;")
        print("`breaker` counts openings, `limit` is the bound at the end; on a closed-loop row `unavailable %`")
        print("is the share of its answers that were degraded (one returns at once, so a spell of them counts")
        print("many). Everything shares the 2 cores. Reproduce with `cargo bench -p allot-region-agent --bench")
        print("limiter` (`ALLOT_BENCH_OVERLOAD_ONLY=1`: this section alone).")
        print()
        table_header("rules", "config", "offered", "offered/s", "goodput/s", "x peak", "p50 us", "p99 us", "shed %", "waited %", "unavailable %", "overran", "breaker", "limit", left=("config", "offered"))
        for r in overload:
            print(f"| {r.get('rules', 3)} | {r['config']} | {r['offered']} | {format(r['offeredPerSecond'], '.0f') if 'offeredPerSecond' in r else '-'} | "
                  f"{r['goodputPerSecond']:.0f} | {r['ratioToPeak']:.2f} | {r['p50Us']} | {r['p99Us']} | "
                  f"{r.get('shedPercent', '-')} | {r.get('waitedOutPercent', '-')} | "
                  f"{r.get('unavailablePercent', r.get('degradedPercent', '-'))} | {r.get('overran', '-')} | "
                  f"{r.get('breakerOpened', '-')} | {r['limit']} |")
        print()

    if principals:
        print("## How cost grows with active principals")
        print()
        print("The same 3-rule batch and 64 callers, the decisions spread over 10, 1,000 and 100,000 users")
        print("(every user's keys written before the rounds; each request planned on the spot, as the agent")
        print("does, on both paths). `Redis B/user` is Redis `used_memory` growth per user after writing")
        print("every user's keys once (the user rule's key; route and tenant keys are shared). What the agent")
        print("keeps per principal (negative cache, cardinality tracking) is capped (I10).")
        print()
        table_header("principals", "path", "decisions/s", "p50 us", "p99 us", "x raw", "Redis bytes per principal", left=("path",))
        for r in principals:
            print(f"| {r['principals']} | {r['path']} | {r['decisionsPerSecond']:.0f} | {r['p50Us']} | "
                  f"{r['p99Us']} | {r['ratio']:.2f} | {r['redisBytesPerPrincipal']} |")
        print()

    agent = [r for r in bench_lines("agent.log") if r.get("bench", "agent") == "agent"]
    if agent:
        print("## Region agent: admissions over HTTP")
        print()
        print("Keep-alive HTTP callers in a load-generator process of their own (the bench binary started")
        print("again; they still share the 2 cores with the agent, so figures move by tens of percent")
        print("between runs). The callers are hyper client connections without a pool, opened before the")
        print("timed run, the cheapest caller of the field: the generator takes what the agent and Redis do")
        print("not, so the less it takes a request, the more a row measures the agent. `trivial` is an axum endpoint that takes the")
        print("very request an admit is (POST, bearer token, JSON body) and answers a constant JSON body: the")
        print("HTTP stack's ceiling for this request. `raw-evalsha` sends the 3-rule decision straight to Redis,")
        print("one FCALL per decision (the store's ceiling). `lease-only` is a policy with one global rule (tokens from leases in")
        print("memory), compared with `trivial` (target at least 0.8); `lease+3-redis` adds three regional")
        print("rules in one script call, compared with `raw-evalsha` (target at least 0.9). The allocator is a")
        print("stub granting chunks of 1,000 (one renewal of a pool is in flight at a time, so an agent admits")
        print("at most about a chunk per grant round trip: the reference design's 100 last 3 ms at this bench's")
        print("rate, less than a renewal takes on a loaded 2-core machine); renewals are prefetched off the")
        print("request path. `grpc+3-redis` is the")
        print("same decision through Envoy's rate limit service (tonic), its callers over 4 HTTP/2 connections")
        print("as an Envoy with 4 worker threads holds them (one per worker, its calls multiplexed; until")
        print("2026-12-06 this bench opened one connection per caller, which cost the agent a socket read and")
        print("write per call: 24,727 decisions per agent core-second then). The Redis agent coalesces, as agents")
        print("do by default: a tenant's decisions that arrive while its call is in flight share its next call")
        print("(every caller's route and tenant keys are shared); `lease+3-redis alone` is the same path")
        print("through an agent that sends every decision in a call of its own (`--coalesce-hot-keys false`).")
        print("With one caller, requests are")
        print("sequential: an admit pays the HTTP hop and the Redis hop one after the other, so its ratio to a")
        print("lone Redis round trip is bounded near 0.6 whatever the agent does; the targets are throughput")
        print("targets, read at 64 callers. The agent and the allocator binaries (and this bench) use mimalloc.")
        print("`unavailable %`: answers LIMITER_UNAVAILABLE under the bench's fail-closed rules, decisions the")
        print("store did not make within the 10 ms budget (an overrun, a wait for a place in flight in vain, or")
        print("a shed; the load generator shares the 2 cores). The agents run with the limiter's defaults. The agents")
        print("(and `trivial`) run on a runtime of their own, one worker thread, with the Redis agent's store")
        print("connection (as in the agent: the task that writes calls and reads replies is the agent's work):")
        print("`agent us/decision` is that")
        print("thread's CPU (user + system) per decision, steadier than throughput on a shared machine, and")
        print("`per agent core` the decisions one core of such CPU decides per second (`grpc+3-redis`: Envoy RLS")
        print("`ShouldRateLimit` decisions per second per agent core). `load us/decision` is the load")
        print("generator's process CPU per decision and `Redis us/decision` Redis's (`INFO cpu`), both over")
        print("the same timed run. Each figure is three 1 s slices, taken round-robin with the table's other")
        print("figures (a slice of each, three times over): a machine that slows down or speeds up during the")
        print("bench then moves every figure alike, and a ratio compares like with like. Reproduce with")
        print("`cargo bench -p allot-region-agent --bench agent`.")
        print()
        print("The `uds` rows are the same endpoints and agents over a Unix domain socket, as a gateway on the")
        print("agent's host would call them (`--listen unix:/path`): no loopback TCP. `CPU x trivial` is a")
        print("row's agent CPU per decision over the `trivial` endpoint's on the same transport (the targets:")
        print("`lease-only` at most 1.5, `lease+3-redis` at most 2).")
        print()
        print("Where that CPU goes (`perf record --call-graph dwarf` on this bench, the agent's thread, 2026-12-02):")
        print("about a third in the kernel, and on loopback a sender's write also runs the receiving socket's")
        print("TCP input in the sender's thread, so part of it is the callers' receive path; over half, counted")
        print("inclusively, under hyper (HTTP/1 parsing, encoding and the socket writes); the admission pipeline")
        print("about a sixth, of which the limiter's client path 12 % and the Redis codec 9 %; allocation 9 %,")
        print("serde_json 3 %, metrics and tracing under 1 % each. The agent's own logic is not where the")
        print("ratio is lost. One cost was the request timeout itself: a tokio timer per request, whose")
        print("registration woke the runtime's timer driver with an eventfd write on nearly every decision")
        print("(`perf stat -e syscalls:sys_enter_write` on the bench process: 443,723 writes in a run before,")
        print("95,952 after). Request deadlines now compare against one coarse tick per server")
        print("(`net/src/deadline.rs`).")
        print()
        table_header("path", "callers", "decisions/s", "p50 us", "p99 us", "x ceiling", "unavailable %", "agent us/decision", "CPU x trivial", "per agent core", "load us/decision", "Redis us/decision")
        calls = []
        for r in agent:
            print(f"| {r['path']} | {r['callers']} | {r['admitsPerSecond']:.0f} | {r['p50Us']} | "
                  f"{r['p99Us']} | {r['ratio']:.2f} | {r.get('unavailablePercent', 0)} | "
                  f"{r.get('agentCpuUsPerDecision', '-')} | {r.get('agentCpuXTrivial', '-')} | {r.get('decisionsPerAgentCoreSecond', '-')} | "
                  f"{r.get('loadCpuUsPerDecision', '-')} | {r.get('redisCpuUsPerDecision', '-')} |")
            if r['callers'] not in [c[0] for c in calls]:
                calls.append((r['callers'], r['allocatorCallsPer1000Admits']))
        print()
        overloaded = [r for r in agent if float(r.get('unavailablePercent', 0)) > 5]
        for r in overloaded:
            print(f"In this run `{r['path']}` at {r['callers']} callers answered {r['unavailablePercent']} % "
                  "LIMITER_UNAVAILABLE: the store did not decide them within the 10 ms budget on this machine,")
            print("so that row's throughput counts fast refusals and its ratio is not a like-for-like figure;")
            print("compare the same row of a run at 0 % (git history of this file).")
            print()
        for r in [r for r in agent if float(r.get('depletedPercent', 0)) > 0]:
            print(f"In this run `{r['path']}` at {r['callers']} callers had {r['depletedPercent']} % of its admits "
                  "denied by the global rule while its lease was being renewed (the stand-in allocator always")
            print("has tokens: the operations guide's `AllotRegionDepletedWhilePoolHadTokens`).")
            print()
        for r in [r for r in bench_lines("agent.log") if r.get("bench") == "agent_limiter"]:
            print(f"The Redis agent's limiter at {r['callers']} caller(s), both of its paths: {r['decisions']} decisions, "
                  f"{r['unavailable']} LIMITER_UNAVAILABLE ({r['shed']} shed at once, {r['waitedOut']} waited for a "
                  f"place in vain, {r['breakerRefusals']} refused by an open breaker), {r['slowCalls']} overruns of a "
                  f"slow shard, {r.get('heldUp', '-')} waits and calls run out while the agent was held up, "
                  f"{r.get('breakerFailures', '-')} calls counted against a breaker.", end="")
            if r.get("coalescedCalls"):
                per_call = r["coalescedDecisions"] / r["coalescedCalls"]
                print(f" {r['coalescedDecisions']} decisions went in {r['coalescedCalls']} coalesced calls "
                      f"({per_call:.1f} a call).", end="")
            print()
            print()
        for callers, per_1000 in calls:
            print(f"Allocator calls per 1,000 admits over the agent paths at {callers} "
                  f"caller(s): {per_1000} (target at most 20).")
        print()
        budget = [r for r in bench_lines("agent.log") if r.get("bench") == "agent_cpu"]
        if budget:
            cores = budget[0]["cores"]
            print("### What a target costs this machine")
            print()
            print("Per path at 64 callers, the CPU one decision takes in each of the three processes, from the")
            print("rows above, and the cores the path needs to decide at its target: `lease-only` at 0.8 of")
            print("`trivial`, `lease+3-redis` at 0.9 of `raw-evalsha`, each ceiling at its own rate. A path that")
            print(f"needs more than the machine's {cores} cores cannot reach its target here, however the work is")
            print("scheduled: the figure to move it is the agent's CPU per decision (or a machine where the load")
            print("generator and Redis do not share the agent's cores).")
            print()
            table_header("path", "target decisions/s", "load us", "agent us", "Redis us", "total us", "cores needed")
            for r in budget:
                print(f"| {r['path']} | {r['targetPerSecond']:.0f} | {r['loadCpuUsPerDecision']} | "
                      f"{r['agentCpuUsPerDecision']} | {r['redisCpuUsPerDecision']} | "
                      f"{r['totalCpuUsPerDecision']} | {r['coresNeeded']:.2f} |")
            print()
        opened = [r for r in bench_lines("agent.log") if r.get("bench") == "agent_open"]
        if opened:
            print("### Below capacity: open loop")
            print()
            print("64 closed-loop callers are at capacity by construction: by Little's law their mean wait is 64")
            print("over the throughput, past the 10 ms budget whenever fewer than 6,400 decisions a second are")
            print("made, so the closed-loop rows' `unavailable %` measures this machine's capacity. Below it,")
            print("`lease+3-redis` is offered open loop, evenly spaced, at a fraction of what it decided closed")
            print("loop at 64 callers (fast refusals left out), from up to 256 connections (`unsent`: due while")
            print("all were busy). These rows run as on hosts of their own: the agent's thread has a core to")
            print("itself (`taskset`), and Redis, the load generator (at niceness 10, below Redis) and the rest")
            print("of the bench process share the other. Three processes on two cores otherwise take turns, and")
            print("a burst the agent decides in time waits for a core instead: a figure of the machine, not of")
            print("the agent (the closed-loop rows above share both cores). The target is 0 %")
            print("LIMITER_UNAVAILABLE below capacity. The three fractions are measured round-robin too (three")
            print("1 s slices each). `lease ran dry %` counts admits the global rule denied although the stand-in")
            print("allocator always has tokens: the agent's lease ran out while its renewal was on the way")
            print("(the operations guide's `AllotRegionDepletedWhilePoolHadTokens`). Of the limiter's refusals,")
            print("`shed` were refused at once, `waited in vain` waited for a place among the calls in flight,")
            print("`overran` counts calls that ran past their deadline while the shard answered others, and")
            print("`agent held up` the waits and calls among these that ran out while the agent's own thread was")
            print("held up (the timer that ended them fired at least half its span late).")
            print()
            print("Two columns say how far a row is from that picture. `machine busy %` is the whole machine's CPU")
            print("(`/proc/stat`, every core and process) over the run: offered open loop, the agent spends more")
            print("CPU on each decision than at 64 closed-loop callers (`agent us/decision` here against the")
            print("closed-loop row's), so a fraction of the closed-loop peak is a larger fraction of the machine.")
            print("`sent late %` counts the requests the generator sent")
            print("more than 2 ms after they were due, and `latest send ms` the worst: a generator that waits for a")
            print("core sends what fell due meanwhile at once, a burst rather than the even spacing offered, and")
            print("a burst of more decisions than the agent decides within the budget is answered unavailable.")
            print()
            stalls = [r for r in bench_lines("agent.log") if r.get("bench") == "agent_core_stalls"]
            for r in stalls:
                print(f"Before these rows, a thread spinning alone on the agent's core for {r['probeSeconds']:.0f} s saw it")
                print(f"stall (a gap of {r['stallAtLeastMs']} ms or more between two clock reads: the core given to the")
                print(f"hypervisor's other guests or the kernel) {r['stallsPerSecond']} times a second, the longest")
                print(f"{r['longestMs']} ms. A stall of the agent's core holds up every decision in flight on it.")
                print()
            table_header("offered", "x peak", "decided/s", "p50 us", "p99 us", "unavailable %", "lease ran dry %", "shed", "waited in vain", "overran", "agent held up", "breaker", "breaker failures", "unsent", "agent us/decision", "machine busy %", "sent late %", "latest send ms", left=())
            for r in opened:
                print(f"| {r['offeredPerSecond']:.0f} | {r['fraction']} | {r['decidedPerSecond']:.0f} | {r['p50Us']} | "
                      f"{r['p99Us']} | {r['unavailablePercent']} | {r.get('depletedPercent', '-')} | {r['shed']} | {r['waitedOut']} | "
                      f"{r.get('overran', '-')} | {r.get('heldUp', '-')} | {r['breakerRefusals']} | {r.get('breakerFailures', '-')} | {r['unsent']} | {r['agentCpuUsPerDecision']} | "
                      f"{r.get('machineBusyPercent', '-')} | {r.get('lateSendPercent', '-')} | {r.get('maxLateMs', '-')} |")
            print()

    router = bench_lines("router.log")
    if router:
        print("### The agent's router in process")
        print()
        print("An admit through the agent's HTTP router called in process (`tower::ServiceExt::oneshot`, no")
        print("sockets), beside a bare axum route taking the same request and answering a constant body: what")
        print("the agent's bounds (body limit, concurrency limit, deadline, problem+json), parsing, deciding")
        print("(`lease-only`) and encoding add to the framework's own work. Each figure is the mean of 50,000")
        print("requests over three rounds. Reproduce with `cargo bench -p allot-region-agent --bench router`.")
        print()
        table_header("route", "ns/request", "x trivial")
        for r in router:
            print(f"| {r['route']} | {r['nsPerRequest']:.0f} | {r['xTrivial']:.2f} |")
        print()

    rlqs = bench_lines("rlqs.log")
    if rlqs:
        print("## Gateways deciding locally (RLQS) beside one call per request (RLS)")
        print()
        print("The same agent, policy (one global pool, three regional rules on Redis) and Redis. `rls`: 64")
        print("tonic callers over 4 HTTP/2 connections (an Envoy's 4 workers), one `ShouldRateLimit` per")
        print("decision. `rlqs same load`: 8 reference gateways (one")
        print("stream each) deciding at the rate `rls` reached, spread over 100 users: every decision is")
        print("local, against the token-bucket assignments the agent pushes; the agent only takes usage")
        print("reports (one a second per gateway) and carves assignments (one Redis call each for the")
        print("regional rules). `rlqs flat out`: the same gateways as fast as they go. `local bucket`: one")
        print("enforced bucket deciding in a loop (a local decision's floor). The agent runs on threads of its")
        print("own; `agent us/1000` is their CPU (user + system) per 1,000 decisions, `x rls` beside it the")
        print("ratio to the RLS path's; Redis CPU from `INFO cpu`; `agent calls/1000` counts calls (RLS) or")
        print("report messages (RLQS). `admitted %` differs by design: an RLQS gateway holds an assignment")
        print("sized by its demand and denies what exceeds it until the next one (a bucket's first")
        print("assignment is sized on its first request and replaced within about a second; the run")
        print("includes that); `unavailable %` is RLS calls answered UNAVAILABLE because a Redis call ran")
        print("past the 10 ms decision budget (the load generators share the 2 cores). The stand-in")
        print("allocator grants chunks of 100,000 here, so one assignment can carry a gateway's demand.")
        print("Reproduce this section alone with `cargo bench -p allot-region-agent --bench rlqs`.")
        print()
        table_header("path", "decisions/s", "x rls", "admitted %", "unavailable %", "agent CPU us/1000", "x rls", "Redis CPU us/1000", "agent calls/1000")
        for r in rlqs:
            print(f"| {r['path']} | {r['decisionsPerSecond']:.0f} | {r['xRls']:.2f} | {r['admittedPercent']} | "
                  f"{r.get('unavailablePercent', 0)} | {r['agentCpuUsPer1000']:.0f} | {r['agentCpuXRls']:.3f} | "
                  f"{r['redisCpuUsPer1000']:.0f} | {r['agentCallsPer1000']} |")
        print()
        by_path = {r['path']: r for r in rlqs}
        if 'rls' in by_path and 'rlqs same load' in by_path:
            rls, same = by_path['rls'], by_path['rlqs same load']
            redis_ratio = same['redisCpuUsPer1000'] / max(rls['redisCpuUsPer1000'], 1)
            print(f"At the same load the agent spends {same['agentCpuXRls'] * 100:.1f} % of the CPU per decision the")
            print(f"RLS path costs it, and Redis {redis_ratio * 100:.1f} %; the gateways decide with no call at all, up to")
            print(f"{by_path.get('rlqs flat out', same)['decisionsPerSecond']:.0f} decisions/s on the bench's 8 gateways.")
            print()

    console = bench_lines("console.log")
    if console:
        print("## The operator console's pool list at 100,000 pools")
        print()
        print(f"Run {datetime.date.today().isoformat()} on {machine()}.")
        print("The allocator in the bench's process (embedded store, SQLite ledger) at 100 pools and at")
        print("100,000, called over loopback HTTP one request at a time, 30 rounds each. A console page reads")
        print("one page of the API's list after a cursor, then the ledger's current window of its 50 pools,")
        print("and renders. The ceiling is the API's own page read (`GET /v1/pools?limit=50`) at the same")
        print("size: `x api` is its median over the row's. `x at 100` is the row's median over the same row's")
        print("at 100 pools: a page should cost the same however many pools there are. The API's whole list")
        print("is timed too, for what paging saves. Reproduce with `cargo bench -p allot-allocator --bench console`.")
        print()
        table_header("path", "pools", "p50 ms", "p99 ms", "x api", "x at 100", left=("path",))
        for r in console:
            print(f"| {r['path']} | {r['pools']:,} | {r['p50Ms']:.1f} | {r['p99Ms']:.1f} | {r['xApi']:.2f} | {r.get('xAtSmallest', 1.0):.2f} |")
        print()

    ledger = bench_lines("ledger_size.log")
    if ledger:
        first = ledger[0]
        print("## The ledger's size over 30 days")
        print()
        print(f"Run {datetime.date.today().isoformat()} on {machine()}.")
        print(f"{first['pools']:,} pools in {first['regions']} regions with daily windows, {first['days']} simulated days: each day")
        print("a lease a region and its final report, the leader's check of every pool's closed window, and")
        print("with retention on (raw rows 7 days, rolled-up windows 400) the leader's retention rounds until")
        print("nothing is left to do (on PostgreSQL each day ends with a VACUUM, as autovacuum would run).")
        print("Written through the ledger's own calls. `in use`: the tables and their")
        print("indexes (SQLite: their pages; PostgreSQL: their relations, after VACUUM); `on disk`: the file")
        print("or database, free pages included. Per row, from the first day: a grant, a report with its")
        print("lease's spend row, a window check, and a rolled-up window (one row a region). The sizing table")
        print("in [operations](operations.md#sizing) multiplies these out. Reproduce with")
        print("`LEDGER_POOLS=1000 LEDGER_DAYS=30 ALLOT_BENCH_POSTGRES_URL=postgres://... cargo bench -p allot-allocator --bench ledger_size`.")
        print()
        table_header("backend", "retention", "in use MiB", "on disk MiB", "grant B", "report B", "check B", "rolled-up window B", "rows", left=("backend", "retention"))
        for r in ledger:
            rows = sum(r["rows"].values())
            rolled = f"{r['rolledUpWindowBytes']:.0f}" if r["retention"] else "-"
            print(f"| {r['backend']} | {'on' if r['retention'] else 'off'} | {r['inUseBytes'] / 2**20:.1f} | "
                  f"{r['onDiskBytes'] / 2**20:.1f} | {r['grantBytes']:.0f} | {r['reportBytes']:.0f} | "
                  f"{r['checkBytes']:.0f} | {rolled} | {rows:,} |")
        print()

    held = bench_lines("pools_memory.log")
    if held:
        print("## The agent's memory per pool")
        print()
        print(f"Run {datetime.date.today().isoformat()} on {machine()}.")
        print("An agent (lease-only policy, in-process limiter, `--max-pools` 200,000) admits one request for")
        print("each new tenant's pool, 64 at a time, until it holds 1,000, then 10,000, then 100,000 pools,")
        print("each with its first lease; its process's resident memory is read after each step (the")
        print("stand-in allocator runs in the same process), then its journal (what `--state-dir` keeps,")
        print("rewritten up to 4 times a second while anything changes) is written once. Reproduce with")
        print("`cargo bench -p allot-region-agent --bench pools_memory`.")
        print()
        table_header("pools held", "resident MiB", "B per pool added", "journal MiB", "journal write ms")
        for r in held:
            journal = f"{r['journalBytes'] / 2**20:.1f}" if "journalBytes" in r else "-"
            write = f"{r['journalWriteMs']:.0f}" if "journalWriteMs" in r else "-"
            print(f"| {r['pools']:,} | {r['residentBytes'] / 2**20:.1f} | {r['residentBytesPerPoolAdded']:,} | {journal} | {write} |")
        print()

    peer_all = bench_lines("peer.log")
    peer = [r for r in peer_all if r.get("bench") == "peer"]
    instructions = [r for r in peer_all if r.get("bench") == "peer_instructions"]
    if peer:
        print("## A peer: Kuadrant's Limitador on the same Redis")
        print()
        print("`bench/peer` (run by `scripts/bench-peer`): one Redis started by the bench, 1 and 32 concurrent")
        print("callers, each caller one user, two shapes: `1` rule (per user, N requests per 60 s window, N never")
        print("reached) and `3` rules (the same per user, per route and per tenant: every caller shares the")
        print("route's and the tenant's counters). `raw FCALL` calls Allot's decision function straight through")
        print("the redis crate (the store's ceiling); `allot` is the regional limiter's client path")
        print("(`Limiter::decide`) with those limits as `fixed_window` rules, each decision in a call of its own")
        print("(`--coalesce-hot-keys false`), and `allot coalescing` the same as agents run it by default, a")
        print("tenant's decisions that arrive while its call is in flight sharing its next call; `limitador` is")
        print("the `limitador` 0.14 library's `AsyncRedisStorage` through")
        print("`AsyncRateLimiter::check_rate_limited_and_update` with the same limits. Rounds of the paths")
        print("alternate in the run; `x raw` is decisions/s over raw's at the")
        print("same shape and callers; `x limitador` is Allot's Redis CPU per decision over Limitador's (the")
        print("target is at most 0.7 on the 1-rule shape at 32 callers). CPU per decision: this process (the")
        print("limiter's client side, all callers) and Redis (`INFO cpu`); commands per decision from `INFO")
        print("commandstats`. What each enforces: Limitador keeps fixed-window counters and checks them")
        print("before it updates them (two steps, not atomic together: concurrent callers can pass the check")
        print("together); Allot decides every rule of a request and writes them in one atomic call, and")
        print("offers token buckets and GCRA beside fixed windows.")
        print()
        table_header("rules", "callers", "path", "decisions/s", "p50 us", "p99 us", "x raw", "client CPU us/decision", "Redis CPU us/decision", "x limitador", "Redis commands/decision", "by command", left=("path", "by command"))
        limitador_cpu = {(r.get('rules', 1), r['callers']): r['redisCpuUsPerDecision']
                         for r in peer if r['path'] == 'limitador'}
        for r in peer:
            rules = r.get('rules', 1)
            peer_cpu = limitador_cpu.get((rules, r['callers']))
            versus = f"{r['redisCpuUsPerDecision'] / peer_cpu:.2f}" if peer_cpu else "-"
            print(f"| {rules} | {r['callers']} | {r['path']} | {r['decisionsPerSecond']:.0f} | {r['p50Us']} | "
                  f"{r['p99Us']} | {r['ratio']:.2f} | {r['clientCpuUsPerDecision']} | "
                  f"{r['redisCpuUsPerDecision']} | {versus} | {r['redisCommandsPerDecision']} | "
                  f"{r.get('redisCommandsByName', '')} |")
        print()
        print("Redis counts the commands a script or function runs inside it too: `fcall` and `evalsha` are the")
        print("round trips (Allot: one call decides and writes; Limitador: one script call to check, a second")
        print("to update), the rest what the Lua code does inside.")
        print()
    if instructions:
        print("### The same, in instructions of the Redis process")
        print()
        print("CPU time moves with whatever else a shared machine runs; instructions do not. Here Redis runs")
        print("under valgrind's callgrind, and each path makes exactly 4,000 decisions from 32 callers between")
        print("a zeroing and a dump of its counters (`allot-peer-bench --instructions`, run by")
        print("`scripts/bench-peer`); `x limitador` is the row's instructions per decision over Limitador's.")
        print("Every path's keys exist before anything is counted.")
        print()
        table_header("rules", "callers", "path", "Redis instructions per decision", "x limitador", left=("path",))
        for r in instructions:
            print(f"| {r['rules']} | {r['callers']} | {r['path']} | {r['redisInstructionsPerDecision']:.0f} | "
                  f"{r['ratioToLimitador']:.2f} |")
        print()


def accuracy():
    rows = bench_lines("accuracy.log")
    shapes = [r for r in rows if r.get("bench") == "accuracy"]
    windows = [r for r in rows if r.get("bench") == "accuracy_window"]
    print("# Accuracy against an ideal global limiter")
    print()
    print("Reproduce with `scripts/bench` (or alone: `cargo bench -p allot-tests --bench accuracy | tee")
    print("target/bench/accuracy.log`, then `python3 scripts/bench-report.py accuracy > docs/accuracy.md`;")
    print("`ALLOT_BENCH_SEED=<n>` draws another load). Not a test: nothing asserts these figures.")
    print()
    seed = shapes[0]["seed"] if shapes else "-"
    print(f"Last run: {datetime.date.today().isoformat()} on {machine()}, seed {seed}.")
    print()
    print("How often does leasing a global quota to two regions decide differently from one perfectly")
    print("informed global counter? Two regions share one pool through the shipped parts: a real allocator")
    print("on a real etcd, two region agents with the default limiter settings on their own Redis (a roomy")
    print("per-user rule keeps the regional script call on every decision), gateways calling the agents'")
    print("HTTP API. The load is open loop and skewed: each window's demand is 0.4x, 0.9x, 1.3x or 2.5x the")
    print("limit, 80 % of it at the hot region, which changes with probability 0.3 at each window; and")
    print("bursty: within a window each region's requests bunch into random tenths four times as busy as")
    print("the rest. The pool's `fallbackPerRegion` is 0 and nothing is partitioned: what is measured is")
    print("the cost of leasing itself.")
    print()
    print("- **ideal**: per window, the first `limit` requests in the order they were sent are admitted.")
    print("- **wrong**: decisions that differ from the ideal's, over all requests. A *false deny* refuses a")
    print("  request the ideal admits (its window's limit still had a token for it); a *false admit* admits")
    print("  one the ideal refuses (the ideal spent the limit on earlier requests, which the agents had")
    print("  refused). A window overshoots only where its false admits outnumber its false denies: the")
    print("  `overshoot` column. A request the agent did not answer with a decision counts as a denial")
    print("  (`failed`).")
    print("- **window error**: (admitted - ideal admitted) / limit, per window; `mean |err|` averages its size")
    print("  over the judged windows, `worst under` is the most a window fell short.")
    print("- **static split**: the usual alternative without an allocator, computed on the same requests")
    print("  (not run): each region admits up to its fixed half of the limit.")
    print()
    table_header("shape", "window", "limit", "chunk", "lease TTL", "requests", "wrong", "false admits", "false denies", "failed", "mean \\|err\\|", "worst under", "overshoot", "static: wrong", "static: mean \\|err\\|", "static: worst under")
    for r in shapes:
        print(f"| {r['shape']} | {r['windowMs']} ms | {r['limit']} | {r['chunk']} | {r['leaseTtlMs']} ms | "
              f"{r['requests']} | {r['wrongPct']:.2f} % | {r['falseAdmits']} | {r['falseDenies']} | "
              f"{r['failed']} | {r['meanAbsWindowErrorPct']:.2f} % | {r['worstWindowUnderPct']:.2f} % | "
              f"{r['maxOvershootTokens']} | {r['staticWrongPct']:.2f} % | "
              f"{r['staticMeanAbsWindowErrorPct']:.2f} % | {r['staticWorstWindowUnderPct']:.2f} % |")
    print()
    print("`overshoot` is the most any judged window admitted past the limit, in requests. Requests sent in")
    print("one window and answered in the next (the agent may have decided them in either) are judged in")
    print("neither, and the ideal does not see them: per shape, " +
          ", ".join(f"{r['shape']} {r['straddling']}" for r in shapes) + ".")
    print()
    if all("ledgerAdmitted" in r for r in shapes):
        print("The ledger's own account, once the last lease ended and the agents reported (its `admitted`")
        print("and `overshoot` columns over the shape's windows, warm-up included): " +
              "; ".join(f"{r['shape']} {r['ledgerAdmitted']} admitted (the agents answered "
                        f"{r['admittedByAgents']} admits), overshoot at most {r['ledgerMaxOvershoot']}"
                        for r in shapes) + ".")
        print()
    print("Where in its window each false deny was sent, by tenth of the window:")
    print()
    table_header("shape", *(str(tenth) for tenth in range(1, 11)))
    for r in shapes:
        tenths = r.get("falseDeniesByTenth", [])
        print(f"| {r['shape']} | " + " | ".join(str(n) for n in tenths) + " |")
    print()
    print("Why they fall where they do: no lease is spent within the expiry margin plus the regional hold")
    print("of its end (50 + 20 ms by default, against clock-rate error and a regional call finishing after")
    print("the lease), and a window-clamped lease ends with its window: the last 70 ms of every window")
    print("admit nothing, 7 % of a 1 s window and 0.1 % of a minute's. Where a window's demand passes the")
    print("limit, the region that runs out is refused while the other still holds the rest of its last")
    print("lease (stranded, at most a chunk per region, reported as such). A smaller chunk strands less")
    print("but asks the allocator more often, and a burst beyond what is held waits once for a renewal")
    print("and is refused if it is still short when that arrives (compare the two 1 s rows). At a window's")
    print("start every region asks for its first lease at once.")
    print()
    for r in shapes:
        rows = [w for w in windows if w["shape"] == r["shape"]]
        if not rows:
            continue
        print(f"### {r['shape']}: window by window")
        print()
        table_header("window", "demand eu", "demand us", "ideal", "admitted eu", "admitted us", "error", "static split", "static error", left=())
        for w in rows:
            admitted = sum(w["admitted"])
            error = 100.0 * (admitted - w["ideal"]) / w["limit"]
            static = 100.0 * (w["staticSplit"] - w["ideal"]) / w["limit"]
            print(f"| {w['window']} | {w['demand'][0]} | {w['demand'][1]} | {w['ideal']} | {w['admitted'][0]} | "
                  f"{w['admitted'][1]} | {error:+.1f} % | {w['staticSplit']} | {static:+.1f} % |")
        print()


if sys.argv[1:] == ["accuracy"]:
    accuracy()
else:
    main()
