"""The compute floor: ggml's kernels on GGUF weights as stored, and the process settings they run under.

Both the node (a slab holder's expert FFNs) and the coordinator's models (the dense path) stand on it; it
imports neither of them, only the slab format (swarm.sharding) below it.
"""
