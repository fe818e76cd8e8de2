"""The V1 model runner's persistent batch (``InputBatch``, patched by 0007): a request added back after
sitting out steps (the limiter's places go round) copies its prompt's token ids from an array kept at its
second add, not from the list; what lands in the batch is the same as upstream's.

Real ``InputBatch`` and ``CachedRequestState`` on the CPU; nothing mocked.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.usefixtures("patched_vllm")

BLOCK_SIZE = 16


def make_batch(max_num_reqs: int = 4, max_model_len: int = 256):
    import torch
    from vllm.v1.worker.gpu_input_batch import InputBatch

    return InputBatch(max_num_reqs=max_num_reqs, max_model_len=max_model_len, max_num_batched_tokens=1024,
                      device=torch.device("cpu"), vocab_size=1000, block_sizes=[BLOCK_SIZE],
                      max_num_blocks_per_req=[-(-max_model_len // BLOCK_SIZE)])


def make_state(req_id: str, prompt: list[int], output: list[int]):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    num_tokens = len(prompt) + len(output)
    return CachedRequestState(
        req_id=req_id, prompt_token_ids=prompt, mm_features=[],
        sampling_params=SamplingParams(max_tokens=64, temperature=0.0), generator=None,
        block_ids=(list(range(-(-num_tokens // BLOCK_SIZE))),), num_computed_tokens=num_tokens,
        output_token_ids=output)


def row(batch, req_id: str) -> list[int]:
    """The tokens the batch holds for ``req_id``: its prompt and answer so far."""
    index = batch.req_id_to_index[req_id]
    return batch.token_ids_cpu[index, :batch.num_tokens_no_spec[index]].tolist()


def settle(batch) -> None:
    """What the model runner does after its adds and removes of a step."""
    batch.condense()
    batch.refresh_metadata()


def sit_out_and_come_back(batch, state) -> None:
    """One step without ``state``, then it is added back."""
    batch.remove_request(state.req_id)
    settle(batch)
    batch.add_request(state)
    settle(batch)


def test_a_request_added_back_again_and_again_holds_its_prompt_and_answer():
    batch = make_batch()
    prompt = [7 + 3 * i for i in range(150)]
    state = make_state("a", prompt, [900, 901])
    other = make_state("b", [5] * 40, [1])
    batch.add_request(state)
    batch.add_request(other)
    settle(batch)
    assert row(batch, "a") == prompt + [900, 901]
    # Never added back: nothing is kept beside the list (upstream's memory).
    assert state.prompt_token_ids_copy is None
    for k in range(4):
        state.output_token_ids.append(902 + k)
        sit_out_and_come_back(batch, state)
        assert row(batch, "a") == prompt + [900, 901] + [902 + j for j in range(k + 1)]
        assert row(batch, "b") == [5] * 40 + [1]
    # Kept from the second add on, and it is what the batch holds.
    kept_list, kept = state.prompt_token_ids_copy
    assert kept_list is prompt
    assert np.array_equal(kept, np.array(prompt, dtype=kept.dtype))


def test_a_copy_kept_for_the_row_is_not_the_row_itself():
    """The kept copy must survive the row being reused by another request."""
    batch = make_batch(max_num_reqs=2)
    state = make_state("a", list(range(100, 164)), [])
    batch.add_request(state)
    settle(batch)
    sit_out_and_come_back(batch, state)  # second add: the copy is taken
    batch.remove_request("a")
    settle(batch)
    batch.add_request(make_state("b", [3] * 64, []))  # takes row 0, overwriting a's tokens
    settle(batch)
    batch.add_request(state)
    settle(batch)
    assert row(batch, "a") == list(range(100, 164))
    assert row(batch, "b") == [3] * 64


def test_a_prompt_replaced_by_a_streaming_update_is_copied_again():
    """The model runner replaces a streaming request's prompt list (earlier answers become prompt): the
    copy of the old list must not be used for the new one."""
    batch = make_batch()
    state = make_state("a", list(range(50)), [60, 61])
    batch.add_request(state)
    settle(batch)
    sit_out_and_come_back(batch, state)
    assert state.prompt_token_ids_copy is not None
    # As _update_streaming_request does: remove, new prompt list, answer cleared, add again.
    batch.remove_request("a")
    settle(batch)
    state.prompt_token_ids = list(range(50)) + [60, 61, 62] + [400, 401]
    state.num_prompt_tokens = len(state.prompt_token_ids)
    state.output_token_ids.clear()
    batch.add_request(state)
    settle(batch)
    assert row(batch, "a") == list(range(50)) + [60, 61, 62, 400, 401]
    # Same length, other tokens: still the new list's.
    batch.remove_request("a")
    settle(batch)
    state.prompt_token_ids = [999 - i for i in range(55)]
    batch.add_request(state)
    settle(batch)
    assert row(batch, "a") == [999 - i for i in range(55)]
