"""The thresholds table: every threshold a check uses, with its default, its ``verify-bound`` option, the
unit that option takes, its help and the promise whose checks it sets. Each is declared once, as a field of
:class:`ratebench.analysis.verdict.Thresholds` (``verdict.threshold``); this module reads the rows from
those fields. The options of ``verify-bound`` are made from the table (``ratebench/cli/verify.py``), and so
are the Thresholds a command line asks for (:func:`from_options`) and the parameters through which a
profile sets a threshold for one scenario's phases (:func:`phase_params`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ratebench.analysis.verdict import THRESHOLD_ROW, Thresholds

_NS_PER = {"": 1, "ms": 1_000_000, "us": 1_000}


@dataclass(frozen=True)
class Threshold:
    """One threshold: the Thresholds field, its option, the option's unit ("" the field's own; "ms" or
    "us" for a field in nanoseconds), its help and the promise (a key of the promise table) it guards."""

    field: str
    option: str
    help: str
    promise: str
    unit: str = ""
    # a profile may set it for one scenario's phases: that scenario parameter (in the option's unit, the
    # profile schema's type ``phase_type``), combined with the command line's by ``phase_rule``: "wider"
    # the larger of the two; "unless-given" the parameter's, unless the command line gives one
    phase_param: str | None = None
    phase_type: str = ""
    phase_rule: str = "wider"

    @property
    def scale(self) -> int:
        return _NS_PER[self.unit]

    @property
    def optional(self) -> bool:
        return "None" in str(_FIELDS[self.field].type)

    @property
    def type(self) -> type:
        """What the option takes: a float for a field given in ms or us, else the field's own type."""
        return float if self.unit or "float" in str(_FIELDS[self.field].type) else int

    @property
    def default(self) -> float | int | None:
        """The Thresholds default, in the option's unit."""
        value = _FIELDS[self.field].default
        if value is None or not self.unit:
            return value
        return value / self.scale

    @property
    def param(self) -> str:
        """The option's Python parameter name."""
        return self.option.lstrip("-").replace("-", "_")


_FIELDS = {f.name: f for f in dataclasses.fields(Thresholds)}

# One row per Thresholds field declared with verdict.threshold, in the fields' order.
TABLE: tuple[Threshold, ...] = tuple(
    Threshold(f.name, **f.metadata[THRESHOLD_ROW]) for f in dataclasses.fields(Thresholds)
    if THRESHOLD_ROW in f.metadata)

# Thresholds fields that are no command-line option: the bound's burst is the promise's 100 ms
# (docs/promise.md, section 1), never what an engine's header says it ran (engine-as-asked holds the header to it).
NOT_OPTIONS = ("burst_ns",)

DEFAULT_TRACE_LATENESS_NS = 20_000_000  # trace_lateness_ns when neither the command line nor the phase sets it
_BY_FIELD = {t.field: t for t in TABLE}


def phase_params(*fields: str) -> dict[str, tuple[str, Any]]:
    """A scenario kind's PARAMS entries for the thresholds its profile may set per phase (the table's
    ``phase_param`` of each field, left unset by default)."""
    return {_BY_FIELD[f].phase_param: (_BY_FIELD[f].phase_type, None) for f in fields}  # type: ignore[misc]


def phase_param_of(field: str) -> str | None:
    """The scenario parameter through which a profile sets threshold ``field`` per phase (None: none)."""
    return _BY_FIELD[field].phase_param


def for_phase(th: Thresholds, field: str, params: dict[str, Any]) -> Any:
    """The threshold ``field`` for a phase whose scenario parameters are ``params``: the command line's
    (``th``) and the phase's (its ``phase_param``, in the option's unit) combined by the row's rule."""
    t = _BY_FIELD[field]
    given = getattr(th, field)
    raw = params.get(t.phase_param) if t.phase_param else None
    own = None if raw is None else (round(float(raw) * t.scale) if t.unit else t.type(raw))
    if t.phase_rule == "unless-given":
        return given if given is not None else own
    if own is None:
        return given
    return own if given is None else max(given, own)


def from_options(values: dict[str, Any]) -> Thresholds:
    """The Thresholds of a command line: ``values`` by parameter name (:attr:`Threshold.param`), in the
    options' units; a threshold left out keeps its default."""
    fields: dict[str, Any] = {}
    for t in TABLE:
        if t.param not in values:
            continue
        value = values[t.param]
        fields[t.field] = value if value is None or not t.unit else round(value * t.scale)
    return Thresholds(**fields)
