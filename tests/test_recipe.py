"""The recipe's LR schedule and weight-decay split."""

import copy
import math

import pytest
import torch
from torchtitan.config import LRScheduler
from torchtitan.config import Optimizer as OptimizerConfig

from mhar_titan.components.lr_schedule import build_lr_schedulers
from mhar_titan.components.optimizer import build_optimizers, decay_split
from mhar_titan.model.args import FLAVORS, MHAR
from mhar_titan.model.model import MHARTransformer

PEAK, WARMUP, END, MIN = 4e-4, 10, 50, 0.01


def closed_form(step, decay_type="linear"):
    if step < WARMUP:
        return PEAK * step / WARMUP
    p = min(1.0, (step - WARMUP) / (END - WARMUP))
    shape = {"linear": 1 - p, "sqrt": 1 - math.sqrt(p), "cosine": 0.5 * (1 + math.cos(math.pi * p))}[decay_type]
    return PEAK * (MIN + (1 - MIN) * shape)


def optimizer_and_schedule(decay_type, training_steps):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = build_optimizers([model], OptimizerConfig(lr=PEAK, implementation="for-loop"), parallel_dims=None)
    cfg = LRScheduler(warmup_steps=WARMUP, total_steps=END, decay_type=decay_type, min_lr_factor=MIN)
    return opt, build_lr_schedulers(opt, cfg, training_steps)


@pytest.mark.parametrize("decay_type", ["linear", "sqrt", "cosine"])
def test_lr_is_the_closed_form_and_resumes_exactly(decay_type):
    opt, sched = optimizer_and_schedule(decay_type, training_steps=20)  # a job shorter than the schedule
    lrs = []
    for _ in range(END + 5):
        lrs.append(opt.optimizers[0].param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == 0.0  # re-warmup from exactly 0
    for step in (0, WARMUP // 2, WARMUP, (WARMUP + END) // 2, END, END + 4):
        assert lrs[step] == pytest.approx(closed_form(step, decay_type), rel=1e-12, abs=1e-18), step

    cut = 23
    first, first_sched = optimizer_and_schedule(decay_type, training_steps=cut)
    for _ in range(cut):
        first.step()
        first_sched.step()
    # what a checkpoint restores: the optimizer (its groups' LR included) and the scheduler's step
    opt_state, sched_state = copy.deepcopy(first.state_dict()), copy.deepcopy(first_sched.state_dict())
    resumed, resumed_sched = optimizer_and_schedule(decay_type, training_steps=END + 5)  # an extended job
    resumed.load_state_dict(opt_state)
    resumed_sched.load_state_dict(sched_state)
    for step in range(cut, END + 5):
        assert resumed.optimizers[0].param_groups[0]["lr"] == lrs[step], step
        resumed.step()
        resumed_sched.step()


def test_weight_decay_split_on_the_8b_model():
    args = copy.deepcopy(FLAVORS["marin8b"])
    args.mhar = MHAR(enable=True)
    with torch.device("meta"):
        model = MHARTransformer(args)
    split = decay_split(model)
    counts = {k: len(v) for k, v in split.items()}
    print("weight-decay split of the 8B MHAR model (tensors):", counts)
    no_decay = {n for n, _ in split["no_decay"]}
    assert no_decay == {"tok_embeddings.weight", "norm.weight"} | {
        f"layers.{i}.{norm}.weight" for i in range(32) for norm in ("attention_norm", "ffn_norm")
    }
    assert {n for n, _ in split["routing"]} == {
        f"layers.{i}.{site}_routing.{p}"
        for i in range(32)
        for site in ("attn", "ffn")
        for p in ("query", "norm_weight", "null", "gate")
    }
    assert all(n.endswith(".weight") and "norm" not in n and "tok_embeddings" not in n for n, _ in split["decay"])
    assert counts == {"decay": 32 * 7 + 1, "no_decay": 2 + 64, "routing": 256}
    assert "output.weight" in {n for n, _ in decay_split(model)["decay"]}
    assert "output.weight" in {n for n, _ in decay_split(model, decay_output=False)["no_decay"]}


def test_z_loss_is_the_coefficient_times_mean_squared_logsumexp():
    from torchtitan.components.loss import IGNORE_INDEX, cross_entropy_loss

    from mhar_titan.components.loss import ZLossCrossEntropy

    logits = torch.randn(3, 7, 50) * 4
    labels = torch.randint(0, 50, (3, 7))
    labels[0, :2] = IGNORE_INDEX
    valid = labels != IGNORE_INDEX
    lse = torch.log(torch.exp(logits.double()).sum(-1))  # written out, in float64
    want_z = 1e-4 * (lse[valid] ** 2).sum()
    want_ce = torch.nn.functional.cross_entropy(
        logits.double().flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX
    )

    loss_fn = ZLossCrossEntropy(1e-4)
    total = loss_fn(logits, labels)
    ce, z, tokens = loss_fn.take_parts().tolist()
    assert tokens == valid.sum().item()
    assert z / tokens == pytest.approx((want_z / valid.sum()).item(), rel=1e-5)
    assert ce == pytest.approx(want_ce.item(), rel=1e-5) and total.item() == pytest.approx(ce + z, rel=1e-6)
    assert loss_fn.take_parts() is None  # parts are taken once per step
    assert torch.equal(ZLossCrossEntropy(0.0)(logits, labels), cross_entropy_loss(logits, labels))


@pytest.mark.parametrize("lr", [0.0, -1e-4, math.nan, math.inf])
def test_optimizer_refuses_an_lr_that_cannot_train(lr):
    with pytest.raises(ValueError, match=rf"^\[optimizer\] lr = {lr} must be a positive finite number$"):
        build_optimizers([torch.nn.Linear(4, 4)], OptimizerConfig(lr=lr, implementation="for-loop"), None)


def test_optimizer_keeps_frozen_routing():
    # [mhar] lr_multiplier = 0 is legitimate (frozen routing): the routing group trains at lr 0.
    args = copy.deepcopy(FLAVORS["tiny"])
    args.mhar = MHAR(enable=True, num_heads=4, num_blocks=2, lr_multiplier=0.0)
    with torch.device("meta"):
        model = MHARTransformer(args)
    opt = build_optimizers([model], OptimizerConfig(lr=PEAK, implementation="for-loop"), None)
    lrs = {g["name"]: g["lr"] for g in opt.optimizers[0].param_groups}
    assert lrs == {"decay": PEAK, "no_decay": PEAK, "routing": 0.0}


@pytest.mark.parametrize(
    "training_steps,settings,message",
    [
        (0, {}, r"^\[training\] steps = 0 must be positive$"),
        (-3, {}, r"^\[training\] steps = -3 must be positive$"),
        (20, {"total_steps": 0}, r"^\[lr_scheduler\] total_steps = 0 must be positive \(or unset\)$"),
        (20, {"min_lr_factor": -0.1}, r"^\[lr_scheduler\] min_lr_factor = -0.1 must be in \[0, 1\]$"),
        (20, {"min_lr_factor": math.nan}, r"^\[lr_scheduler\] min_lr_factor = nan must be in \[0, 1\]$"),
        (20, {"min_lr_factor": 1.5}, r"^\[lr_scheduler\] min_lr_factor = 1.5 must be in \[0, 1\]$"),
        (
            END + 1,
            {"min_lr_factor": 0.0},
            rf"^\[training\] steps = {END + 1} > \[lr_scheduler\] total_steps = {END} with min_lr_factor = 0: "
            rf"steps {END + 1} to {END + 1} would train at lr 0$",
        ),
    ],
    ids=["steps-0", "steps-negative", "total-steps-0", "min-negative", "min-nan", "min-above-1", "lr-0-after-end"],
)
def test_schedule_refuses_settings_that_train_nothing(training_steps, settings, message):
    opt = build_optimizers([torch.nn.Linear(4, 4)], OptimizerConfig(lr=PEAK, implementation="for-loop"), None)
    cfg = LRScheduler(**{"warmup_steps": WARMUP, "total_steps": END, "min_lr_factor": MIN, **settings})
    with pytest.raises(ValueError, match=message):
        build_lr_schedulers(opt, cfg, training_steps)
    # the same schedule decaying to 0 exactly at the end of the run is fine
    build_lr_schedulers(opt, LRScheduler(warmup_steps=WARMUP, total_steps=END, min_lr_factor=0.0), END)
