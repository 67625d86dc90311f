"""What users get from one GPU through the servers, against the offline engine on the same run.

    python benchmarks/served_gpu.py --tokenizer TOKDIR --out served.json [--parts offline worker serve]

Workload (b) of gpu_engine.py (256 requests, prompt and output lengths U[100, 1024] tokens, EOS
ignored, seed 0) on dummy:llama-3.1-8b in bf16. Prompts are text of single-token words, so every
path (token ids offline, text over gRPC and HTTP) runs the same token ids. Each part runs the
closed loop of 256 (everything at once) and, with --poisson, Poisson arrivals at fractions of
the offline run's request rate (the same arrival times for every path):

    offline       the engine in a process of its own (LLMEngine.step), requests added at their arrival
    worker        `kvcascade worker`: gRPC straight to the worker (front end + engine core process)
    serve         `kvcascade serve`: gRPC through the router, then HTTP through the router
    split         `kvcascade worker` + `kvcascade router` as separate processes over Redis (--redis-server)

Clients are the load-test harness's (loadtest/clients.py), spread over --processes processes so
the load generator is not the limit. Per target: output tok/s over the window from the first send
to the last token, TTFT and TPOT p50/p90/p99; over gRPC also the worker's own TTFT (its arrival to its
first token: the rest of the client's is the way there and back); the cores each server process used
(CPU seconds over the window: a front end near 1.0 is saturated); with --py-spy, a py-spy record of
each server process in the closed runs. Servers start one after another (each has the GPU). split
first measures the router's overhead at low load (--overhead: one request at a time, 8 tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from contracts.ports import free_port  # noqa: E402

# The engine settings of gpu_engine.py's (b), for every path.
ENGINE = dict(model="dummy:llama-3.1-8b", device="cuda", dtype="bfloat16", max_model_len=4096,
              max_num_batched_tokens=8192, max_num_seqs=256, max_queued_requests=4096)


def server_flags(engine: dict) -> list[str]:
    return [x for k, v in engine.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def single_token_words(tokenizer) -> list[str]:
    """Words that are one token with their leading space and stay one token in any sequence of such
    words: a text of them has as many tokens as words (checked on the encoded text)."""
    vocab = []
    for word in ("time year people way day man thing woman life child world school state family student "
                 "group country problem hand part place case week company system program question work "
                 "government number night point home water room mother area money story fact month lot "
                 "right study book eye job word business issue side kind head house service friend father "
                 "power hour game line end member law car city community name president team minute idea "
                 "kid body information back parent face others level office door health person art war").split():
        ids = tokenizer.encode(" " + word, add_special_tokens=False)
        if len(ids) == 1:
            vocab.append(word)
    return vocab


def workload(tokenizer, seed: int = 0, n: int = 256, scale: float = 1.0) -> list[tuple[str, list[int], int]]:
    """(prompt text, its token ids, output tokens) per request (``scale``: shorter, for a CPU smoke run)."""
    rng = random.Random(seed)
    lengths = [(max(3, int(scale * rng.randint(100, 1024))), max(1, int(scale * rng.randint(100, 1024))))
               for _ in range(n)]
    vocab = single_token_words(tokenizer)
    out = []
    for p_len, o_len in lengths:
        text = " ".join(rng.choice(vocab) for _ in range(p_len))
        out.append((text, tokenizer.encode(text, add_special_tokens=False), o_len))
    return out


def salted(work, tokenizer, salt: int):
    """The same requests with their first word replaced by one of its own per run: no prompt of one
    run is found in the prefix cache that an earlier run filled (the chained hashes differ from
    the first block on), and the lengths do not change."""
    word = single_token_words(tokenizer)[salt]
    out = []
    for text, _, o_len in work:
        first, _, rest = text.split(" ", 2)
        text = f"{first} {word} {rest}"
        out.append((text, tokenizer.encode(text, add_special_tokens=False), o_len))
    return out


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def summarize(recs: list[dict]) -> dict:
    """recs: start (s since the run's t0), ttft, e2e (s), tokens, ok."""
    ok = [r for r in recs if r["ok"]]
    tokens = sum(r["tokens"] for r in ok)
    window = max(r["start"] + r["e2e"] for r in ok) - min(r["start"] for r in recs) if ok else float("nan")
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    tpot = [(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1 and r["ttft"] is not None]
    res = {"requests": len(recs), "ok": len(ok), "output_tokens": tokens, "window_s": window,
           "tok_s": tokens / window if ok else 0.0}
    for name, vals in (("ttft", ttft), ("tpot", tpot)):
        for q in (50, 90, 99):
            res[f"{name}_p{q}_ms"] = None if not vals else 1e3 * pct(vals, q)
    # gRPC: the worker's own TTFT (its arrival to its first token); the rest of the client's is the way there and back
    if server := [r["server_ttft"] for r in ok if r.get("server_ttft")]:
        for q in (50, 90):
            res[f"server_ttft_p{q}_ms"] = 1e3 * pct(server, q)
    errors = [r["error"] for r in recs if not r["ok"]]
    if errors:
        res["errors"] = errors[:5]
    return res


def arrivals(n: int, rate: float | None, seed: int = 1) -> list[float]:
    """Send times (s): all at 0 for the closed loop of n, else a Poisson process at ``rate`` req/s."""
    if rate is None:
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# --- offline ----------------------------------------------------------------------------------------


def _offline_proc(tokenizer_dir: str, work, loads, engine_kw: dict, q) -> None:
    from transformers import AutoTokenizer

    q.put(run_offline(work, loads, engine_kw, AutoTokenizer.from_pretrained(tokenizer_dir)))


def run_offline(work, loads: list[float | None], engine_kw: dict, tokenizer) -> dict:
    from worker.engine.config import EngineConfig
    from worker.engine.llm_engine import LLMEngine
    from worker.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(**engine_kw))
    warm = [ids for _, ids, _ in work[:64]]
    engine.generate(warm, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, detokenize=False))
    res, rate = {}, None
    base = work
    for salt, load in enumerate(["warm-up", *loads]):
        engine.block_manager.reset_prefix_cache()
        work = salted(base, tokenizer, salt)
        when = arrivals(len(work), None if load in (None, "warm-up") else load * rate)
        recs = [{"start": w, "ttft": None, "e2e": None, "tokens": 0, "ok": True} for w in when]
        t0 = time.perf_counter()
        nxt = 0
        ids = {}
        while nxt < len(work) or engine.has_unfinished():
            now = time.perf_counter() - t0
            while nxt < len(work) and when[nxt] <= now:
                _, prompt, out = work[nxt]
                ids[engine.add_request(prompt, SamplingParams(max_tokens=out, temperature=0, ignore_eos=True,
                                                              detokenize=False))] = nxt
                nxt += 1
            if not engine.has_unfinished():
                time.sleep(max(0.0, min(0.002, when[nxt] - now)))
                continue
            outs = engine.step()
            now = time.perf_counter() - t0
            for o in outs:
                r = recs[ids[o.request_id]]
                if o.new_token_ids and r["ttft"] is None:
                    r["ttft"] = now - r["start"]
                r["tokens"] += len(o.new_token_ids)
                if o.finished:
                    r["e2e"] = now - r["start"]
        key = load if load in (None, "warm-up") else f"poisson_{load:g}"
        key = "closed" if key is None else key
        key += f"_{sum(k.startswith(key) for k in res) + 1}" if key in res else ""  # a repeat
        res[key] = summarize(recs)
        if key == "closed":
            rate = len(work) / res[key]["window_s"]  # requests/s the engine sustains on (b)
            res["offline_rate_req_s"] = rate
        print(f"offline {key}: {json.dumps(res[key])}", flush=True)
    return res


# --- served -----------------------------------------------------------------------------------------


def _client_proc(target: str, protocol: str, items: list, t0_wall: float, q) -> None:
    """One load process: send its share at their times, report one dict per request."""
    from loadtest.clients import GrpcClient, HttpClient
    from loadtest.metrics import RequestRecord
    from loadtest.scenario import scenario_from_dict
    from loadtest.workload import Request

    scenario = scenario_from_dict({"name": "b", "api": "completion", "max_requests": max(1, len(items)),
                                   "max_duration_s": 900, "sampling": {"temperature": 0, "ignore_eos": True}})

    async def main():
        client = GrpcClient(target, scenario) if protocol == "grpc" else HttpClient(target, scenario)
        out = []

        async def one(i, text, max_tokens, at):
            await asyncio.sleep(max(0.0, t0_wall + at - time.time()))
            start = time.time() - t0_wall
            rec = RequestRecord(index=i, session=i, turn=0, tag="", start_s=start)
            req = Request(session=i, turn=0, messages=[{"role": "system", "content": text}], max_tokens=max_tokens)
            await client.send(req, rec)
            out.append({"start": start, "ttft": rec.ttft_s, "e2e": rec.e2e_s, "tokens": rec.output_tokens,
                        "ok": rec.ok, "error": rec.error, "server_ttft": rec.server_ttft_s})

        await asyncio.gather(*(one(*it) for it in items))
        await client.aclose()
        return out

    q.put(asyncio.run(main()))


def process_tree(pid: int) -> dict[int, str]:
    """``pid`` and its descendants: pid -> a short name (its command's first words)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"from multiprocessing" in b" ".join(cmd):  # a spawned child: an HTTP front, Ray's or the tracker
            words = ["spawned child"]
        else:
            words = [w.decode() for w in cmd if w and w[:1] not in b"-{" and b"/" not in w and not w.isdigit()][:3]
        out[p] = " ".join(words) or str(p)
        todo.extend(children.get(p, []))
    return out


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) the process has used so far; 0 once it is gone."""
    from loadtest_capacity import cpu_s as used  # benchmarks/, beside this script

    try:
        return used(pid)
    except OSError:
        return 0.0


def drive(target: str, protocol: str, work, when: list[float], processes: int, server_pids: tuple[int, ...] = (),
          profile: tuple[Path, float] | None = None) -> dict:
    """Send ``work`` at ``when``; with ``server_pids``, also the cores each server process (and its
    children) used over the run (CPU seconds / window), and with ``profile`` (folder, seconds) a py-spy
    record of each."""
    tree = {p: name for pid in server_pids for p, name in process_tree(pid).items()}
    before = {p: cpu_s(p) for p in tree}
    spies = []
    if profile is not None:
        folder, seconds = profile
        for p, name in tree.items():
            out = folder / f"pyspy_{re.sub(r'[^A-Za-z0-9]+', '_', name)}_{p}.txt"
            spies.append(subprocess.Popen(
                ["py-spy", "record", "--pid", str(p), "--duration", str(int(seconds)), "--rate", "100", "--format",
                 "raw", "--nonblocking", "--threads", "-o", str(out)], stdout=open(out.with_suffix(".log"), "w"),
                stderr=subprocess.STDOUT))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    t0 = time.time() + 3.0  # every process imported and connected by then
    items = [(i, text, out, w) for i, ((text, _, out), w) in enumerate(zip(work, when))]
    procs = [ctx.Process(target=_client_proc, args=(target, protocol, items[k::processes], t0, q))
             for k in range(processes)]
    for p in procs:
        p.start()
    recs = [r for _ in procs for r in q.get()]
    for p in procs:
        p.join()
    res = summarize(recs)
    if tree:
        res["server_cores"] = {f"{name} ({p})": round((cpu_s(p) - before[p]) / res["window_s"], 3)
                               for p, name in tree.items()}
    for spy in spies:
        spy.wait()
    return res


def start(cmd: list[str], log: Path, ready_port: int, timeout: float = 600) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-m", "kvcascade", *cmd], cwd=REPO, env=env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited: {log.read_text()[-3000:]}")
        if "ready" in log.read_text() and _answers(ready_port):
            if cmd[0] != "serve" or "kvcascade serve ready" in log.read_text():
                return proc
        time.sleep(1)
    proc.kill()
    raise TimeoutError(log.read_text()[-3000:])


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def router_overhead(worker: str, router_grpc: str, router_http: str, work, n: int, tokenizer) -> dict:
    """TTFT of one request at a time (8 output tokens, prompts of workload (b), salted anew), straight to
    the worker over gRPC and through the router over gRPC and HTTP, the three paths taking turns request
    by request (so a drift of the GPU's or the host's speed falls on all three alike): p50/p90 of each,
    and of the differences to the straight TTFT of the same prompt position (the router adds its hop,
    tokenizing and routing; the worker then need not tokenize)."""
    paths = [("grpc_worker", "grpc", worker), ("grpc_router", "grpc", router_grpc),
             ("http_router", "http", router_http)]
    items = [[(text, 8) for text, _, _ in salted(work[:n + 5], tokenizer, 40 + i)] for i in range(len(paths))]
    res = _sequential([(protocol, address) for _, protocol, address in paths], items)
    res = dict(zip([label for label, _, _ in paths], res))
    base = res["grpc_worker"]
    out = {"requests": n}
    for label, ttfts in res.items():
        out[f"{label}_ttft_p50_ms"] = 1e3 * pct(ttfts, 50)
        out[f"{label}_ttft_p90_ms"] = 1e3 * pct(ttfts, 90)
        if label != "grpc_worker":
            diffs = [a - b for a, b in zip(ttfts, base)]
            out[f"{label}_minus_worker_p50_ms"] = 1e3 * pct(diffs, 50)
            out[f"{label}_p50_minus_worker_p50_ms"] = 1e3 * (pct(ttfts, 50) - pct(base, 50))
    return out


def _sequential(targets: list[tuple[str, str]], items: list[list[tuple[str, int]]]) -> list[list[float]]:
    """Client TTFTs (s) of each target's ``items`` but the first 5 (unmeasured: connections, first
    calls), sent one at a time, the targets taking turns (request i of every target before request
    i + 1 of any)."""
    from loadtest.clients import GrpcClient, HttpClient
    from loadtest.metrics import RequestRecord
    from loadtest.scenario import scenario_from_dict
    from loadtest.workload import Request

    scenario = scenario_from_dict({"name": "overhead", "api": "completion", "max_requests": len(items[0]),
                                   "max_duration_s": 900, "sampling": {"temperature": 0, "ignore_eos": True}})

    async def main() -> list[list[float]]:
        clients = [GrpcClient(address, scenario) if protocol == "grpc" else HttpClient(address, scenario)
                   for protocol, address in targets]
        out: list[list[float]] = [[] for _ in targets]
        for i in range(len(items[0])):
            for t, client in enumerate(clients):
                text, max_tokens = items[t][i]
                rec = RequestRecord(index=i, session=i, turn=0, tag="", start_s=0.0)
                await client.send(Request(session=i, turn=0, messages=[{"role": "system", "content": text}],
                                          max_tokens=max_tokens), rec)
                assert rec.ok, rec.error
                if i >= 5:
                    out[t].append(rec.ttft_s)
        for client in clients:
            await client.aclose()
        return out

    return asyncio.run(main())


def run_targets(name: str, targets: list[tuple[str, str, str]], work, loads, rate, processes, tokenizer,
                server_pids: tuple[int, ...] = (), profile: tuple[Path, float] | None = None) -> dict:
    """Every run's prompts are salted anew: the same requests, none found in the cache (salted).
    ``profile``: py-spy records the server's processes during each closed run."""
    res = {}
    salt = 0
    for label, protocol, address in targets:
        # A discarded closed run first: the server compiles what it first sees, as the offline run did
        # (with a salt of its own: a second target's warm-up must not find the first's last run cached).
        salt += 1
        res[f"{label}_warm-up"] = drive(address, protocol, salted(work, tokenizer, salt), [0.0] * len(work), processes)
        for load in loads:
            salt += 1
            when = arrivals(len(work), None if load is None else load * rate)
            key = f"{label}_{'closed' if load is None else f'poisson_{load:g}'}"
            key += f"_{sum(k.startswith(key) for k in res) + 1}" if key in res else ""  # a repeat
            spy = None if profile is None or load is not None else (profile[0] / label, profile[1])
            if spy is not None:
                spy[0].mkdir(parents=True, exist_ok=True)
            res[key] = drive(address, protocol, salted(work, tokenizer, salt), when, processes, server_pids, spy)
            print(f"{name} {key}: {json.dumps(res[key])}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True, help="tokenizer folder for the dummy model's text")
    ap.add_argument("--parts", nargs="+", default=["offline", "worker", "serve"],
                    choices=["offline", "worker", "serve", "split"])
    ap.add_argument("--poisson", nargs="*", type=float, default=[], help="loads as fractions of the offline rate")
    ap.add_argument("--rate", type=float, help="offline request rate (req/s) when --parts has no offline")
    ap.add_argument("--processes", type=int, default=4, help="load-generator processes")
    ap.add_argument("--http-only", action="store_true", help="serve: HTTP through the router only")
    ap.add_argument("--serve-args", default="", help="serve: extra flags (e.g. '--http-workers 4'), named in the labels")
    ap.add_argument("--redis-server", default="redis-server", help="split: the redis-server binary")
    ap.add_argument("--out", type=Path, default=Path("served.json"))
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=1, help="closed runs per target (the spread between runs)")
    ap.add_argument("--scale", type=float, default=1.0, help="lengths x this (a CPU smoke run: 0.02)")
    ap.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                    help="override an engine setting (a CPU smoke run: model=dummy:smollm2-mini device=cpu ...)")
    ap.add_argument("--logs", type=Path, default=Path("/tmp"))
    ap.add_argument("--py-spy", type=float, metavar="SECONDS",
                    help="py-spy records every server process for this long in each closed run (into --logs)")
    ap.add_argument("--overhead", type=int, default=50, metavar="N",
                    help="split: N requests one at a time (8 output tokens), straight to the worker and through "
                         "the router, for the router's TTFT overhead (0: skip)")
    args = ap.parse_args()
    profile = None if args.py_spy is None else (args.logs, args.py_spy)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    engine_kw = dict(ENGINE)
    for kv in args.engine:
        key, value = kv.split("=", 1)
        engine_kw[key] = type(ENGINE[key])(value) if key in ENGINE else value
    work = workload(tok, n=args.requests, scale=args.scale)
    res = {"mean_prompt_tokens": sum(len(i) for _, i, _ in work) / len(work),
           "output_tokens": sum(o for _, _, o in work)}
    print(f"workload: {len(work)} requests, mean prompt {res['mean_prompt_tokens']:.0f} tokens, "
          f"{res['output_tokens']} output tokens", flush=True)
    closed_and_poisson = [None] * args.repeat + list(args.poisson)
    rate = args.rate
    if "offline" in args.parts:  # in a process of its own, which gives the GPU back whole when it ends
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        proc = ctx.Process(target=_offline_proc, args=(args.tokenizer, work, closed_and_poisson, engine_kw, q))
        proc.start()
        res["offline"] = q.get()
        proc.join()
        rate = res["offline"]["offline_rate_req_s"]
    loads = closed_and_poisson if rate else [None] * args.repeat
    flags = [*server_flags(engine_kw), "--tokenizer", args.tokenizer]
    if "worker" in args.parts:
        port = free_port()
        proc = start(["worker", "--port", str(port), *flags], args.logs / "worker.log", port)
        try:
            res["worker"] = run_targets("worker", [("grpc_worker", "grpc", f"127.0.0.1:{port}")], work, loads, rate,
                                        args.processes, tok, (proc.pid,), profile)
        finally:
            stop(proc)
    if "serve" in args.parts:
        port, http = free_port(), free_port()
        extra = args.serve_args.split()
        proc = start(["serve", "--port", str(port), "--http-port", str(http), *flags, *extra], args.logs / "serve.log",
                     http)
        tag = re.sub(r"[^A-Za-z0-9]+", "_", args.serve_args).strip("_")
        targets = [(f"grpc_router{'_' + tag if tag else ''}", "grpc", f"127.0.0.1:{port}"),
                   (f"http_router{'_' + tag if tag else ''}", "http", f"http://127.0.0.1:{http}")]
        try:
            res["serve"] = run_targets("serve", targets[1:] if args.http_only else targets, work, loads, rate,
                                       args.processes, tok, (proc.pid,), profile)
        finally:
            stop(proc)
    if "split" in args.parts:
        rport = free_port()
        redis = subprocess.Popen([args.redis_server, "--port", str(rport), "--save", "", "--appendonly", "no"],
                                 stdout=subprocess.DEVNULL)
        url = f"redis://127.0.0.1:{rport}/0"
        wport, port, http = free_port(), free_port(), free_port()
        worker = start(["worker", "--port", str(wport), "--redis-url", url, *flags], args.logs / "split-worker.log", wport)
        router = start(["router", "--port", str(port), "--http-port", str(http), "--redis-url", url],
                       args.logs / "split-router.log", http)
        try:
            time.sleep(2)
            if args.overhead:
                res["router_overhead"] = router_overhead(f"127.0.0.1:{wport}", f"127.0.0.1:{port}",
                                                         f"http://127.0.0.1:{http}", work, args.overhead, tok)
                print(f"router overhead: {json.dumps(res['router_overhead'])}", flush=True)
            res["split"] = run_targets("split", [("http_split", "http", f"http://127.0.0.1:{http}")], work, loads,
                                       rate, args.processes, tok, (router.pid, worker.pid), profile)
        finally:
            stop(router)
            stop(worker)
            redis.terminate()
    args.out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items()}, indent=1))


if __name__ == "__main__":
    main()
