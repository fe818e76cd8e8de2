"""ratebench/answerscore.py: which answers are scored, and a scoring that fails leaves them unscored."""

from __future__ import annotations

import asyncio
import socket

from ratebench.answerscore import parted_pairs, score_parted_answers
from ratebench.runrecords import ClientRecord
from ratebench.workload import StreamRequest


def _rec(user, index, ids, *, phase="mix", ignore_eos=True, error=None):
    return ClientRecord(client_id=f"rb-1-{phase}-{index}", scenario="mix", phase=phase, engine="e", user=user,
                        api="completions", stream_index=index, max_tokens=len(ids), ignore_eos=ignore_eos,
                        token_ids=ids, error=error)


def test_only_greedy_pairs_that_part_are_scored():
    on = [_rec("a", 0, [1, 2, 3]), _rec("a", 1, [1, 2, 3]), _rec("a", 2, [1, 2]), _rec("b", 0, [5, 6], ignore_eos=False),
          _rec("b", 1, [5, 6], error="HTTP 500"), _rec("c", 0, [7, 8, 9])]
    off = [_rec("a", 0, [1, 2, 3], phase="mix-baseline"), _rec("a", 1, [1, 9, 3], phase="mix-baseline"),
           _rec("a", 2, [1, 2, 4], phase="mix-baseline"),  # a cut answer that agrees as far as it went
           _rec("b", 0, [5, 7], phase="mix-baseline"), _rec("b", 1, [5, 7], phase="mix-baseline")]
    assert [(a.user, a.stream_index) for a, _ in parted_pairs(on, off)] == [("a", 1)]


def test_a_scoring_request_that_fails_leaves_the_answer_unscored_and_says_why():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    on, off = [_rec("a", 1, [1, 2, 3])], [_rec("a", 1, [1, 9, 3], phase="mix-baseline")]
    out = asyncio.run(score_parted_answers(f"http://127.0.0.1:{port}", "m", on, off,
                                           {1: StreamRequest(user="a", prompt=[4, 5], max_tokens=3)}, "off"))
    assert out["answers_scored"] == 0 and out["answers_unscored"]["count"] == 1
    assert "rb-1-mix-1" in out["answers_unscored"]["first"]
    assert on[0].answer_scores is None and on[0].scored_on is None
