"""Data parallelism in one process: M engine replicas behind one front end (vLLM's DP).

``placement`` gives each replica its device group and starts them; ``router`` picks the replica
of a new request; ``replica_set`` routes and merges for both front ends (``LLM`` and
``DPAsyncLLM`` in ``async_llm``); ``metrics`` merges the replicas' Prometheus samples.
"""
