"""Weight EMA and fixed-set validation, in one process."""

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from data.config import DataConfig
from data.loader import Encoder, ValidationLoader
from data.shards import list_shards
from mhar_titan.components.ema import WeightEMA, plain_name
from mhar_titan.components.loss import ZLossCrossEntropy
from mhar_titan.components.validate import FixedSetValidator, build_fixed_set_validator
from mhar_titan.config import parse_config
from mhar_titan.model.args import FLAVORS, MHAR
from mhar_titan.model.model import MHARTransformer, build_initialised


def tiny_model(seed: int, mhar: bool = True) -> MHARTransformer:
    args = copy.deepcopy(FLAVORS["tiny"])
    args.mhar = MHAR(enable=mhar, num_heads=4, num_blocks=2, backend="torch")
    torch.manual_seed(seed)
    model = build_initialised(args)
    with torch.no_grad():
        for p in model.parameters():  # gates and queries away from their zero init
            p.add_(0.01 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("every", [1, 3])
def test_ema_update_is_the_recurrence_and_swapping_restores_the_weights_bitwise(every):
    model = tiny_model(seed=int(torch.randint(0, 2**31, ())))
    beta = 0.9
    ema = WeightEMA(model, beta, every)
    ema.start()
    want = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    # An fp32 lerp rounds relative to the magnitudes it combines (the weights and the EMA), not to
    # its result, which can cancel towards zero: each update adds at most a few roundings of the
    # largest of them, and earlier errors only shrink (by beta**every).
    scale = {n: w.abs().max().item() for n, w in want.items()}
    for step in range(1, 8):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
        ema.update(step)
        if step % every == 0:  # only these steps update, with beta**every
            for n, p in model.named_parameters():
                want[n] = beta**every * want[n] + (1 - beta**every) * p.detach().double()
                scale[n] = max(scale[n], p.detach().abs().max().item(), want[n].abs().max().item())
    for n, e in ema.state_dict().items():
        bound = 4 * (7 // every) * torch.finfo(torch.float32).eps * scale[n]
        assert (e.double() - want[n]).abs().max().item() <= bound, n

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    averaged = {n: t.clone() for n, t in ema.state_dict().items()}
    with ema.swapped_in():  # fp32 weights: exchanged in place with the EMA, no copy of them (see below)
        for n, p in model.named_parameters():
            assert torch.equal(p, averaged[n]), n
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
        assert torch.equal(ema.state_dict()[n], averaged[n]), n  # the EMA itself back bit for bit too
    half = tiny_model(seed=1).to(torch.bfloat16)  # weights of another dtype than the EMA: backed up instead
    half_ema = WeightEMA(half, beta)
    half_ema.start()
    with torch.no_grad():
        for p in half.parameters():
            p.add_(1.0)
    kept = {n: p.detach().clone() for n, p in half.named_parameters()}
    with half_ema.swapped_in():
        for n, p in half.named_parameters():
            assert torch.equal(p, half_ema.state_dict()[n].to(torch.bfloat16)), n
    for n, p in half.named_parameters():
        assert torch.equal(p, kept[n]), n

    restored = WeightEMA(model, beta)
    with pytest.raises(RuntimeError, match="before start"):
        restored.update(1)
    restored.load_state_dict({n: t.clone() for n, t in ema.state_dict().items()})
    restored.start()  # a restored EMA is kept, not re-copied from the weights
    for n, t in restored.state_dict().items():
        assert torch.equal(t, ema.state_dict()[n]), n


def test_ema_names_do_not_depend_on_activation_checkpoint_wrapping():
    model = tiny_model(seed=0)
    plain = set(WeightEMA(model, 0.99).state_dict())
    for layer_id, block in model.layers.named_children():
        model.layers.register_module(layer_id, checkpoint_wrapper(block))
    wrapped_names = [n for n, _ in model.named_parameters()]
    assert any("_checkpoint_wrapped_module" in n for n in wrapped_names)
    assert set(WeightEMA(model, 0.99).state_dict()) == plain
    assert plain_name("layers.0._checkpoint_wrapped_module._orig_mod.attention.wq.weight") == (
        "layers.0.attention.wq.weight"
    )
    with pytest.raises(ValueError, match="beta"):
        WeightEMA(model, 1.0)


@pytest.fixture(scope="module")
def validation_loader():
    encode = Encoder(HuggingFaceTokenizer(str(REPO / "assets" / "tiny")))
    cfg = DataConfig(paths=[str(REPO / "assets" / "tiny" / "corpus")], validation_fraction=0.02)
    cfg.source_column = "source"
    return ValidationLoader(cfg, list_shards(cfg.paths), encode, seq_len=64, batch=3, dp_rank=0, dp_world=1)


def validator(loader, steps):
    job = SimpleNamespace(validation=SimpleNamespace(freq=5, steps=steps))
    return FixedSetValidator(job, [loader], SimpleNamespace(dp_enabled=False), torch.enable_grad, torch.no_grad())


def test_validation_is_cross_entropy_only_and_the_same_every_time(validation_loader):
    model = tiny_model(seed=int(torch.randint(0, 2**31, ())))
    v = validator(validation_loader, steps=5)
    assert v.names == ["val"]  # one set: validation_fraction alone
    first = v.validate([model], step=5)["val"]
    assert v.validate([model], step=10) == {"val": first}  # the same batches, the same weights: the same value

    batches = list(validation_loader)[:5]
    assert len(v.batches(validation_loader, torch.device("cpu"))) == len(batches) == 5
    with torch.no_grad():
        logits = torch.cat([model(b["input"]) for b, _ in batches]).flatten(0, 1)
        labels = torch.cat([lab for _, lab in batches]).flatten()
        ce = F.cross_entropy(logits.double(), labels).item()
        z = torch.logsumexp(logits.double(), dim=-1).square().mean().item()
        train_loss = ZLossCrossEntropy(1e-4)
        total = sum(train_loss(model(b["input"]), lab) for b, lab in batches).item() / labels.numel()
    tol = 8 * torch.finfo(torch.float32).eps * ce
    assert abs(first - ce) <= tol
    assert abs((total - first) - 1e-4 * z) <= tol + 1e-4 * z * 1e-5  # only training carries the z-loss
    assert v.should_validate(10) and not v.should_validate(11)


def test_a_fresh_run_validates_the_base_by_default(tmp_path):
    """[validation] at_start: on unless turned off; the trainer runs it when a run starts at step 0 (the
    torchrun runs of test_train_resume check a fresh start validates step 0 and a resume does not)."""
    config = str(REPO / "configs" / "tiny_cpu.toml")
    assert parse_config(["--job.config_file", config]).validation.at_start is True
    assert parse_config(["--job.config_file", config, "--validation.no-at-start"]).validation.at_start is False
    toml = tmp_path / "off.toml"
    toml.write_text(
        (REPO / "configs" / "tiny_cpu.toml").read_text().replace("[validation]\n", "[validation]\nat_start = false\n")
    )
    assert parse_config(["--job.config_file", str(toml)]).validation.at_start is False


def test_validation_longer_than_the_model_is_refused_at_start_up():
    config = parse_config(["--job.config_file", str(REPO / "configs" / "tiny_cpu.toml"), "--training.seq_len", "32"])
    tokenizer = HuggingFaceTokenizer(str(REPO / "assets" / "tiny"))
    with pytest.raises(ValueError, match=r"\[validation\] seq_len = 256 exceeds \[training\] seq_len = 32"):
        build_fixed_set_validator(config, 1, 0, tokenizer, None, torch.no_grad, torch.no_grad())
