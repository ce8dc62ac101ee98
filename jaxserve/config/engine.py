"""``EngineConfig``: the sub-configurations composed into one, the way vLLM's ``VllmConfig`` composes
``vllm/config/*.py``.

Each sub-configuration is a dataclass in a file of its own that validates itself once, when built;
``EngineConfig.validate`` checks only what spans two of them. The flat view stays: the keyword
arguments ``EngineConfig(model=..., max_num_seqs=...)``, the attributes ``config.max_num_seqs``
(read and written: they land in the sub-configuration owning the field) and the CLI flags, all
named as vLLM's engine arguments. A field's flat name is unique across sub-configurations.

A feature's sub-configuration is one file (a dataclass deriving ``SubConfig``, its fields with a
docstring each) plus one line here: ``feature_config: FeatureConfig = sub_config(FeatureConfig)``.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from jaxserve.config.base import SubConfig
from jaxserve.config.cache import CacheConfig
from jaxserve.config.compilation import CompilationConfig
from jaxserve.config.flags import Flag, add_flags, dataclass_flags, flags_for
from jaxserve.config.limits import LimitsConfig
from jaxserve.config.load import LoadConfig
from jaxserve.config.lora import LoRAConfig
from jaxserve.config.multimodal import MultiModalConfig
from jaxserve.config.observability import ObservabilityConfig
from jaxserve.config.parallel import ParallelConfig
from jaxserve.config.pooling import PoolingConfig
from jaxserve.config.scheduler import SchedulerConfig
from jaxserve.config.speculative import SpecDecodeConfig
from jaxserve.config.structured_outputs import StructuredOutputsConfig
from jaxserve.exceptions import ConfigError


def sub_config(cls: type[SubConfig]) -> Any:
    """The field holding one sub-configuration (built from its defaults unless given)."""
    return dataclasses.field(default_factory=cls, metadata={"sub_config": cls})


@dataclasses.dataclass(init=False)
class EngineConfig:
    load_config: LoadConfig = sub_config(LoadConfig)
    scheduler_config: SchedulerConfig = sub_config(SchedulerConfig)
    cache_config: CacheConfig = sub_config(CacheConfig)
    parallel_config: ParallelConfig = sub_config(ParallelConfig)
    compilation_config: CompilationConfig = sub_config(CompilationConfig)
    limits_config: LimitsConfig = sub_config(LimitsConfig)
    structured_outputs_config: StructuredOutputsConfig = sub_config(StructuredOutputsConfig)
    observability_config: ObservabilityConfig = sub_config(ObservabilityConfig)
    lora_config: LoRAConfig = sub_config(LoRAConfig)
    pooling_config: PoolingConfig = sub_config(PoolingConfig)
    multimodal_config: MultiModalConfig = sub_config(MultiModalConfig)
    spec_decode_config: SpecDecodeConfig = sub_config(SpecDecodeConfig)

    def __init__(self, **kwargs: Any) -> None:
        """Flat keyword arguments (``max_num_seqs=8``), sub-configurations (``cache_config=...``),
        or both: a flat value then overrides the given sub-configuration's, on a copy of it."""
        layout = _layout(type(self))
        per_slot: dict[str, dict[str, Any]] = {slot: {} for slot in layout.slots}
        own: dict[str, Any] = {}
        for name, value in kwargs.items():
            if name in layout.slots:
                if not isinstance(value, layout.slots[name]):
                    raise TypeError(f"EngineConfig: {name} must be a {layout.slots[name].__name__}, "
                                    f"got {type(value).__name__}")
            elif name in layout.owners:
                per_slot[layout.owners[name]][name] = value
            elif name in layout.own:
                own[name] = value
            else:
                raise TypeError(f"EngineConfig got an unexpected keyword argument {name!r}")
        for slot, cls in layout.slots.items():
            given = kwargs.get(slot)
            # Always a fresh object: two configurations never share a mutable sub-configuration.
            value = dataclasses.replace(given, **per_slot[slot]) if given is not None else cls(**per_slot[slot])
            object.__setattr__(self, slot, value)
        for name, f in layout.own.items():
            if name in own:
                value = own[name]
            elif f.default_factory is not dataclasses.MISSING:
                value = f.default_factory()
            else:
                value = f.default
            object.__setattr__(self, name, value)
        self.validate()

    def validate(self) -> None:
        """What spans two sub-configurations (each validated its own fields when it was built)."""
        if self.spec_decode_config.spec is not None and self.pooling_config.runner == "pooling":
            raise ConfigError("speculative_config with runner='pooling': a pooling model generates no "
                              "tokens to speculate on")
        spec = self.spec_decode_config.spec
        # A draft or head runs on the target's mesh (split or replicated), built by the runner of one
        # host; a mesh over several hosts has none yet.
        if spec is not None and spec.method != "ngram" and self.parallel_config.is_multi_node:
            raise ConfigError(f"speculative_config.method={spec.method} runs the draft on one host's devices; "
                              f"nnodes {self.parallel_config.nnodes} is not supported")
        tp = self.parallel_config.tensor_parallel_size
        if spec is not None and spec.draft_tensor_parallel_size not in (None, 1, tp):
            raise ConfigError(f"speculative_config.draft_tensor_parallel_size must be 1 or tensor_parallel_size "
                              f"({tp}), got {spec.draft_tensor_parallel_size}")

    # ---- the flat view -------------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        # Only reached when the normal lookup fails: a flat field name read through its owner.
        slot = _layout(type(self)).owners.get(name)
        if slot is None or slot not in self.__dict__:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}")
        return getattr(self.__dict__[slot], name)

    def __setattr__(self, name: str, value: Any) -> None:
        slot = _layout(type(self)).owners.get(name)
        if slot is None:
            object.__setattr__(self, name, value)
        else:
            setattr(getattr(self, slot), name, value)

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with some flat fields (or sub-configurations) changed, validated again."""
        return dataclasses.replace(self, **changes)

    def __copy__(self) -> EngineConfig:
        # A shallow copy would share the sub-configurations, so a flat write would reach both.
        return self.replace()

    def as_kwargs(self) -> dict[str, Any]:
        """The flat keyword arguments that build this configuration again."""
        return {flag.name: getattr(self, flag.name) for flag in self.flags()}

    @property
    def is_multi_node(self) -> bool:
        return self.parallel_config.is_multi_node

    def coordinator_address(self) -> str:
        return self.parallel_config.coordinator_address()

    def resolved_compilation_cache_dir(self) -> str | None:
        return self.compilation_config.resolved_compilation_cache_dir()

    # ---- CLI -------------------------------------------------------------------------------------

    @classmethod
    def flags(cls) -> tuple[Flag, ...]:
        """Every flat field, sub-configuration by sub-configuration, then EngineConfig's own."""
        return _layout(cls).flags

    @classmethod
    def add_cli_args(cls, parser: Any, skip: tuple[str, ...] = ("model",)) -> None:
        add_flags(parser, cls.flags(), skip)

    def cli_flags(self, skip: tuple[str, ...] = ()) -> list[str]:
        """The flags that give this configuration from the defaults (those of changed fields)."""
        return flags_for(self.flags(), self.as_kwargs(), skip)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> EngineConfig:
        names = {flag.name for flag in cls.flags()}
        values = {k: v for k, v in vars(args).items() if k in names}
        values.update(overrides)
        return cls(**values)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """The same as ``EngineConfig(**kwargs)``, spelled as vLLM's ``EngineArgs`` users expect."""
        return cls(**kwargs)


@dataclasses.dataclass(frozen=True)
class _Layout:
    slots: dict[str, type[SubConfig]]  # sub-configuration field -> its class
    owners: dict[str, str]  # flat field -> the sub-configuration field holding it
    own: dict[str, dataclasses.Field]  # EngineConfig's own flat fields (a feature's block before its file)
    flags: tuple[Flag, ...]


_LAYOUTS: dict[type, _Layout] = {}


def _layout(cls: type) -> _Layout:
    layout = _LAYOUTS.get(cls)
    if layout is None:
        layout = _LAYOUTS[cls] = _make_layout(cls)
    return layout


def _make_layout(cls: type) -> _Layout:
    slots: dict[str, type[SubConfig]] = {}
    own: dict[str, dataclasses.Field] = {}
    for f in dataclasses.fields(cls):
        if "sub_config" in f.metadata:
            slots[f.name] = f.metadata["sub_config"]
        else:
            own[f.name] = f
    owners: dict[str, str] = {}
    flags: list[Flag] = []
    for slot, sub in slots.items():
        for flag in dataclass_flags(sub):
            if flag.name in owners or flag.name in own or flag.name in slots:
                raise TypeError(f"EngineConfig: the field {flag.name!r} is defined twice")
            owners[flag.name] = slot
            flags.append(flag)
    flags += [flag for flag in dataclass_flags(cls) if flag.name in own]
    return _Layout(slots, owners, own, tuple(flags))
