"""answers-intact (ratebench/analysis/answers.py): a mix's greedy answers on the limiter-on engine,
token for token against the same requests on the limiter-off engine."""

from __future__ import annotations

from synth import SimEngine, SimPhase, SimRequest, write_run_folder
from ratebench.verify import analyse_run
from synthetic_runs import edit_client_records


def greedy_mix(tmp_path, *, greedy=True):
    on = SimEngine("patched-sync", default_tps=100, user_tps={"free-00": 20})
    off = SimEngine("feature-off-sync", feature=False, default_tps=None)

    def reqs(prefix):
        return ([SimRequest(f"rb-a0000001-{prefix + i}", "pro-00", i, 8, arrive_offset_ns=50_000_000 * i)
                 for i in range(6)]
                + [SimRequest(f"rb-a0000001-{prefix + 10 + i}", "free-00", i, 30) for i in range(2)])

    users = {"pro-00": {"limit_tps": 100, "streams": 6, "backlogged": False, "tier": "pro"},
             "free-00": {"limit_tps": 20, "streams": 2, "backlogged": False, "tier": "free"}}
    params = {"greedy_answers": True} if greedy else {}
    phases = [SimPhase("mix", "mix", "mix", "patched-sync", "measure", users, reqs(100), params=params),
              SimPhase("mix", "mix", "mix-baseline", "feature-off-sync", "baseline",
                       {u: {**v, "limit_tps": None} for u, v in users.items()}, reqs(200), params=params)]
    run = write_run_folder(tmp_path / "run", [on, off], phases)

    def answers(recs):  # the same greedy answer for the same request on both engines
        for r in recs:
            n = sum(r.chunk_tokens)
            r.token_ids = [(7 * r.stream_index + 13 * len(r.user) + k) % 97 for k in range(n)]

    edit_client_records(run, answers)
    return run


def answers_check(run_dir):
    (check,) = [c for c in analyse_run(run_dir).verdict.checks if c.name == "answers-intact"]
    return check


def test_the_same_greedy_answers_pass(tmp_path):
    check = answers_check(greedy_mix(tmp_path))
    assert check.passed and check.figure == 0
    assert "0 of 8 greedy answers (108 tokens)" in check.explanation


def test_an_answer_resumed_on_the_wrong_kv_fails_naming_the_request_and_the_token(tmp_path):
    run = greedy_mix(tmp_path)

    def corrupt(recs):  # free-00's second answer goes astray after its 12th token on the limiter-on engine
        for r in recs:
            if r.phase == "mix" and r.user == "free-00" and r.stream_index == 1:
                r.token_ids[12:] = [0] * (len(r.token_ids) - 12)

    edit_client_records(run, corrupt)
    check = answers_check(run)
    assert check.passed is False and check.figure == 1
    assert "1 of 8 greedy answers" in check.explanation and "from token 12" in check.explanation
    assert not analyse_run(run).verdict.passed


def test_a_cancelled_answer_is_compared_up_to_its_cut_and_eos_answers_are_not_compared(tmp_path):
    run = greedy_mix(tmp_path)

    def edit(recs):
        for r in recs:
            if r.phase == "mix" and r.user == "pro-00" and r.stream_index == 0:
                r.token_ids = r.token_ids[:3]  # cut after 3 tokens: the same 3 as the baseline's
            if r.user == "pro-00" and r.stream_index == 1:
                r.ignore_eos = False  # ended with EOS: sampled, not compared
                if r.phase == "mix":
                    r.token_ids = [1, 2, 3]

    edit_client_records(run, edit)
    check = answers_check(run)
    assert check.passed and "0 of 7 greedy answers (95 tokens)" in check.explanation


def test_answers_without_token_ids_or_phases_not_greedy_are_not_judged(tmp_path):
    run = greedy_mix(tmp_path)

    def drop(recs):
        for r in recs:
            r.token_ids = None

    edit_client_records(run, drop)
    check = answers_check(run)
    assert check.passed is None and "8 without token ids" in check.explanation
    assert not [c for c in analyse_run(greedy_mix(tmp_path / "b", greedy=False)).verdict.checks
                if c.name == "answers-intact"]


def _part(run, scores):
    """free-00's second answer parts from the baseline's at token 5 on the limiter-on engine; ``scores``
    (per token: [its logprob, the likeliest's] on the limiter-off engine) or None: not scored."""
    def edit(recs):
        for r in recs:
            if r.phase == "mix" and r.user == "free-00" and r.stream_index == 1:
                r.token_ids[5:] = [(t + 1) % 97 for t in r.token_ids[5:]]
                if scores is not None:
                    r.answer_scores = scores(len(r.token_ids))
                    r.scored_on = "feature-off-sync"
    edit_client_records(run, edit)
    return answers_check(run)


def test_answers_that_part_at_a_tie_and_go_on_greedily_pass_named_as_a_tie(tmp_path):
    # every token of the limiter-on answer the limiter-off engine's likeliest, but token 5 tied to 1 ulp
    check = _part(greedy_mix(tmp_path), lambda n: [[-4.0, -4.0]] * 5 + [[-4.7152, -4.6996]] + [[-3.0, -3.0]] * (n - 6))
    assert check.passed and check.figure == 0, check.explanation
    assert "1 parted at a tie" in check.explanation and "token 5, logprob -4.7152 against -4.6996" in check.explanation


def test_an_answer_that_parts_where_no_tie_is_fails_with_its_scores(tmp_path):
    # tied where it parted, but two tokens later not the limiter-off engine's greedy choice: lost context
    check = _part(greedy_mix(tmp_path), lambda n: [[-4.0, -4.0]] * 5 + [[-4.71, -4.70]] + [[-3.0, -3.0]]
                  + [[-5.2, -3.9]] + [[-3.0, -3.0]] * (n - 8))
    assert check.passed is False and check.figure == 1
    assert "its token 7 has logprob -5.2000 where that engine's likeliest has -3.9000" in check.explanation


def test_an_answer_that_parts_unscored_fails(tmp_path):
    check = _part(greedy_mix(tmp_path), None)
    assert check.passed is False and "not scored on the limiter-off engine" in check.explanation


def test_the_tie_tolerance_is_verify_bounds_to_set(tmp_path):
    from ratebench.analysis.verdict import Thresholds
    run = greedy_mix(tmp_path)
    _part(run, lambda n: [[-4.0, -4.0]] * 5 + [[-4.80, -4.70]] + [[-3.0, -3.0]] * (n - 6))
    strict = [c for c in analyse_run(run).verdict.checks if c.name == "answers-intact"][0]
    loose = [c for c in analyse_run(run, Thresholds(answers_logprob_tol=0.2)).verdict.checks
             if c.name == "answers-intact"][0]
    assert strict.passed is False and loose.passed is True
