"""What the engine needs of a model object passed as ``LLM(model=<module>)``.

The engine calls a model only inside its compiled step, through the same three members that
:class:`jaxserve.models.llama.LlamaForCausalLM` has:

- ``config``: a :class:`jaxserve.models.config.ModelConfig`. The engine sizes the KV cache from
  ``num_hidden_layers``, ``num_key_value_heads``, ``head_dim`` and ``dtype``, the sampler from
  ``vocab_size``, ``max_model_len`` from ``max_position_embeddings``, and reads EOS from
  ``eos_token_ids``.
- ``__call__(input_ids, kv_cache, md, attn_fn) -> (hidden, kv_cache)``: ``input_ids [T]`` int32
  (every scheduled token of the step, packed), ``kv_cache`` a ``(k, v)`` pair of
  ``[layers, num_blocks, block_size, kv_heads, head_dim]`` arrays, ``md`` the step's
  :class:`jaxserve.layers.attention.AttentionMetadata`, ``attn_fn`` the attention backend to
  hand to :func:`jaxserve.layers.attention.paged_attention`. Returns hidden states ``[T, hidden]``
  and the updated cache of the same shapes.
- ``compute_logits(hidden [N, hidden]) -> [N, vocab_size]`` float32 logits of the selected rows.

The module must be a Flax NNX module: the runner splits it once into graph and state and passes
the state to the compiled step, so every array the model computes with must be an ``nnx``
variable (or a constant). ``scan_layers`` (bool) is optional and only reported;
``tensor_parallel_size`` is optional too, and must be 1 (a model object runs on one device).
"""

from __future__ import annotations

from typing import Any

from jaxserve.exceptions import ConfigError

REQUIRED_METHODS = ("__call__", "compute_logits")


def contract_problems(model: Any) -> list[str]:
    """Everything ``model`` lacks to be served by the engine (empty when it qualifies)."""
    from flax import nnx

    from jaxserve.models.config import ModelConfig

    problems = []
    if not isinstance(model, nnx.Module):
        problems.append(f"it is a {type(model).__name__}, not a flax.nnx.Module")
    config = getattr(model, "config", None)
    if not isinstance(config, ModelConfig):
        found = "no attribute 'config'" if config is None else f"config is a {type(config).__name__}"
        problems.append(f"it needs a 'config' attribute holding a jaxserve ModelConfig ({found})")
    for name in REQUIRED_METHODS:
        if not _defines(type(model), name):
            problems.append(f"it has no method {name}()")
    return problems


def _defines(cls: type, name: str) -> bool:
    # Looked up in the class's own MRO: ``getattr(cls, "__call__")`` would find the metaclass's.
    return any(callable(vars(k).get(name)) for k in cls.__mro__ if k is not object)


def check_model_object(model: Any) -> None:
    """Raise ConfigError naming every missing piece of the contract above."""
    problems = contract_problems(model)
    if problems:
        raise ConfigError("model object cannot be served: " + "; ".join(problems)
                          + " (see jaxserve.models.contract for what the engine calls)")
