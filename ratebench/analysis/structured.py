"""Structured answers (promise 3): an answer constrained by a grammar or a token set, paused for budget and
resumed, still obeys its constraint.

vLLM constrains a structured request (a JSON schema, a JSON object, a regex, a choice) with a grammar
matcher that lives in the scheduler: each step the matcher, advanced by every token the request got,
gives the mask of the tokens allowed next. The limiter parks such a request, gives its token back at
the refund point, moves it out of its slot, preempts it and recomputes it: a mistake in any of these
that advances the matcher twice, rolls it back, or masks the next token with another request's row
leaves the answer as long and as well timed as before (the bound, spacing and reconciliation pass),
and vLLM's own check accepts it (the engine's matcher is the one that went wrong). Only the answer's
tokens, fed to a fresh matcher of the same constraint, show it.

Which requests: the ``request-options`` phases, whose parameter ``option_bodies`` gives each stream's
option and the request body fields it sent (by ``stream_index``). For each answer with token ids
(``return_token_ids``) and no error:

* ``response_format`` ``json_schema`` / ``json_object``, ``structured_outputs`` ``json`` / ``regex`` /
  ``choice`` / ``grammar``: a fresh xgrammar matcher, compiled as vLLM 0.32.0's xgrammar backend compiles
  it (any whitespace in JSON; a choice as the grammar ``root ::= "a" | "b"``), with the engine's stop
  tokens (``model_stop_token_ids`` of the manifest) as the grammar's ends, must accept every token up to
  the one that ends the grammar. After that the answer is free (the request runs to ``max_tokens`` with
  ``ignore_eos``, and vLLM no longer masks a finished grammar).
* ``allowed_token_ids``: every token is one of them.
* ``bad_words``: no token completes a bad word's token sequence within the answer. The words are
  expanded as vLLM 0.32.0's ``SamplingParams.update_from_tokenizer`` expands them (each word as is and
  with a leading space, the spaced form kept when it is a new word token of the same length), and
  banned as its sampler bans them: a sequence's last token after its other tokens, all among the
  answer's tokens (the prompt's are not looked at). The ban lives in the model runner's persistent batch,
  per row: a limiter that parks a request out of the batch and brings it back without its sampling
  state, or with another row's, lets a bad word through.
* ``min_tokens``: none of the answer's first ``min_tokens`` tokens is a stop token (the engine's, the
  manifest's ``model_stop_token_ids``, and the request's ``stop_token_ids``): vLLM masks them until the
  answer has that many, ``ignore_eos`` or not (its min-tokens logits processor, also per row of the
  persistent batch).

* ``logit_bias`` with token ids biased by -100 (vLLM's lowest; the request-options scenario's
  ``banned_token_ids``): none of them in the answer. Greedy sampling never picks a token 100 below the
  others on any model's logits; the bias lives in a logits processor fed row by row as the model runner
  adds requests to its persistent batch, which a parked request leaves and comes back to.

* additive penalties (``presence_penalty``, ``frequency_penalty``; greedy, no repetition penalty): the
  answer is greedy under them. The run sends it after its prompt to the same engine (``prompt_logprobs``:
  the raw logprobs of the likeliest tokens and of the answer's own, per position; phase params
  ``penalty_scores``); applied to those, no token beats the answer's by more than the tolerance.
* a repetition penalty (greedy, no additive penalty): it scales a logit by its sign, which logprobs (the
  logit less a constant) do not give, so the verifier cannot apply it. The run asks the same engine again
  at every position instead: one greedy token after the prompt and the answer's first j tokens, under the
  request's penalty and a small bias towards the answer's token j (phase params ``repetition_probes``); each
  probe must pick the answer's token. A request brought back without its penalty answers with a token the
  penalty held back, which the probes, fresh requests, do not pick.

Other options (milder logit biases, stop strings, logprobs) shape or report the distribution without a rule an answer can be held to
alone; answers-intact compares greedy answers of plain requests with the limiter-off engine's.

The tokenizer is the served model's (the manifest's ``model_path``; transformers and xgrammar, both
installed with vLLM). Where it or xgrammar cannot be loaded, or a run folder predates
``option_bodies``, the check says why it was not made. Figures only; the check module applies the
rule (no answer may break its constraint).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from ratebench.analysis.load import RunData

KIND_REQUEST_OPTIONS = "request-options"
_NO_TOKENIZER = ("allowed", "banned", "penalties", "repetition", "min_tokens")  # constraints judged on token ids alone
BAN_BIAS = -100.0  # vLLM clamps logit_bias to [-100, 100]: at -100 greedy sampling never picks the token
# nats a penalised answer's token may score below the best token of its row (ties: the engine's batch changes
# the rounding of bfloat16 logits, as answers-intact allows; the check passes --answers-logprob-tol)
PENALTY_TOL = 0.05
SNIPPET = 8  # tokens shown before the first one refused


@dataclass
class Broken:
    client_id: str
    user: str | None
    option: str
    position: int  # index of the first token the constraint refuses
    token: int
    before: list[int]  # the tokens before it (the last SNIPPET)
    text: str  # the answer's text up to and with that token, as the tokenizer decodes it
    why: str = "which a fresh matcher of its constraint refuses"


@dataclass
class PhaseConformance:
    scenario: str
    phase: str
    engine: str
    checked: int = 0  # answers held to their constraint
    tokens: int = 0  # tokens of those answers held to it (up to where each grammar ended)
    options: list[str] = field(default_factory=list)  # the constrained options seen
    broken: list[Broken] = field(default_factory=list)
    without_ids: int = 0  # constrained answers that came without token ids (not checked)
    errors: int = 0  # constrained answers answered with an error (reconciliation judges those)
    not_made: str | None = None  # why no answer of the phase could be checked
    # penalised answers the run could not score (the scoring request failed): failed, not passed
    unscored: int = 0
    unscored_why: str | None = None


def constraint_of(body: dict[str, Any]) -> tuple[str, Any] | None:
    """(kind, spec) of a request body's constraint: ``json``, ``json_object``, ``regex``, ``choice``,
    ``grammar`` (a grammar matcher), ``allowed`` (a token set), ``bad_words`` (words banned), ``banned``
    (token ids a logit bias of -100 bans), ``penalties`` (additive presence and frequency penalties, held to
    the model's raw scores) or ``min_tokens`` (its number and the request's own stop token ids: stop tokens
    masked until then); None when the body has none."""
    rf = body.get("response_format")
    if isinstance(rf, dict):
        if rf.get("type") == "json_schema":
            js = rf.get("json_schema") or {}
            schema = js.get("schema", js.get("json_schema"))
            if schema is not None:
                return "json", schema
        if rf.get("type") == "json_object":
            return "json_object", None
    so = body.get("structured_outputs") or body.get("guided_decoding")
    if isinstance(so, dict):
        for kind in ("json", "regex", "choice", "grammar"):
            if so.get(kind) is not None:
                return kind, so[kind]
        if so.get("json_object"):
            return "json_object", None
    if body.get("allowed_token_ids"):
        return "allowed", [int(t) for t in body["allowed_token_ids"]]
    if body.get("bad_words"):
        return "bad_words", [str(w) for w in body["bad_words"]]
    bias = body.get("logit_bias")
    if isinstance(bias, dict):
        banned = sorted(int(t) for t, b in bias.items() if isinstance(b, (int, float)) and b <= BAN_BIAS)
        if banned:
            return "banned", banned
    presence, frequency = float(body.get("presence_penalty") or 0), float(body.get("frequency_penalty") or 0)
    repetition = float(body.get("repetition_penalty") or 1)
    greedy = float(body.get("temperature", 0) or 0) == 0
    if (presence or frequency) and repetition == 1 and greedy:
        return "penalties", (presence, frequency)
    if repetition != 1 and not (presence or frequency) and greedy:
        return "repetition", repetition
    if body.get("min_tokens"):
        return "min_tokens", (int(body["min_tokens"]), [int(t) for t in body.get("stop_token_ids") or []])
    return None


class _Grammars:
    """A tokenizer, its xgrammar compiler, and compiled grammars, for one model folder."""

    def __init__(self, model_path: str) -> None:
        import xgrammar as xgr
        from transformers import AutoTokenizer

        self.xgr = xgr
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        vocab_size = None
        config = Path(model_path) / "config.json"
        if config.is_file():
            vocab_size = json.loads(config.read_text()).get("vocab_size")
        info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=vocab_size or len(self.tokenizer))
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._compiled: dict[tuple[str, str], Any] = {}

    def compiled(self, kind: str, spec: Any):
        key = (kind, json.dumps(spec, sort_keys=True))
        if key not in self._compiled:
            c = self.compiler
            if kind == "json":
                text = spec if isinstance(spec, str) else json.dumps(spec)
                self._compiled[key] = c.compile_json_schema(text, any_whitespace=True)
            elif kind == "json_object":
                self._compiled[key] = c.compile_json_schema('{"type": "object"}', any_whitespace=True)
            elif kind == "regex":
                self._compiled[key] = c.compile_regex(spec)
            elif kind == "choice":
                self._compiled[key] = c.compile_grammar(_choice_grammar([str(x) for x in spec]))
            elif kind == "grammar":
                self._compiled[key] = c.compile_grammar(spec)
            else:
                raise ValueError(f"no grammar for {kind!r}")
        return self._compiled[key]

    def bad_word_sequences(self, words: list[str]) -> list[list[int]]:
        """vLLM 0.32.0's expansion of ``bad_words`` into token sequences (``update_from_tokenizer``)."""
        out: list[list[int]] = []
        for word in words:
            for prefix in ("", " "):
                ids = list(self.tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))
                if not ids:
                    continue
                if not prefix or (out and ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                    out.append(ids)
        return out

    def first_refused(self, kind: str, spec: Any, tokens: list[int], stop_ids: list[int]) -> tuple[int | None, int]:
        """(index of the first token the grammar refuses or None, tokens held to it: up to the token that
        ends the grammar)."""
        matcher = self.xgr.GrammarMatcher(self.compiled(kind, spec), override_stop_tokens=stop_ids or None)
        for i, t in enumerate(tokens):
            if not matcher.accept_token(t):
                return i, i + 1
            if matcher.is_terminated():
                return None, i + 1
        return None, len(tokens)


def _choice_grammar(choices: list[str]) -> str:
    """vLLM 0.32.0's ``choice_as_grammar``: ``root ::= "a" | "b"``, the literals escaped for EBNF."""
    escapes = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}

    def esc(ch: str) -> str:
        if ch in escapes:
            return escapes[ch]
        if ord(ch) < 0x20 or ord(ch) == 0x7F:
            return f"\\u{ord(ch):04x}"
        return ch

    return "root ::= " + " | ".join('"' + "".join(esc(ch) for ch in c) + '"' for c in choices)


@lru_cache(maxsize=4)
def _grammars(model_path: str) -> _Grammars:
    return _Grammars(model_path)


def structured_conformance(run: RunData, tol: float = PENALTY_TOL) -> list[PhaseConformance]:
    """Per request-options phase: its constrained answers held to their constraints (``tol``: nats a
    penalised answer's token may score below the best, for ties)."""
    phases = [p for p in run.phases if p.kind == KIND_REQUEST_OPTIONS]
    if not phases:
        return []
    model_path = run.manifest.get("model_path")
    stop_ids = [int(t) for t in (run.manifest.get("model_stop_token_ids") or [])]
    grammars: _Grammars | None = None
    load_problem: str | None = None
    out = []
    for ph in phases:
        pc = PhaseConformance(ph.scenario, ph.phase, ph.engine)
        out.append(pc)
        bodies = ph.params.get("option_bodies")
        if not isinstance(bodies, list):
            pc.not_made = "the phase does not record its streams' options (a run folder from before option_bodies)"
            continue
        constraints: dict[int, tuple[str, str, Any]] = {}
        for i, entry in enumerate(bodies):
            if isinstance(entry, dict) and isinstance(entry.get("body"), dict):
                c = constraint_of(entry["body"])
                if c is not None:
                    constraints[i] = (str(entry.get("option", i)), *c)
        pc.options = [constraints[i][0] for i in sorted(constraints)]
        if not constraints:
            pc.not_made = "no stream of the phase carried a constraint an answer can be held to"
            continue
        records = [r for r in run.records if (r.scenario, r.phase, r.engine) == ph.key
                   and r.stream_index in constraints]
        needs_grammar = any(constraints[r.stream_index][1] not in _NO_TOKENIZER for r in records)
        if needs_grammar and grammars is None and load_problem is None:
            if not model_path or not Path(model_path).is_dir():
                load_problem = f"the served model's folder is not here ({model_path or 'none in the manifest'})"
            else:
                try:
                    grammars = _grammars(str(model_path))
                except Exception as exc:  # noqa: BLE001 - any failure to load is reported, not raised
                    load_problem = f"could not load the model's tokenizer or xgrammar ({type(exc).__name__}: {exc})"
        for r in records:
            option, kind, spec = constraints[r.stream_index]
            if r.error is not None:
                pc.errors += 1
                continue
            if r.token_ids is None:
                pc.without_ids += 1
                continue
            if kind not in _NO_TOKENIZER and grammars is None:
                continue
            if kind == "min_tokens" and not stop_ids:
                pc.not_made = pc.not_made or "the manifest names no stop tokens (model_stop_token_ids) to hold " \
                                             "min_tokens answers to"
                continue
            why = "which a fresh matcher of its constraint refuses"
            if kind == "allowed":
                at, held = _first_not_allowed(spec, list(r.token_ids))
                why = "which is not among its allowed token ids"
            elif kind == "bad_words":
                at, held, seq = first_bad_word(grammars.bad_word_sequences(spec), list(r.token_ids))
                why = f"which completes a bad word of {spec} as vLLM bans it (the token sequence {seq})"
            elif kind == "banned":
                at, held = _first_banned(spec, list(r.token_ids))
                why = f"which its logit bias of {BAN_BIAS:g} bans (token ids {spec})"
            elif kind in ("penalties", "repetition"):
                probes = ph.params.get("repetition_probes") or {}
                rows = ((ph.params.get("penalty_scores") or {}) if kind == "penalties"
                        else (probes.get("tokens") or {})).get(str(r.stream_index))
                if not isinstance(rows, list) or len(rows) != len(r.token_ids):
                    # not scored: counted, and failed (the check module)
                    pc.unscored += 1
                    unscored = ph.params.get("penalty_scores_unscored") or {}
                    recorded = "scores" if kind == "penalties" else "repetition probes"
                    pc.unscored_why = pc.unscored_why or str(unscored.get("first") or
                                                             f"{r.client_id}: no {recorded} recorded for its tokens")
                    continue
                if kind == "penalties":
                    at, held, why = first_beaten_under_penalties(spec, list(r.token_ids), rows, tol)
                else:
                    at, held, why = first_not_picked_again(spec, float(probes.get("bias") or 0), list(r.token_ids),
                                                           [int(t) for t in rows])
            elif kind == "min_tokens":
                at, held = first_early_stop(spec[0], set(stop_ids) | set(spec[1]), list(r.token_ids))
                why = f"a stop token among its first {spec[0]} tokens, which min_tokens masks"
            else:
                at, held = grammars.first_refused(kind, spec, list(r.token_ids), stop_ids)
            pc.checked += 1
            pc.tokens += held
            if at is not None:
                text = ""
                if grammars is not None:
                    text = grammars.tokenizer.decode(r.token_ids[:at + 1])
                pc.broken.append(Broken(r.client_id, r.user, option, at, int(r.token_ids[at]),
                                        list(r.token_ids[max(0, at - SNIPPET):at]), text, why))
        if not pc.checked and pc.not_made is None:
            pc.not_made = load_problem or ("no constrained answer came with token ids" if pc.without_ids
                                           else "no constrained answer without an error")
    return out


def _first_not_allowed(allowed_ids: list[int], tokens: list[int]) -> tuple[int | None, int]:
    """(index of the first token outside ``allowed_ids`` or None, tokens held to the set); no tokenizer."""
    allowed = set(allowed_ids)
    return _first_where(lambda t: t not in allowed, tokens)


def _first_banned(banned_ids: list[int], tokens: list[int]) -> tuple[int | None, int]:
    """(index of the first token among ``banned_ids`` or None, tokens held to the ban); no tokenizer."""
    banned = set(banned_ids)
    return _first_where(banned.__contains__, tokens)


def _first_where(refused, tokens: list[int]) -> tuple[int | None, int]:
    for i, t in enumerate(tokens):
        if refused(t):
            return i, i + 1
    return None, len(tokens)


def first_bad_word(sequences: list[list[int]], tokens: list[int]) -> tuple[int | None, int, list[int] | None]:
    """(index of the first token that completes one of ``sequences`` within ``tokens``, or None; tokens
    held to the ban; the sequence it completes): vLLM's sampler bans a sequence's last token when the
    tokens before it are the sequence's others, among the answer's own tokens."""
    for i in range(len(tokens)):
        for seq in sequences:
            n = len(seq)
            if n - 1 <= i and tokens[i] == seq[-1] and tokens[i - n + 1:i] == seq[:-1]:
                return i, i + 1, seq
    return None, len(tokens), None


def first_beaten_under_penalties(spec: tuple[float, float], tokens: list[int], rows: list[dict[str, float]],
                                 tol: float) -> tuple[int | None, int, str]:
    """(index of the first token another beat by more than ``tol`` nats once the penalties are applied, or
    None; tokens held; why). ``rows``: per token, the raw logprobs of the likeliest tokens there and of the
    answer's own (``ratebench.answerscore.penalty_rows``). vLLM subtracts from a token's logit
    ``presence * [count > 0] + frequency * count``, its count among the answer's tokens before; a logprob
    differs from its logit by the same constant for every token of a row, so the penalised logprobs order
    the tokens as the penalised logits do. Greedy picks the best of them; a token of the row better by more
    than ``tol`` shows the answer was not sampled under its penalties (tokens outside the row score lower
    raw, and may only be lower still penalised, so they are never needed to prove a fault)."""
    presence, frequency = spec
    counts: dict[int, int] = {}
    for j, token in enumerate(tokens):
        row = rows[j]

        def penalised(t: int, lp: float) -> float:
            c = counts.get(t, 0)
            return lp - (presence if c else 0.0) - frequency * c

        own = penalised(token, row[str(token)])
        best_t, best = max(((int(t), penalised(int(t), lp)) for t, lp in row.items()), key=lambda x: x[1])
        if best - own > tol:
            return j, j + 1, (f"which token {best_t} beat by {best - own:.2f} nats once its penalties (presence "
                              f"{presence:g}, frequency {frequency:g}) were applied to the model's scores (the "
                              f"answer had said {token} {counts.get(token, 0)} times and {best_t} "
                              f"{counts.get(best_t, 0)} times before): the request was not sampled under them")
        counts[token] = counts.get(token, 0) + 1
    return None, len(tokens), ""


def first_not_picked_again(penalty: float, bias: float, tokens: list[int], picked: list[int]
                           ) -> tuple[int | None, int, str]:
    """(index of the first token the engine did not pick again, or None; tokens held; why). ``picked[j]``:
    the engine's greedy token after the prompt and ``tokens[:j]``, under the request's repetition penalty and
    ``bias`` more logit bias on ``tokens[j]`` (``ratebench.answerscore.repetition_probe_body``). vLLM scales
    the logit of every token of the prompt or the answer so far (divided by the penalty where positive,
    multiplied where not; a count does not matter, so the probe's prompt carries the same history), then
    picks the best. A correct answer's token was the best under its penalty, up to the batch's rounding,
    and with the bias it stays the best; a probe that picks another token saw it beat the answer's by more
    than the bias scaled by the penalty (at least ``bias / penalty`` nats): the answer was not sampled
    under its penalty, or not on its history."""
    for j, (token, again) in enumerate(zip(tokens, picked)):
        if again != token:
            return j, j + 1, (f"which the engine, asked again after the same prompt and answer so far under the "
                              f"request's repetition penalty ({penalty:g}) with {bias:g} more logit bias on it, "
                              f"does not pick (it picks {again}; the answer had said {token} {tokens[:j].count(token)} "
                              f"times and {again} {tokens[:j].count(again)} times before): the request was not "
                              f"sampled under its penalty")
    return None, len(tokens), ""


def first_early_stop(min_tokens: int, stop_ids: set[int], tokens: list[int]) -> tuple[int | None, int]:
    """(index of the first stop token among the first ``min_tokens`` tokens, or None; tokens held)."""
    for i, t in enumerate(tokens[:min_tokens]):
        if t in stop_ids:
            return i, i + 1
    return None, min(min_tokens, len(tokens))
