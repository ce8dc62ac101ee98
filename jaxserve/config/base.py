"""What every sub-configuration shares: it validates itself once, when built, and says which field
is wrong with one ``ConfigError`` naming it."""

from __future__ import annotations

from typing import Any

from jaxserve.exceptions import ConfigError


def bad_value(config: Any, field: str, why: str) -> ConfigError:
    """``field: why, got VALUE``: the one shape of a configuration error."""
    return ConfigError(f"{field}: {why}, got {getattr(config, field)!r}")


class SubConfig:
    """Base of the sub-configurations ``EngineConfig`` composes. A subclass is a dataclass whose
    fields (with a docstring each) become flags; ``validate`` checks them and may normalise them."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        pass

    def bad(self, field: str, why: str) -> ConfigError:
        return bad_value(self, field, why)
