"""Exit rules of adaptive depth (docs/model.md, "Adaptive depth"): when a token's loop
stops before the depth of its sequence. One ExitRule fills the C `tl_exit_rule` of a
generation or a scoring call; the front ends (CLI `--exit`, TOML `[exit]`, the server's
`exit` field) all parse through ExitRule.parse.

    ExitRule.parse("kl:1e-3")              # KL of successive iterations < 1e-3 nats
    ExitRule.parse("argmax_stable:3")      # the same top token for 3 iterations
    ExitRule.parse("gate:0.9,min_depth=2") # the model's exit gate; no exit before 2
    ExitRule.parse({"rule": "latent_delta", "threshold": 0.05})
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import InvalidArgumentError

#: rule name -> tl_exit_kind (tinyloop.h)
EXIT_KINDS = {"fixed": 0, "kl": 1, "entropy_delta": 2, "latent_delta": 3, "argmax_stable": 4,
              "gate": 5}
#: the rules that compare against a threshold (argmax_stable counts iterations, fixed
#: never exits)
THRESHOLD_RULES = ("kl", "entropy_delta", "latent_delta", "gate")
#: the rules that read each iteration's next-token distribution, a probe through the coda
#: and head whose K/V the other rows of the same forward call see (docs/model.md,
#: "Adaptive depth"): their depths depend on how the sequence was split into calls
PROBE_RULES = ("kl", "entropy_delta", "argmax_stable")
_KEYS = ("rule", "threshold", "min_depth", "patience")
_INT32_MAX = 2**31 - 1


class ExitRuleError(InvalidArgumentError):
    """A bad exit rule. `.key` is the field at fault (e.g. "exit.threshold"), `.problem`
    what is wrong with it; the message says both."""

    def __init__(self, key: str, problem: str):
        super().__init__(f"{key}: {problem}")
        self.key, self.problem = key, problem


@dataclass(frozen=True)
class ExitRule:
    """kind: one of EXIT_KINDS; threshold: kl / entropy_delta (nats), latent_delta (a
    relative change) or gate (an exit CDF in (0, 1]); min_depth: no exit before this
    iteration; patience: argmax_stable's iterations. Build one with parse() to have it
    checked; the constructor checks too."""

    kind: str = "fixed"
    threshold: float = 0.0
    min_depth: int = 1
    patience: int = 2

    def __post_init__(self) -> None:
        values = _checked(self.kind, self.threshold, self.min_depth, self.patience, field="exit")
        for key, value in zip(("kind", "threshold", "min_depth", "patience"), values):
            object.__setattr__(self, key, value)   # normalised: 1 -> 1.0, numpy ints -> int

    @property
    def active(self) -> bool:
        """Whether the rule may stop a token's loop early (not `fixed`)."""
        return self.kind != "fixed"

    @property
    def probes(self) -> bool:
        """Whether the rule reads each iteration's next-token distribution (PROBE_RULES)."""
        return self.kind in PROBE_RULES

    def __str__(self) -> str:
        """The string parse() reads back, e.g. "kl:0.001" or "argmax_stable:3,min_depth=2"."""
        if self.kind == "fixed":
            text = "fixed"
        elif self.kind == "argmax_stable":
            text = f"argmax_stable:{self.patience}"
        else:
            text = f"{self.kind}:{self.threshold!r}"
        return text + (f",min_depth={self.min_depth}" if self.min_depth != 1 else "")

    def as_dict(self) -> dict[str, Any]:
        """The rule as the dict form parse() reads (what --json and logs show)."""
        out: dict[str, Any] = {"rule": self.kind}
        if self.kind in THRESHOLD_RULES:
            out["threshold"] = self.threshold
        if self.kind == "argmax_stable":
            out["patience"] = self.patience
        if self.kind != "fixed":
            out["min_depth"] = self.min_depth
        return out

    def fill(self, c_rule: Any) -> None:
        """Set a cffi `tl_exit_rule` (a struct field such as opts.exit) to this rule."""
        c_rule.kind = EXIT_KINDS[self.kind]
        c_rule.threshold = self.threshold
        c_rule.min_depth = self.min_depth
        c_rule.patience = self.patience

    @classmethod
    def parse(cls, value: Any, field: str = "exit") -> "ExitRule":
        """An ExitRule from "RULE[:VALUE][,min_depth=N][,patience=N]" (VALUE: the threshold,
        or argmax_stable's patience), from a mapping {"rule", "threshold", "min_depth",
        "patience"}, or an ExitRule as is. ExitRuleError names `field` (or its key)."""
        if isinstance(value, ExitRule):
            return value
        if isinstance(value, str):
            return _from_mapping(_split(value, field), field)
        if isinstance(value, Mapping):
            return _from_mapping(value, field)
        raise ExitRuleError(field, 'must be a string such as "kl:1e-3" or an object with "rule" '
                                   f"and \"threshold\", got {type(value).__name__}")


def exit_rule(value: Any, field: str = "exit") -> ExitRule | None:
    """ExitRule.parse(value), or None for None (no rule given)."""
    return None if value is None else ExitRule.parse(value, field)


def _split(text: str, field: str) -> dict[str, Any]:
    """The mapping form of "RULE[:VALUE][,key=N]...": VALUE is the threshold, or the
    patience for argmax_stable."""
    head, *extras = [part.strip() for part in text.split(",")]
    rule, colon, number = (s.strip() for s in head.partition(":"))
    table: dict[str, Any] = {"rule": rule}
    if colon:
        if not number:
            raise ExitRuleError(field, f"{text!r}: nothing after {rule + ':'!r} (e.g. kl:1e-3)")
        key = "patience" if rule == "argmax_stable" else "threshold"
        table[key] = _number(number, f"{field}.{key}", integer=key == "patience")
    for extra in extras:
        key, eq, number = (s.strip() for s in extra.partition("="))
        if not eq or key not in ("min_depth", "patience"):
            raise ExitRuleError(field, f"{text!r}: {extra!r} is not min_depth=N or patience=N")
        if key in table:
            raise ExitRuleError(f"{field}.{key}", f"given twice in {text!r}")
        table[key] = _number(number, f"{field}.{key}", integer=True)
    return table


def _number(text: str, key: str, integer: bool) -> int | float:
    try:
        return int(text) if integer else float(text)
    except ValueError:
        raise ExitRuleError(key, f"{text!r} is not {'an integer' if integer else 'a number'}") from None


def _from_mapping(table: Mapping[str, Any], field: str) -> ExitRule:
    unknown = [k for k in table if k not in _KEYS]
    if unknown:
        raise ExitRuleError(f"{field}.{unknown[0]}", f"unknown key (allowed: {', '.join(_KEYS)})")
    kind = table.get("rule")
    if kind is None:
        raise ExitRuleError(f"{field}.rule", f"missing (one of {', '.join(EXIT_KINDS)})")
    _check_kind(kind, field)
    if kind in THRESHOLD_RULES and table.get("threshold") is None:
        raise ExitRuleError(f"{field}.threshold", f"rule {kind} needs a threshold (e.g. {kind}:"
                                                  f"{'0.9' if kind == 'gate' else '1e-3'})")
    for key, wrong in (("threshold", kind not in THRESHOLD_RULES), ("patience", kind != "argmax_stable")):
        if wrong and table.get(key) is not None:
            raise ExitRuleError(f"{field}.{key}", f"rule {kind} takes no {key}"
                                + (" (argmax_stable:N sets its patience)" if kind == "argmax_stable" else ""))
    values = {k: table[k] for k in ("threshold", "min_depth", "patience") if table.get(k) is not None}
    # checked here, so that errors name `field`; the constructor's check then passes
    return ExitRule(*_checked(kind, **values, field=field))


def _check_kind(kind: Any, field: str) -> None:
    if not isinstance(kind, str) or kind not in EXIT_KINDS:
        raise ExitRuleError(f"{field}.rule", f"must be one of {', '.join(EXIT_KINDS)}, got {kind!r}")


def _checked(kind: Any, threshold: Any = 0.0, min_depth: Any = 1, patience: Any = 2, *,
             field: str) -> tuple[str, float, int, int]:
    """(kind, threshold, min_depth, patience) typed (a float threshold, int depths) and in
    range, else ExitRuleError naming `field.key`."""
    _check_kind(kind, field)
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real):
        raise ExitRuleError(f"{field}.threshold", f"must be a number, got {type(threshold).__name__}")
    threshold = float(threshold)
    if not math.isfinite(threshold) or threshold < 0:
        raise ExitRuleError(f"{field}.threshold", f"must be a finite number >= 0, got {threshold}")
    if kind == "gate" and not 0 < threshold <= 1:
        raise ExitRuleError(f"{field}.threshold",
                            f"the gate's exit CDF threshold must be in (0, 1], got {threshold}")
    for key, value in (("min_depth", min_depth), ("patience", patience)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ExitRuleError(f"{field}.{key}", f"must be an integer, got {type(value).__name__}")
        if not 1 <= int(value) <= _INT32_MAX:
            raise ExitRuleError(f"{field}.{key}", f"must be in [1, {_INT32_MAX}], got {value}")
    return kind, float(threshold), int(min_depth), int(patience)
