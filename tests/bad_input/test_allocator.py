"""Bad input to the allocator (`KVCacheManager`): each refused call names its argument and changes nothing."""

import numpy as np
import pytest

from jax_hybrid_attn.allocator import KVCacheManager

from .cases import assert_same, manager, snapshot


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: m.add_request("r", [1, 2, 3], cache_salt=1.5), "cache_salt"),
        (lambda m: m.add_request("r", []), "token_ids"),
        (lambda m: m.add_request("r", [1.5, 2.0]), "token_ids"),
        (lambda m: m.add_request("r", [2**31]), "token_ids"),
        (lambda m: m.add_request("r", [True, False]), "token_ids"),
        (lambda m: m.add_request("r", [1, 2], adapter_id=-1), "adapter_id"),
        (lambda m: m.add_request(["unhashable"], [1, 2]), "request_id"),
        (lambda m: m.append_token_ids("kept", [2**31]), "token_ids"),
        (lambda m: m.append_token_ids("kept", [0.5]), "token_ids"),
        (lambda m: m.append_token_ids(["unhashable"], [1]), "request_id"),
        (lambda m: m.free_requests("kept"), "request_ids='kept' must be a list or tuple"),
        (lambda m: m.free_requests(None), "request_ids=None"),
        (lambda m: m.append_row_token_ids("kept", np.arange(4)), "request_ids='kept'"),
        (lambda m: m.append_row_token_ids(["kept"], np.asarray([2**40])), "token_ids"),
        (lambda m: m.append_row_token_ids(["kept"], np.asarray([-1])), "token_ids"),
        (lambda m: m.append_row_token_ids(["kept"], np.asarray([1]), mask=np.ones(5, bool)), "mask="),
        (lambda m: m.append_row_token_ids(["kept"], np.asarray([1]), mask=np.asarray([0.5])), "mask="),
    ],
)
def test_rejected_allocator_calls_leave_every_piece_of_state_as_it_was(call, match):
    m = manager()
    m.add_request("kept", [5, 6, 7])
    for _ in range(3):  # a rejected call, again and again, never leaks a request slot
        before = snapshot(m)
        with pytest.raises((ValueError, TypeError), match=match):
            call(m)
        assert_same(before, snapshot(m))
    m.add_request("next", [1, 2])  # the slot is still there


def test_schedule_checks_each_per_request_option_before_anything_changes():
    m = manager()
    m.add_request("kept", [5, 6, 7])
    for kwargs, match in [
        (dict(new_tokens="kept"), "new_tokens"),
        (dict(new_tokens=[("kept", 1)], num_lookahead_tokens=[1.5]), "num_lookahead_tokens"),
        (dict(new_tokens=[("kept", 1)], num_lookahead_tokens=[0, 0]), "num_lookahead_tokens"),
        (dict(new_tokens=[("kept", 1)], full_sequence_must_fit=["yes"]), "full_sequence_must_fit"),
        (dict(new_tokens=[("kept", np.float64(1))]), "num_new_tokens"),
    ]:
        before = snapshot(m)
        with pytest.raises(ValueError, match=match):
            m.schedule(**kwargs)
        assert_same(before, snapshot(m))
    out = m.schedule([("kept", np.int64(3))], num_lookahead_tokens=[np.int64(0)], full_sequence_must_fit=[np.bool_(0)])
    assert bool(out.success[0])


def test_the_manager_takes_a_bool_for_reuse_output_buffers():
    with pytest.raises(ValueError, match="reuse_output_buffers='yes' must be a bool"):
        KVCacheManager(manager().config, reuse_output_buffers="yes")


@pytest.mark.parametrize(
    "success, seq_lens, match",
    [
        ([], [3], r"success=.* must be a bool array of at least 1 rows"),
        (None, [3], "success=array"),
        (["yes"], [3], "success="),
        ([True], [3.5], r"seq_lens=array\(\[3\.5\]\) must be an integer array"),
        ([True], "x", "seq_lens="),
        ([True], [-3], r"seq_lens=\[-3\] must lie in \[0, max_model_len=32\]"),
        ([True], [1000], "seq_lens=.1000. must lie"),
    ],
)
def test_record_step_checks_the_rows_it_is_given_before_anything_changes(success, seq_lens, match):
    m = manager()
    m.add_request("kept", [5, 6, 7])
    out = m.schedule([("kept", 3)], wait=False)
    before = snapshot(m)
    with pytest.raises(ValueError, match=match):
        m.record_step(["kept"], success if success is None else np.asarray(success), seq_lens)
    assert_same(before, snapshot(m))
    m.record_step(["kept"], np.asarray(out.success), np.asarray(out.seq_lens))
    assert m.num_computed_tokens("kept") == 3


def test_a_schedule_that_does_not_wait_must_be_recorded_before_the_next():
    m = manager()
    m.add_request("kept", [5, 6, 7])
    out = m.schedule([("kept", 3)], wait=False)
    assert m.num_computed_tokens("kept") == 0  # nothing read back yet
    with pytest.raises(RuntimeError, match="record_step"):
        m.schedule([("kept", 1)])
    with pytest.raises(ValueError, match="request_ids"):
        m.record_step(["other"], np.asarray(out.success), np.asarray(out.seq_lens))
    m.record_step(["kept"], np.asarray(out.success), np.asarray(out.seq_lens))
    assert m.num_computed_tokens("kept") == 3


def test_the_jitted_functions_name_their_arguments_while_tracing():
    """The functional API refuses a config that is not one, static options of the wrong kind and rows of the
    wrong dtype or shape while it traces (nothing is compiled), not an AttributeError or a broadcast error."""
    from jax_hybrid_attn.allocator import (
        add_requests,
        allocate_slots,
        append_token_ids,
        free,
        get_computed_blocks,
        reset_prefix_cache,
        step_common_prefix_blocks,
    )

    m = manager()
    state, config = m.state, m.config
    rows = np.asarray([0, -1], np.int32)
    step = dict(slots=rows, num_computed_tokens=np.zeros(2, np.int32), num_new_tokens=np.ones(2, np.int32))

    def allocate(**changes):
        return allocate_slots(config, state, **{**step, **changes})

    for call, match in [
        (lambda: allocate_slots("config", state, **step), "config must be an AllocatorConfig"),
        (lambda: free("config", state, rows), "config must be an AllocatorConfig"),
        (lambda: get_computed_blocks("config", state, rows), "config must be an AllocatorConfig"),
        (lambda: reset_prefix_cache("config", state), "config must be an AllocatorConfig"),
        (lambda: add_requests("config", state, rows, np.zeros((2, 4), np.int32), rows), "config must be"),
        (lambda: append_token_ids("config", state, rows, np.zeros((2, 1), np.int32), rows), "config must be"),
        (lambda: allocate(num_tokens=2.5), "num_tokens=2.5"),
        (lambda: allocate(return_block_tables="yes"), "return_block_tables='yes'"),
        (lambda: allocate(defer_rest=1), "defer_rest=1"),
        (lambda: allocate(num_new_tokens=np.ones(2)), "num_new_tokens=.*integ"),
        (lambda: allocate(num_new_tokens=np.ones(3, np.int32)),
         r"num_new_tokens\.shape=\(3,\) must be \(\) or slots\.shape=\(2,\)"),
        (lambda: allocate(slots=rows[:, None]), r"slots\.shape=\(2, 1\)"),
        (lambda: allocate(full_sequence_must_fit=rows), "full_sequence_must_fit=.*bool"),
        (lambda: step_common_prefix_blocks("step", (4,)), "step must be a StepOutput"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()
    m.add_request("kept", [5, 6, 7])
    out = m.schedule([("kept", 3)])  # the executable the other tests compiled
    with pytest.raises(ValueError, match=r"block_sizes=\(4, 4\) must give S of each of the 1 groups"):
        step_common_prefix_blocks(out, (4, 4))
    with pytest.raises(ValueError, match="block_sizes=0"):
        step_common_prefix_blocks(out, (0,))
