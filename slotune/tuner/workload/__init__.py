"""Requests from a workload's shape: `requests.iter_requests` (lengths, arrivals, shared prefixes,
trace replays; the same seed gives the same requests), `prompts` (prompts rebuilt from a trace's
block hashes), `fit` (a WorkloadSpec fitted to a recorded trace: `tune workload fit`).
"""
