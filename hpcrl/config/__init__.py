"""Structured configs, overrides and validation (see schema.py for every key)."""

from hpcrl.config.loader import ConfigError, load_config, parse_overrides, to_yaml
from hpcrl.config.schema import HpcrlConfig
from hpcrl.config.validate import (
    Layout,
    critic_enabled,
    is_dpo,
    reference_enabled,
    role_layouts,
    rollout_layout,
    validate,
    world_size,
)

__all__ = [
    "ConfigError", "HpcrlConfig", "Layout", "critic_enabled", "is_dpo", "load_config", "parse_overrides",
    "reference_enabled", "role_layouts", "rollout_layout", "to_yaml", "validate", "world_size",
]
