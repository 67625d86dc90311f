"""The engine core's own room: an LLMEngine's step loop in a process of its own (process.py), the
front end that talks to it (client.py) and what they say to each other (messages.py). Its only
imports are the engine and the contracts: it knows no server, router or command line."""
