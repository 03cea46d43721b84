"""Preference losses on per-sequence log-probabilities: DPO (sigmoid, with label smoothing) and IPO.

Every input is a tensor with one entry per preference pair (prompt x, chosen response y_c, rejected
response y_r), each the log-probability of a whole response, summed over its tokens (the prompt's
tokens excluded, the response's EOS included):

    pi_c = log pi(y_c | x),  pi_r = log pi(y_r | x)      under the policy being trained
    ref_c, ref_r                                        the same under the frozen reference

    h = (pi_c - ref_c) - (pi_r - ref_r)                 the log-ratio margin of the pair

Losses (per pair; the caller takes the mean over a batch's pairs):

- ``sigmoid`` (DPO; Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is
  Secretly a Reward Model", eq. 7):  L = -log sigmoid(beta * h).
- ``sigmoid`` with ``label_smoothing`` = eps (conservative DPO; Mitchell 2023, "A note on DPO with
  noisy preferences & relationship to IPO"): each label is taken to be flipped with probability eps,
  L = -(1 - eps) * log sigmoid(beta * h) - eps * log sigmoid(-beta * h). eps must stay below 0.5:
  at 0.5 both orders weigh the same and the loss only pulls the margin to 0.
- ``ipo`` (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
  Preferences", eq. 17, with their tau = beta), length-averaged as TRL's DPOTrainer computes it:
  each response's log-ratio is divided by its token count n_c, n_r (EOS included),
      h_avg = (pi_c - ref_c) / n_c - (pi_r - ref_r) / n_r,   L = (h_avg - 1 / (2 * beta))^2,
  a squared loss that regresses the per-token margin to 1 / (2 beta) instead of pushing it without
  bound. On summed log-probs the squared loss and its target would scale with the response length,
  so a beta from a TRL recipe would mean another objective (TRL's code says the IPO authors confirmed
  the per-token form is the one their paper's results used).

Metrics (the names TRL logs): the implicit rewards r = beta * (pi - ref) of Rafailov et al. (sec. 5),
rewards/chosen = beta (pi_c - ref_c), rewards/rejected = beta (pi_r - ref_r), rewards/margins =
their difference (= beta h), rewards/accuracies = [rewards/chosen > rewards/rejected] (the
preference accuracy; 0 for a policy equal to its reference), logps/chosen = pi_c, logps/rejected =
pi_r; and logps/accuracies = [pi_c > pi_r], whether the policy on its own ranks the chosen response
higher (independent of the reference, so it says something before training too).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LOSS_TYPES = ("sigmoid", "ipo")


def preference_margin(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
                      ref_rejected: torch.Tensor) -> torch.Tensor:
    """h = (pi_c - ref_c) - (pi_r - ref_r) per pair."""
    return (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0, chosen_tokens: torch.Tensor | None = None,
             rejected_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Per-pair loss (differentiable in the policy's log-probs); see the module docstring. ipo needs
    each response's token count (chosen_tokens, rejected_tokens: its log-ratio is averaged over it)."""
    if beta <= 0:
        raise ValueError(f"beta={beta}: must be > 0")
    if loss_type == "ipo":
        if label_smoothing:
            raise ValueError("label_smoothing applies to loss_type=sigmoid only")
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("loss_type=ipo averages each response's log-ratio over its tokens: pass chosen_tokens "
                             "and rejected_tokens")
        n_c = chosen_tokens.to(policy_chosen.dtype).clamp(min=1)
        n_r = rejected_tokens.to(policy_rejected.dtype).clamp(min=1)
        h_avg = (policy_chosen - ref_chosen) / n_c - (policy_rejected - ref_rejected) / n_r
        return (h_avg - 1.0 / (2.0 * beta)).square()
    h = preference_margin(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    if loss_type == "sigmoid":
        if not 0.0 <= label_smoothing < 0.5:
            raise ValueError(f"label_smoothing={label_smoothing}: must be >= 0 and < 0.5")
        # logsigmoid is the stable form of log(sigmoid(x)) for large |x|
        loss = -F.logsigmoid(beta * h)
        if label_smoothing:
            loss = (1.0 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-beta * h)
        return loss
    raise ValueError(f"unknown DPO loss_type {loss_type!r}: use one of {', '.join(LOSS_TYPES)}")


def dpo_pair_stats(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
                   ref_rejected: torch.Tensor, beta: float) -> dict[str, torch.Tensor]:
    """Per-pair values of the metrics (detached, float64), named as in the module docstring."""
    pc, pr = policy_chosen.detach().double(), policy_rejected.detach().double()
    rc = beta * (pc - ref_chosen.detach().double())
    rr = beta * (pr - ref_rejected.detach().double())
    return {"rewards/chosen": rc, "rewards/rejected": rr, "rewards/margins": rc - rr,
            "rewards/accuracies": (rc > rr).double(), "logps/chosen": pc, "logps/rejected": pr,
            "logps/accuracies": (pc > pr).double()}


def dpo_metrics(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
                ref_rejected: torch.Tensor, beta: float, loss_type: str = "sigmoid",
                label_smoothing: float = 0.0, chosen_tokens: torch.Tensor | None = None,
                rejected_tokens: torch.Tensor | None = None) -> dict[str, float]:
    """Means over the pairs: loss and every metric of `dpo_pair_stats`, plus the number of pairs. The
    metrics are on the summed log-probs for every loss type (as TRL logs them)."""
    with torch.no_grad():
        loss = dpo_loss(policy_chosen.double(), policy_rejected.double(), ref_chosen.double(),
                        ref_rejected.double(), beta, loss_type, label_smoothing, chosen_tokens, rejected_tokens)
        out = {"loss": float(loss.mean())}
        out.update({k: float(v.mean()) for k, v in dpo_pair_stats(policy_chosen, policy_rejected, ref_chosen,
                                                                   ref_rejected, beta).items()})
    out["pairs"] = float(loss.numel())
    return out
