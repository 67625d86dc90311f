"""The floor both sides stand on: what the router and the workers share, so that neither imports the
other and the command-line package (kvcascade/) only assembles and starts.

    state.py         the worker registry and prefix index: records, errors, interfaces
    memory_state.py  their in-process implementation (the embedded default)
    redis_state.py   their Redis implementation (several routers and workers)
    stores.py        picks one of the two for a deployment (connect_state)
    grpc_server.py   the grpc.aio server both a worker and a router run (health, reflection)
    ports.py         free ports for servers told theirs before they start (tests, local processes, TP ranks)
    models.py        the model catalog: built-in names, GGUF files, safetensors folders, dummy presets
    tokenizers.py    a model's tokenizer (transformers, no torch): what the router hashes and the worker runs

protos/ (the gRPC contract and the block hash) sits beside it, also at the bottom.
"""
