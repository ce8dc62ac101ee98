"""How the engine spreads over devices and hosts: tensor and data parallelism, and the multi-node
group (vLLM's ``ParallelConfig``)."""

from __future__ import annotations

import dataclasses

from jaxserve import envs
from jaxserve.config.base import SubConfig

# vLLM's defaults for a multi-node engine's rank 0.
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29501


@dataclasses.dataclass
class ParallelConfig(SubConfig):
    tensor_parallel_size: int = 1
    """Devices each model is split over (Megatron-style: attention heads, MLP columns and the
    vocabulary); must divide the attention heads and be at most the devices present."""
    data_parallel_size: int = 1
    """Engine replicas, each with its own scheduler, KV cache and devices (tensor_parallel_size
    of them), behind one API; requests go to the least loaded replica or to the one holding their
    prefix."""
    nnodes: int = 1
    """Hosts the engine spans, one process each; above 1, JAX's distributed runtime joins them
    and one mesh covers every host's devices."""
    node_rank: int = 0
    """This host's rank, 0 to nnodes - 1: rank 0 runs the scheduler and the API server, the others
    run the steps rank 0 sends them."""
    master_addr: str | None = None
    """Rank 0's address, where JAX's coordination service listens; default: the host of
    JAX_COORDINATOR_ADDRESS when set, else 127.0.0.1."""
    master_port: int | None = None
    """The coordination service's port on master_addr; default: the port of
    JAX_COORDINATOR_ADDRESS when set, else 29501."""
    node_heartbeat_timeout_s: int = 10
    """A host whose heartbeats to the coordination service stop for this many seconds counts as
    lost: rank 0 then fails its requests and /health answers 503."""

    enable_expert_parallel: bool = False
    """Split a mixture-of-experts model's experts whole over the tensor-parallel devices (vLLM's
    flag): each holds num_experts / tensor_parallel_size of them, attention stays split by heads.
    A MoE model needs it for tensor_parallel_size > 1; a dense model ignores it."""

    def validate(self) -> None:
        if self.data_parallel_size < 1:
            raise self.bad("data_parallel_size", "must be >= 1")
        if self.tensor_parallel_size < 1:
            raise self.bad("tensor_parallel_size", "must be >= 1")
        if self.nnodes < 1:
            raise self.bad("nnodes", "must be >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise self.bad("node_rank", f"must be in [0, nnodes - 1] with nnodes={self.nnodes}")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise self.bad("master_port", "must be a TCP port, 1 to 65535")
        addr = self.master_addr
        if addr is not None and (not addr.strip() or (":" in addr and not addr.startswith("["))):
            raise self.bad("master_addr", "must be a host name or an address (an IPv6 one in brackets), no port")
        if self.tensor_parallel_size % self.nnodes:
            raise self.bad("tensor_parallel_size", f"must be a multiple of nnodes ({self.nnodes}): every node "
                           "holds an equal share of the mesh")
        if self.node_heartbeat_timeout_s < 1:
            raise self.bad("node_heartbeat_timeout_s", "must be >= 1")

    @property
    def is_multi_node(self) -> bool:
        return self.nnodes > 1

    def coordinator_address(self) -> str:
        """``host:port`` of JAX's coordination service (rank 0): ``master_addr``/``master_port``,
        each defaulting to its part of ``JAX_COORDINATOR_ADDRESS``, then 127.0.0.1:29501."""
        env_host, env_port = envs.jax_coordinator_address()
        host = self.master_addr or env_host or DEFAULT_MASTER_ADDR
        port = self.master_port or env_port or DEFAULT_MASTER_PORT
        return f"{host}:{port}"
