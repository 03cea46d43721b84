"""Structured configs as plain data: the schema (schema.py, every key), loading and overrides
(loader.py), the validation of values (validate.py) and the quantities derived from a config
(derived.py). Imports no other hpcrl package: the checks that read files or know engines, data and
rewards are hpcrl.trainer.preflight's."""

from hpcrl.config.derived import (
    Layout,
    critic_enabled,
    is_dpo,
    reference_enabled,
    role_layouts,
    rollout_layout,
    world_size,
)
from hpcrl.config.loader import ConfigError, load_config, parse_overrides, to_yaml
from hpcrl.config.schema import HpcrlConfig
from hpcrl.config.validate import validate

__all__ = [
    "ConfigError", "HpcrlConfig", "Layout", "critic_enabled", "is_dpo", "load_config", "parse_overrides",
    "reference_enabled", "role_layouts", "rollout_layout", "to_yaml", "validate", "world_size",
]
