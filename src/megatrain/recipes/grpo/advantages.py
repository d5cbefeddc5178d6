"""Group-relative advantages from per-function rewards, as TRL's GRPOTrainer computes them.

rewards [N, F] (N = prompts x G completions, grouped by prompt; F reward functions; NaN where a
function returned None) -> reward_n = nansum_f(weight_f * rewards[n, f]) (NaN when every
function returned None) -> advantage_n = reward_n - mean of its group, divided by
(std + 1e-4) with std the Bessel-corrected standard deviation of its group ("group") or of the
whole batch ("batch"), or not divided ("none"). NaN advantages (unscorable completions) are 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Advantages:
    advantages: list[float]  # one per completion
    rewards: list[float]  # weighted sum over functions, NaN where unscorable
    std_zero_share: float  # groups whose rewards are all equal (no learning signal), share


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Standard deviation ignoring NaNs, with Bessel's correction (TRL's nanstd)."""
    if dim is None:
        x, dim = x.reshape(-1), 0
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim)
    var = torch.nanmean((x - mean) ** 2, dim=dim) * count / (count - 1)
    return var.sqrt()


def group_advantages(
    rewards_NF: torch.Tensor, weights_F: torch.Tensor, *, num_generations: int, scaling: str
) -> Advantages:
    """See the module docstring; rows of `rewards_NF` come in groups of `num_generations`."""
    r = rewards_NF.double()
    unscorable = torch.isnan(r).all(dim=1)
    rewards = (r * weights_F.double()[None, :]).nansum(dim=1)
    rewards[unscorable] = torch.nan
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scaling == "batch":
        std = _nanstd(rewards).expand_as(rewards)
    else:
        std = _nanstd(grouped, dim=1).repeat_interleave(num_generations)
    adv = rewards - mean
    if scaling != "none":
        adv = adv / (std + 1e-4)
    adv = torch.nan_to_num(adv, nan=0.0)
    group_std = _nanstd(grouped, dim=1)
    zero = torch.isclose(group_std, torch.zeros_like(group_std)).double().mean()
    return Advantages(adv.tolist(), rewards.tolist(), float(zero))
