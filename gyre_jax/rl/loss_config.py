"""What one RL micro-step optimizes, as plain data: each policy loss's hyperparameters with their defaults, and
``LossConfig`` (the loss, its hyperparameters, the KL term, the train/serve mismatch corrections).

The one place for these facts: ``LOSS_PARAMS`` names every loss and its hyperparameter type, whose field
defaults *are* the loss's defaults (docs/learner.md's loss table shows them; a test compares the two);
``gyre_jax.rl.losses`` registers each loss's function under the same name (``POLICY_LOSSES``); the run config
(``config.rl``, ``gyre_jax.config.training.RLSection``) reads names, defaults and checks from here. Kept apart
from ``losses.py`` (JAX) so that the run config loads without JAX, as ``optimizer_config.py`` is.

A bad value raises ``LossConfigError``: the key, the value and the rule, in one line, with the config's prefix
when the config asks (``config.rl.clip_low=1.5 must be in [0, 1) ...``).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any


class LossConfigError(ValueError):
    """A bad loss setting: ``key`` (a ``LossConfig`` field or a hyperparameter of the loss), its value, and the
    rule it breaks. ``message(prefix)`` writes every key as ``<prefix><key>`` (the run config: ``config.rl.``)."""

    def __init__(self, key: str, value: Any, rule: str):
        self.key, self.value, self.rule = key, value, rule
        super().__init__(self.message())

    def message(self, prefix: str = "") -> str:
        return f"{prefix}{self.key}={self.value!r} {self.rule.format(prefix=prefix)}"


@dataclass(frozen=True)
class ClipRange:
    """The hyperparameters of a clipped-ratio loss: the ratio is clipped to [1 - clip_low, 1 + clip_high]."""

    clip_low: float
    clip_high: float

    def __post_init__(self):
        if not 0.0 <= self.clip_low < 1.0:  # NaN fails too
            raise LossConfigError("clip_low", self.clip_low, "must be in [0, 1) (the ratio's floor is 1 - clip_low)")
        if not self.clip_high >= 0.0:
            raise LossConfigError("clip_high", self.clip_high, "must be >= 0 (the ratio's ceiling is 1 + clip_high)")


@dataclass(frozen=True)
class GSPOParams(ClipRange):
    """GSPO and GSPO-token: the clip range of the sequence-level ratio, GSPO paper (v2, section 5.1)."""

    clip_low: float = 3e-4
    clip_high: float = 4e-4


@dataclass(frozen=True)
class GRPOParams(ClipRange):
    """GRPO: the clip range of the token-level ratio, DAPO's clip-higher (0.2 below, 0.28 above)."""

    clip_low: float = 0.2
    clip_high: float = 0.28


# The registry's data: every loss by name and its hyperparameter type (whose field defaults are its defaults).
# The first is the default loss. A new loss: its type here, its function in losses.py under @policy_loss(name),
# its row in docs/learner.md's loss table.
LOSS_PARAMS: dict[str, type[ClipRange]] = {"gspo": GSPOParams, "gspo_token": GSPOParams, "grpo": GRPOParams}
LOSSES = tuple(LOSS_PARAMS)


def _hyperparameter_types() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for params in LOSS_PARAMS.values():
        for name, hint in typing.get_type_hints(params).items():
            if out.setdefault(name, hint) != hint:
                raise TypeError(f"hyperparameter {name!r} has two types across losses: {out[name]} and {hint}")
    return out


# Every hyperparameter of any loss -> its type (the run config has one key of each: config.rl.<name>).
HYPERPARAMETERS: dict[str, Any] = _hyperparameter_types()


def check_loss(loss: str) -> None:
    if loss not in LOSS_PARAMS:
        raise LossConfigError("loss", loss, f"must be one of {LOSSES}")


def hyperparameters(loss: str, **given: Any) -> ClipRange:
    """``loss``'s hyperparameter object: its defaults, with each ``given`` value that is not None instead.

    None means "unset" (the run config's ``config.rl.clip_low = None``), so ``hyperparameters("grpo",
    clip_low=None)`` is ``GRPOParams()``. A value set for a hyperparameter the loss does not take is an error.
    """
    check_loss(loss)
    params = LOSS_PARAMS[loss]
    takes = [f.name for f in dataclasses.fields(params)]
    for key, value in given.items():
        if value is not None and key not in takes:
            raise LossConfigError(key, value, f"is not a hyperparameter of loss {loss!r} (it takes {takes}): unset it")
    return params(**{k: v for k, v in given.items() if v is not None})


def _is_cap(value: float) -> bool:
    return value == 0.0 or value > 1.0  # NaN fails both


@dataclass(frozen=True)
class LossConfig:
    """What one RL micro-step optimizes (a static, hashable part of the jitted micro-step).

    loss: a name of ``LOSSES``; params: its hyperparameters (``LOSS_PARAMS[loss]``; None = its defaults);
    kl_coef: weight of the k3 KL to a reference policy (0 = off, no reference forward pass);
    recompute_behaviour: pi_old is the trainer's own policy at step start (weights are fixed during a step, so
    that is ``stop_gradient`` of the micro-step's log-probs: no extra pass) instead of the behaviour log-probs
    mu recorded by the proxy; behaviour_is_cap: with recompute_behaviour, weight each sequence by the truncated
    importance ratio min(exp(mean_t(log pi_old - log mu)), cap) (0 = off; decoupled PPO's correction).

    Train/serve mismatch masks, on r_t = pi_train(t) / mu(t) with pi_train = ``stop_gradient`` of the
    micro-step's log-probs (0 = off, else a cap c > 1; a ratio exactly at 1/c or c is kept, NaN is out):
    is_token_mask (IcePop): a trainable token with r_t outside [1/c, c] leaves the whole objective (policy loss
    and KL); is_sequence_mask (MIS): a sequence whose geometric-mean ratio over all its trainable tokens lies
    outside [1/c, c] leaves it. Order: token mask, sequence mask, then behaviour_is_cap over the kept tokens.
    """

    loss: str = LOSSES[0]
    params: ClipRange | None = None
    kl_coef: float = 0.0
    recompute_behaviour: bool = False
    behaviour_is_cap: float = 0.0
    is_token_mask: float = 0.0
    is_sequence_mask: float = 0.0

    def __post_init__(self):
        check_loss(self.loss)
        kind = LOSS_PARAMS[self.loss]
        if self.params is None:
            object.__setattr__(self, "params", kind())
        elif type(self.params) is not kind:
            raise LossConfigError(
                "params", self.params, f"must be a {kind.__name__} (the hyperparameters of {self.loss!r})"
            )
        if not self.kl_coef >= 0.0:
            raise LossConfigError("kl_coef", self.kl_coef, "must be >= 0 (0 turns the KL term off)")
        if not self.behaviour_is_cap >= 0.0:
            raise LossConfigError("behaviour_is_cap", self.behaviour_is_cap, "must be >= 0 (0 = off)")
        if self.behaviour_is_cap > 0.0 and not self.recompute_behaviour:
            raise LossConfigError(
                "behaviour_is_cap",
                self.behaviour_is_cap,
                "needs {prefix}recompute_behaviour=True (with recorded pi_old the ratio already corrects for the "
                "behaviour policy)",
            )
        for key in ("is_token_mask", "is_sequence_mask"):
            if not _is_cap(getattr(self, key)):
                raise LossConfigError(
                    key,
                    getattr(self, key),
                    "must be 0 (off) or a cap > 1 (ratios outside [1/cap, cap] are masked); e.g. 2.0 keeps tokens "
                    "whose train/behaviour probability ratio is within a factor of 2",
                )

    @property
    def corrections(self) -> bool:
        """Whether any off-policy correction (token mask, sequence mask, behaviour_is_cap) is on."""
        return self.is_token_mask > 0.0 or self.is_sequence_mask > 0.0 or self.behaviour_is_cap > 0.0

    def describe(self) -> str:
        """One line: the loss, its hyperparameters, and every other setting that is on (for the run's log)."""
        params = ", ".join(f"{f.name}={getattr(self.params, f.name):g}" for f in dataclasses.fields(self.params))
        on = [
            f"{f.name}={v:g}" if isinstance(v, float) else f"{f.name}={v}"
            for f in dataclasses.fields(self)
            if f.name not in ("loss", "params") and (v := getattr(self, f.name)) != f.default
        ]
        return " ".join([f"{self.loss} ({params})", *on])
