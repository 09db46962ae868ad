"""The host ops' result tensors reused across a model's passes (``StepScratch`` in ``ops/host/__init__.py``) and
parameter views kept on the parameter (``param_view``): what is reused, what is never reused, and that a model's
result outlives the next pass."""

import numpy as np
import paddle

from fastdeploy_ext import LLM, SamplingParams
from fastdeploy_ext.ops.host import StepScratch, host_view, new_tensor, param_view
from fastdeploy_ext.ops.host_threads import run_parallel


def _pass(scratch, shapes):
    with scratch:
        return [new_tensor(s)[0] for s in shapes]


def test_a_pass_gets_the_last_pass_tensors_where_shapes_repeat():
    scratch = StepScratch()
    shapes = [(1, 17), (1, 255), (3, 17)]
    first = _pass(scratch, shapes)
    second = _pass(scratch, shapes)
    assert all(a is b for a, b in zip(first, second))
    assert len({id(t) for t in first}) == len(shapes)  # never the same tensor twice in one pass
    third = _pass(scratch, [(1, 17), (1, 257), (3, 17)])  # the second request changed shape
    assert third[0] is first[0] and third[2] is first[2] and third[1] is not first[1]
    assert third[1].shape == [1, 257] and host_view(third[1]).shape == (1, 257)
    assert _pass(scratch, [(1, 17), (1, 257)])[1] is third[1]


def test_outside_a_pass_and_on_other_threads_tensors_are_new():
    scratch = StepScratch()
    kept = _pass(scratch, [(1, 1000)])[0]
    assert new_tensor((1, 1000))[0] is not kept
    made = []
    with scratch:
        new_tensor((1, 1000))
        run_parallel(lambda _: made.append(new_tensor((1, 1000))[0]), range(2))
    assert len(made) == 2 and all(t is not kept for t in made)


def test_large_tensors_and_those_past_the_budget_are_not_kept():
    scratch = StepScratch(max_bytes=4 * 1000, budget=4 * 1500)
    shapes = [(1000,), (1001,), (400,), (400,)]  # kept; too large; kept; past the budget
    first, second = _pass(scratch, shapes), _pass(scratch, shapes)
    assert [a is b for a, b in zip(first, second)] == [True, False, True, False]


def test_param_view_follows_the_parameter_memory():
    rng = np.random.default_rng(17)
    p = paddle.create_parameter([17], "float32")
    p.set_value(rng.standard_normal(17).astype(np.float32))
    view = param_view(p)
    assert param_view(p) is view and view.ctypes.data == p.data_ptr()
    new = rng.standard_normal(17).astype(np.float32)
    paddle.to_tensor(new)._share_buffer_to(p)  # the parameter now points at other memory, as a mapped load does
    np.testing.assert_array_equal(param_view(p), new)


def test_model_results_outlive_the_next_pass(tiny_qwen2_dir):
    """Every hidden state a host Qwen2 pass returns (the final norm's, made outside the scratch) still holds its
    values after the decode steps that follow, while the decoder layers' results are reused."""
    llm = LLM(model=tiny_qwen2_dir, max_model_len=128, max_num_seqs=2)
    model = llm.llm_engine.model.model
    forward, kept = model.forward, []

    def keep(*args, **kwargs):
        hidden = forward(*args, **kwargs)
        kept.append((hidden, hidden.numpy().copy()))
        return hidden

    model.forward = keep
    prompt = np.random.default_rng(255).integers(0, 100, size=17).tolist()
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    assert len(kept) == 6 and model.scratch._slots
    for hidden, values in kept:
        np.testing.assert_array_equal(hidden.numpy(), values)
