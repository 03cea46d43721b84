"""The KL-in-reward coefficient beta: fixed, or adapted towards a target KL (Ziegler et al. 2019).

Used when `algorithm.use_kl_in_reward` is on: the controller's `.value` is the kl_coef passed to
`advantages.token_level_rewards`, and after each step the controller sees the measured KL. Its
state is a single float, saved with the run's checkpoint so a resumed run continues the schedule.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

KL_CONTROLLERS = ("fixed", "adaptive")


class FixedKLController:
    """A constant beta; `update` is a no-op (kept so the controller loop treats both kinds alike)."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller of Ziegler et al. 2019 ("Fine-Tuning Language Models from Human
    Preferences", sec. 2.2): e = clip(KL / KL_target - 1, -0.2, 0.2), beta <- beta * (1 + K e)
    with K = n_steps / horizon.

    The clip keeps one noisy KL measurement from moving beta by more than 20% of K; horizon sets
    how many samples (n_steps: usually the batch size of the step) a full correction takes."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0:
            raise ValueError(f"algorithm.kl_ctrl.target_kl must be > 0 for the adaptive controller, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"algorithm.kl_ctrl.horizon must be > 0 for the adaptive controller, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move beta up when the measured KL is above target, down when below."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.value = float(state["value"])


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    """cfg[key] for a mapping (dict, OmegaConf DictConfig), cfg.key for a dataclass; `default` if absent."""
    if isinstance(cfg, Mapping):
        value = cfg.get(key, default)
    else:
        value = getattr(cfg, key, default)
    if value is None:
        raise ValueError(f"algorithm.kl_ctrl.{key} is not set")
    return value


def make_kl_controller(cfg_dict: Any) -> FixedKLController | AdaptiveKLController:
    """The controller for the `algorithm.kl_ctrl` section {type, kl_coef, target_kl, horizon}
    (a dict, a DictConfig or a KLControlConfig). kl_coef is the (initial) beta."""
    kind = _get(cfg_dict, "type", "fixed")
    if kind == "fixed":
        return FixedKLController(float(_get(cfg_dict, "kl_coef")))
    if kind == "adaptive":
        return AdaptiveKLController(float(_get(cfg_dict, "kl_coef")), float(_get(cfg_dict, "target_kl")),
                                    int(_get(cfg_dict, "horizon")))
    raise ValueError(f"algorithm.kl_ctrl.type={kind!r} is unknown; use one of {', '.join(KL_CONTROLLERS)}")
