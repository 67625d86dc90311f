"""The load-test harness: a pure client of the kvcascade APIs (gRPC and OpenAI-style HTTP).

    scenario.py   the YAML schema: workload, arrivals, bounds, SLO (validated, one source of defaults)
    text.py       synthetic prompt text, reproducible by seed
    workload.py   a scenario's requests as sessions of one or more turns
    tasks.py      labelled tasks (prompt, known answer, scorer): accuracy of a run, cascade calibration
    clients.py    gRPC (grpc.aio) and HTTP (httpx, server-sent events) clients; targets
    runner.py     arrivals (closed loop, Poisson, bursts), the request and time bounds, progress
    processes.py  a run spread over N processes (--processes): the split, and the merge of their records
    metrics.py    per-request records; percentiles, goodput, the run summary
    report.py     the terminal table, summary.json, requests.jsonl, PNG plots
    cli.py        ``kvcascade loadtest`` and ``kvcascade loadtest compare``
    fake_server.py  a server that only streams (no model): to measure the harness itself

It imports nothing from worker/ or router/: only the protos/ contract.
"""
