"""Multi-host serving on JAX's own multi-controller runtime (``jax.distributed``).

Every host runs one process with the same engine configuration and one runner; rank 0 also runs
the scheduler and the API server. Rank 0 sends each runner call it makes (prepare a
``SchedulerOutput``, launch it, collect it) to the other ranks through the coordination service's
key-value store, and every rank replays them in the same order, so all hosts dispatch the same
compiled steps over one global mesh. Tensors move only through XLA's collectives inside those
steps; the store carries the small per-step control messages.

Modules: :mod:`.runtime` starts the runtime, :mod:`.messages` encodes the runner calls,
:mod:`.channel` carries them, :mod:`.liveness` notices a lost host. This package sits beside the
runner (it imports jax, the configuration and the core's data), below the engine that drives it.
"""
