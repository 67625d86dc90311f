"""The serving engine as a library: requests, scheduler, block manager, model runner, sampler.

It knows nothing of gRPC, Redis or Ray; worker/server.py exposes it over gRPC.
"""
