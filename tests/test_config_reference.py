"""docs/config.md is the config reference generated from hpcrl/config/schema.py: it must match the schema
(every key, type, default, allowed values, meaning), and every key must have a meaning."""

from __future__ import annotations

from conftest import REPO

from hpcrl.config.reference import GENERATOR, collect, render, undocumented


def test_every_key_has_a_meaning() -> None:
    assert undocumented() == [], f"add a comment above or beside these keys in hpcrl/config/schema.py: {undocumented()}"


def test_config_reference_is_current() -> None:
    doc = REPO / "docs" / "config.md"
    assert doc.exists() and doc.read_text() == render(), (
        f"docs/config.md is out of date with hpcrl/config/schema.py: run `{GENERATOR}` and commit docs/config.md")


def test_reference_lists_the_keys_the_loader_knows() -> None:
    """The generator walks the dataclasses as OmegaConf does: the same dotted keys, the same defaults
    (a section that defaults to null, like critic.parallel, is listed with the keys it takes)."""
    from typing import Any

    from omegaconf import DictConfig, OmegaConf

    from hpcrl.config.schema import HpcrlConfig

    def leaves(node: Any, prefix: str = "") -> set[str]:
        out: set[str] = set()
        for key in node:
            child = node._get_node(key)
            if isinstance(child, DictConfig) and not child._is_none() and key != "engine_kwargs":
                out |= leaves(child, f"{prefix}{key}.")
            else:
                out.add(f"{prefix}{key}")
        return out

    docs = {d.key: d for d in collect()}
    assert leaves(OmegaConf.structured(HpcrlConfig)) <= set(docs)
    assert docs["critic.optim.lr"].default == "1e-05" and docs["model.path"].default == "required"
    assert docs["critic.parallel"].default == "null" and "critic.parallel.tensor_parallel" in docs
    assert docs["logging.wandb.mode"].allowed == "disabled \\| offline \\| online"
