"""Per-layer norms (components/param_norms.py): the groups, and each norm against what it measures, after real Adam(W)
steps of a small MHAR model with clipping."""

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from mhar_titan.components.hooks import Step
from mhar_titan.components.param_norms import KINDS, ParameterNorms, group_of, norm_groups
from mhar_titan.components.tensorboard_scalars import NORM_TAG, norm_tag
from mhar_titan.model.args import MHAR, MHARModelArgs
from mhar_titan.model.model import MHARTransformer

MAX_NORM = 0.05  # small: every step here is clipped, so the pre-clip gradient is what the hook must recover
# fp32 throughout. The update is measured against p_after - p_before, whose rounding is about 2 x 2^-24 |p| an
# element: relative to the update's own size that is |p| / |update| x 1.2e-7, with |p| / |update| under 100 here
# (lr 1e-2 against weights of std 0.02), so 1e-4 holds for any draw with room; weights and gradients are the same
# sums in another order (float64 accumulation of fp32 squares): 1e-6.
UPDATE_RTOL, RTOL = 1e-4, 1e-6


def test_each_parameter_has_its_layers_group_whatever_wraps_it():
    assert group_of("layers.3.attention.wq.weight", False) == "layer03"
    assert group_of("layers._checkpoint_wrapped_module.3", False) == "other"  # not a layer's parameter name
    assert group_of("layers.12._checkpoint_wrapped_module._orig_mod.feed_forward.w1.weight", False) == "layer12"
    assert group_of("layers.12.attn_routing.query", True) == "routing12"
    assert group_of("_orig_mod.tok_embeddings.weight", False) == "embedding"
    assert group_of("output.weight", False) == "output" and group_of("norm.weight", False) == "final_norm"
    assert NORM_TAG.match(norm_tag("update", "routing07"))["group"] == "routing07"


def model() -> MHARTransformer:
    torch.manual_seed(0)
    args = MHARModelArgs(dim=32, n_layers=4, n_heads=4, vocab_size=96, mhar=MHAR(enable=True, num_blocks=2))
    m = MHARTransformer(args)
    with torch.no_grad():
        m.init_weights()
    with torch.no_grad():  # open the gates: the routing parameters then get gradients and updates too
        for name, p in m.named_parameters():
            if name.endswith(".gate"):
                p.fill_(0.3)
    return m


def direct(m: torch.nn.Module, values: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each group's norm of `values` (by parameter name), summed in float64."""
    groups = norm_groups(m)
    squares: dict[str, float] = {}
    for name, p in m.named_parameters():
        g = groups[id(p)]
        squares[g] = squares.get(g, 0.0) + float(values[name].double().square().sum())
    return {g: math.sqrt(v) for g, v in squares.items()}


@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, torch.optim.Adam])
def test_weight_gradient_and_update_norms_are_those_of_the_step(optimizer):
    m = model()
    opt = optimizer(m.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    hook = ParameterNorms(freq=2)
    trainer = SimpleNamespace(
        model_parts=[m],
        optimizers=SimpleNamespace(optimizers=[opt]),
        job_config=SimpleNamespace(training=SimpleNamespace(max_norm=MAX_NORM)),
        dp_group=None,
        parallel_dims=SimpleNamespace(dp_replicate=1),
    )
    hook.set_up(trainer)
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    for number in (1, 2, 3):
        opt.zero_grad()
        m(tokens).float().square().mean().backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        total = torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM)
        before = copy.deepcopy({n: p.detach().clone() for n, p in m.named_parameters()})
        opt.step()
        step = Step(number, last=False, log=True, values={"grad_norm": float(total)})
        hook.after_step(step)
        got = hook.metrics(step)
        if number == 3:  # not due
            assert got == {}
            continue
        after = {n: p.detach() for n, p in m.named_parameters()}
        want = {
            "weight": direct(m, after),
            "grad": direct(m, grads),
            "update": direct(m, {n: after[n] - before[n] for n in after}),
        }
        assert float(total) > MAX_NORM  # clipped
        assert set(got) == {norm_tag(k, g) for k in KINDS for g in want["weight"]}
        assert {"embedding", "output", "final_norm", "layer00", "layer03", "routing03"} <= set(want["weight"])
        for kind in KINDS:
            rtol = UPDATE_RTOL if kind == "update" else RTOL
            for group, value in want[kind].items():
                assert got[norm_tag(kind, group)] == pytest.approx(value, rel=rtol), (kind, group)


def test_a_skipped_step_or_a_step_not_due_has_no_norms_and_a_negative_frequency_is_refused():
    hook = ParameterNorms(freq=10)
    assert [s for s in range(1, 31) if hook.due(s)] == [1, 10, 20, 30]
    assert not ParameterNorms(freq=0).due(1)
    hook.values = {"x": 1.0}
    hook.after_step(Step(10, last=False, log=True, values={"grad_norm": 1.0}, applied=False))
    assert hook.metrics(Step(10, last=False, log=True)) == {}
    with pytest.raises(ValueError, match=r"^\[norms\] freq = -1 must be >= 0"):
        ParameterNorms(freq=-1)
