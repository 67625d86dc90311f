"""The CPU `kvcascade serve`'s own process spends per token it relays (its engine cores are child
processes and not counted): the cost of the fronts, the router and the worker's front end together.

    python benchmarks/serve_cpu_per_token.py [--protocol grpc|http] [--streams 128] [--tokens 150]
        [--model dummy:smollm2-mini] [-- extra serve flags]

Starts serve on free ports, warms it up with one round, then runs --rounds rounds of --streams
requests of --tokens greedy tokens each (token-id prompts, EOS ignored), 64 at a time, through the
router over gRPC or streamed HTTP (SSE), and prints serve's CPU seconds (user + system, all threads,
from /proc) per relayed token. On a GPU machine pass --model and --device flags after `--`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from deploy.local import free_port  # noqa: E402
from loadtest_capacity import cpu_s  # noqa: E402  (benchmarks/, beside this script)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    ap.add_argument("--streams", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default="dummy:smollm2-mini")
    ap.add_argument("serve_args", nargs="*", help="extra `kvcascade serve` flags (after --)")
    args = ap.parse_args()

    import grpc
    import httpx

    from protos import kvcascade_pb2 as pb
    from protos import kvcascade_pb2_grpc as pb_grpc

    port, http = free_port(), free_port()
    log = Path(tempfile.mkdtemp(prefix="serve-cpu-")) / "serve.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "kvcascade", "serve", "--port", str(port), "--http-port", str(http),
                             "--model", args.model, "--max-num-seqs", "64", *args.serve_args],
                            cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        while "kvcascade serve ready" not in log.read_text():
            if proc.poll() is not None:
                raise RuntimeError(log.read_text()[-3000:])
            time.sleep(0.5)
        stub = pb_grpc.KVCascadeStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        client = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=256))

        def one(i: int) -> int:
            prompt = [1 + i % 50, 2, 3, 4, 5]
            if args.protocol == "grpc":
                req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True))
                req.token_ids.ids[:] = prompt
                return sum(len(m.token_ids) for m in stub.Generate(req, timeout=600))
            body = {"prompt": prompt, "max_tokens": args.tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            tokens = 0
            with client.stream("POST", f"http://127.0.0.1:{http}/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and '"usage":{' in line:
                        tokens = json.loads(line[6:])["usage"]["completion_tokens"]
            return tokens

        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            list(pool.map(one, range(64)))  # warm-up
            for rnd in range(args.rounds):
                c0, t0 = cpu_s(proc.pid), time.monotonic()
                tokens = sum(pool.map(one, range(args.streams)))
                used, wall = cpu_s(proc.pid) - c0, time.monotonic() - t0
                print(f"{args.protocol} round {rnd}: {tokens} tokens in {wall:.1f} s; serve's process {used:.2f} CPU s "
                      f"= {1e6 * used / tokens:.0f} us a token ({used / wall:.2f} cores)", flush=True)
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
