"""The roles a run gives its engines and its phases, named in one place.

An engine's name is ``<engine role>-<mode>`` (``patched-sync``, ``feature-off-async``); a phase's
``role`` (scenarios.json, ``PhaseRecord.role``) says what the analysis makes of it. An overhead
round's phase role names the engine variant it ran on, in the overhead's own words
(:data:`OVERHEAD_ROLE_OF_ENGINE`)."""

from __future__ import annotations

# Engine roles: the limiter on; the same with engine events off (overhead only: what recording the
# events costs); the same code with the limiter off; stock vLLM.
ENGINE_FEATURE_ON = "patched"
ENGINE_NO_EVENTS = "patched-noevents"
ENGINE_FEATURE_OFF = "feature-off"
ENGINE_STOCK = "stock"

# Phase roles.
PHASE_MEASURE = "measure"  # judged on its own (the default)
PHASE_BASELINE = "baseline"  # the same requests on the limiter-off engine, or a user alone: what isolation compares with
PHASE_SHARED = "shared"  # beside throttled users: judged against its scenario's baseline
PHASE_IDLE = "idle"  # waiting: the engine idle, probes alone (the wake-up checks' reference)
PHASE_IDLE_BEFORE = "baseline"  # PHASE_IDLE in run folders written before it had a name of its own
PHASE_STEPS = "steps"  # waiting: the engine busy, every user with budget (the waiting cost's reference)
PHASE_WAITING = "waiting"  # waiting: every request throttled, probes arriving

# An overhead round's phase role: the engine variant it measures.
OVERHEAD_ON = "feature-on"
OVERHEAD_NO_EVENTS = "feature-on-no-events"
OVERHEAD_OFF = "feature-off"
OVERHEAD_STOCK = "stock"
OVERHEAD_ROLE_OF_ENGINE = {ENGINE_FEATURE_ON: OVERHEAD_ON, ENGINE_NO_EVENTS: OVERHEAD_NO_EVENTS,
                           ENGINE_FEATURE_OFF: OVERHEAD_OFF, ENGINE_STOCK: OVERHEAD_STOCK}
