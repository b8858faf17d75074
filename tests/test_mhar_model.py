"""The grafted model: identity at init, the source lists (docs/design.md section 1.2), settings, groups,
statistics."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO
from tiny_runs import routed_tiny_model
from torchtitan.config import Optimizer as OptimizerConfig
from torchtitan.models.llama3.model.model import Transformer

import mhar_titan.model.model as model_mod
from mhar_titan.components.lr_schedule import build_lr_schedulers
from mhar_titan.components.optimizer import build_optimizers
from mhar_titan.components.routing_stats import name_routing_stats
from mhar_titan.config import parse_config
from mhar_titan.model.args import FLAVORS, MHAR
from mhar_titan.model.model import MHARTransformer

SEQ = 32


def tiny_args(**mhar):
    args = copy.deepcopy(FLAVORS["tiny"])
    args.max_seq_len = SEQ
    args.mhar = MHAR(**mhar)
    return args


def build(args, seed=0):
    torch.manual_seed(seed)
    model = MHARTransformer(args)
    with torch.no_grad():
        model.init_weights()
    return model


def batch(vocab=2048):
    return torch.randint(0, vocab, (2, SEQ)), torch.randint(0, vocab, (2, SEQ))


def ce(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def routing_keys(model):
    return sorted(k for k in model.state_dict() if "_routing." in k)


def test_disabled_model_is_torchtitans_llama3():
    args = tiny_args(enable=False)
    ours = build(args)
    plain = Transformer(copy.deepcopy(args))
    plain.load_state_dict(ours.state_dict(), strict=True)
    tokens, _ = batch()
    assert routing_keys(ours) == []
    assert torch.equal(ours(tokens), plain(tokens))


def test_zero_gates_compute_the_control_bit_for_bit_before_and_after_a_step():
    control = build(tiny_args(enable=False), seed=1)
    mhar = build(tiny_args(enable=True, num_blocks=2), seed=2)
    missing, unexpected = mhar.load_state_dict(control.state_dict(), strict=False)
    assert sorted(missing) == routing_keys(mhar) and not unexpected
    tokens, labels = batch()
    assert torch.equal(mhar(tokens), control(tokens))
    assert torch.equal(ce(mhar(tokens), labels), ce(control(tokens), labels))

    opt = torch.optim.AdamW(control.parameters(), lr=1e-2)
    ce(control(tokens), labels).backward()
    opt.step()
    mhar.load_state_dict(control.state_dict(), strict=False)
    tokens, labels = batch()
    assert torch.equal(mhar(tokens), control(tokens))
    assert torch.equal(ce(mhar(tokens), labels), ce(control(tokens), labels))


def test_at_init_only_the_gates_receive_gradient():
    model = build(tiny_args(enable=True, num_blocks=4))
    tokens, labels = batch()
    ce(model(tokens), labels).backward()
    for name, p in model.named_parameters():
        if "_routing." not in name:
            continue
        if name.endswith(".gate"):
            assert p.grad.abs().item() > 0, name
        else:
            assert torch.count_nonzero(p.grad) == 0, name


@pytest.mark.parametrize("num_blocks", [1, 2, 4])
def test_each_site_routes_over_designs_source_list(monkeypatch, num_blocks):
    model = build(tiny_args(enable=True, num_blocks=num_blocks, num_heads=4))
    with torch.no_grad():  # random routing parameters, non-zero gates
        for name, p in model.named_parameters():
            if "_routing." in name:
                p.copy_(torch.randn_like(p) * (0.1 if name.endswith(".gate") else 1.0))

    calls, inputs, outputs = [], [], []
    real = model_mod.mhar_route_with_logits

    def spy(x, sources, *a, **k):
        routed, logits = real(x, sources, *a, **k)
        calls.append((x, list(sources), routed.detach().double()))
        return routed, logits

    monkeypatch.setattr(model_mod, "mhar_route_with_logits", spy)
    for layer in model.layers.values():
        for norm, sub in ((layer.attention_norm, layer.attention), (layer.ffn_norm, layer.feed_forward)):
            norm.register_forward_pre_hook(lambda mod, args: inputs.append(args[0].detach().double()))
            sub.register_forward_hook(lambda mod, args, out: outputs.append(out.detach().double()))

    tokens, _ = batch()
    model(tokens)
    emb = model.tok_embeddings(tokens)
    n_layers, per_block = model.n_layers, model.n_layers // num_blocks
    assert len(calls) == len(inputs) == len(outputs) == 2 * n_layers
    h = emb.double()
    for i in range(2 * n_layers):
        block = i // 2 // per_block
        x, sources, routed = calls[i]
        assert x is None  # the site routes the sources alone; the block adds its stream input
        # u_l = h_{l-1} + gate R, then v_l = h'_l + gate R
        torch.testing.assert_close(inputs[i], h + routed, rtol=1e-6, atol=1e-6)
        assert len(sources) == 1 + block  # [h_0, D_0, ..., D_{b-1}]; the null source is the op's source 0
        assert torch.equal(sources[0], emb)
        for k in range(block):
            d_k = sum(outputs[2 * per_block * k : 2 * per_block * (k + 1)])  # all a and m of block k
            torch.testing.assert_close(sources[1 + k].double(), d_k, rtol=1e-6, atol=1e-6)
        h = h + outputs[i]


@pytest.mark.parametrize(
    "setting,value,words",
    [
        ("num_heads", 3, "num_heads = 3"),
        ("num_heads", 0, "num_heads = 0"),
        ("num_blocks", 3, "num_blocks = 3"),
        ("num_blocks", -2, "num_blocks = -2"),
        ("lr_multiplier", -1.0, "lr_multiplier = -1.0"),
        ("stats_freq", -5, "stats_freq = -5"),
        ("backend", "cuda", "backend = 'cuda'"),
    ],
)
def test_invalid_settings_fail_at_start_up_naming_the_setting(setting, value, words):
    cfg = parse_config(["--job.config_file", str(REPO / "configs/tiny_cpu_mhar.toml"), f"--mhar.{setting}", str(value)])
    args = copy.deepcopy(FLAVORS["tiny"])
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        args.update_from_config(cfg)


def test_more_blocks_than_the_kernels_take_need_the_torch_backend():
    with pytest.raises(ValueError, match="num_blocks = 16: the triton backend"):
        MHAR(enable=True, num_blocks=16).validate(4096, 32)
    MHAR(enable=True, num_blocks=16, backend="torch").validate(4096, 32)


def test_8b_routing_adds_786496_parameters():
    counts = {}
    for enable in (False, True):
        args = copy.deepcopy(FLAVORS["marin8b"])
        args.mhar = MHAR(enable=enable)
        with torch.device("meta"):
            counts[enable] = sum(p.numel() for p in MHARTransformer(args).parameters())
    assert counts[True] - counts[False] == 786_496 == 2 * 32 * (3 * 4096 + 1)


def test_routing_parameters_have_no_weight_decay_and_the_lr_multiplier():
    model = build(tiny_args(enable=True, num_blocks=2, lr_multiplier=2.5))
    cfg = OptimizerConfig(lr=4e-4, weight_decay=0.05, implementation="foreach")
    optimizers = build_optimizers([model], cfg, parallel_dims=None)
    (opt,) = optimizers.optimizers
    groups = {g["name"]: g for g in opt.param_groups}
    routing_params = {id(p) for n, p in model.named_parameters() if "_routing." in n}
    assert {id(p) for p in groups["routing"]["params"]} == routing_params and len(routing_params) == 4 * 2 * 4
    assert sum(len(g["params"]) for g in groups.values()) == len(list(model.parameters()))
    assert (groups["decay"]["weight_decay"], groups["no_decay"]["weight_decay"]) == (0.05, 0.0)
    assert groups["routing"]["weight_decay"] == 0.0

    sched_cfg = parse_config(["--job.config_file", str(REPO / "configs/tiny_cpu_mhar.toml")]).lr_scheduler
    schedulers = build_lr_schedulers(optimizers, sched_cfg, 100)
    for _ in range(7):
        optimizers.step()
        schedulers.step()
        assert groups["routing"]["lr"] == pytest.approx(2.5 * groups["decay"]["lr"], rel=1e-12)
        assert groups["no_decay"]["lr"] == groups["decay"]["lr"] > 0


def test_routing_stats_at_init_are_uniform_routing():
    num_blocks = 4
    model = build(tiny_args(enable=True, num_blocks=num_blocks))
    tokens, _ = batch()
    model(tokens)
    assert model.routing_stats is None  # computed only when asked for (the trainer asks on log steps)
    model.collect_routing_stats = True
    model(tokens)
    stats = model.routing_stats
    assert stats.shape == (4, 2, 2 + num_blocks + 1)  # gate, entropy, then null, embedding, D_0, D_1, D_2
    for layer in range(4):
        n = 2 + layer  # one layer per block: null, embedding, then `layer` deltas
        gate, entropy = stats[layer, :, 0], stats[layer, :, 1]
        torch.testing.assert_close(gate, torch.zeros(2))
        torch.testing.assert_close(entropy, torch.full((2,), math.log(n)))
        torch.testing.assert_close(stats[layer, :, 2 : 2 + n], torch.full((2, n), 1 / n))
        assert stats[layer, :, 2 + n :].isnan().all()  # sources this layer's block does not read

    named = name_routing_stats(stats)
    assert named["mhar_attn_w_null/layer00"] == named["mhar_ffn_w_embed/layer00"] == pytest.approx(1 / 2)
    assert named["mhar_ffn_w_d02/layer03"] == pytest.approx(1 / 5) and "mhar_ffn_w_d02/layer02" not in named
    assert named["mhar_attn_w_deltas/layer00"] == 0.0
    assert named["mhar_attn_w_deltas/layer03"] == pytest.approx(3 / 5)
    assert named["mhar/entropy/mean"] == pytest.approx(sum(math.log(n) for n in (2, 3, 4, 5)) / 4)
    assert named["mhar/w_deltas/mean"] == pytest.approx((0 + 1 / 3 + 2 / 4 + 3 / 5) / 4)
    assert not [v for v in named.values() if math.isnan(v)]
    # per layer: gate, entropy, w_null, w_embed, w_deltas and one weight per delta it reads; 5 means
    assert len(named) == 2 * sum(5 + layer for layer in range(4)) + 5
    with pytest.raises(ValueError, match=r"routing statistics of shape \(4, 2, 6\)"):
        name_routing_stats(stats[..., :6])  # 3 blocks do not divide 4 layers


def test_site_stats_are_per_source_means_of_the_weights_padded_to_the_model_width():
    torch.manual_seed(3)
    site = model_mod.RoutingSite(16, 4, 1e-5, "torch", max_sources=5)
    site.reset_parameters()
    with torch.no_grad():
        site.gate.fill_(0.25)
    logits = 3 * torch.randn(3, 2, 7, 4, dtype=torch.float64)  # [N, B, T, H], what the op returns
    weights = torch.softmax(logits, dim=0)
    row = site.stats(logits)
    assert row.shape == (2 + 5,) and row.dtype == torch.float32
    assert row[0] == 0.25
    expected_entropy = -(weights * weights.log()).sum(0).mean()
    torch.testing.assert_close(row[1].double(), expected_entropy, rtol=1e-6, atol=0)
    torch.testing.assert_close(row[2:5].double(), weights.mean(dim=(1, 2, 3)), rtol=1e-6, atol=0)
    assert row[5:].isnan().all() and float(row[2:5].sum()) == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError, match="more than max_sources = 2"):
        model_mod.RoutingSite(16, 4, 1e-5, "torch", max_sources=2).stats(logits)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_each_block_delta_is_the_sum_of_its_sublayer_outputs(dtype):
    """The sources a layer reads: the embedding, then D_k for each completed block (the last block's
    never), the running sum of the block's sublayer outputs a + m that its bodies add up: the first
    layer's a + m, then each later layer's added in fp32 and rounded once. In float64 D_k is
    h_end - h_start to rounding (in bf16 that difference would cancel)."""
    model = routed_tiny_model(seq=16, num_blocks=2, backend="torch", device="cpu").to(dtype)
    inputs, outs, read = {}, {}, []
    route_block = model.route_block
    model.route_block = lambda block, sources: read.append(sources) or route_block(block, sources)
    for i, layer in enumerate(model.layers.values()):
        layer.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0]))
        layer.register_forward_hook(lambda m, a, out, i=i: outs.__setitem__(i, out[1]))
        layer.attention.register_forward_hook(lambda m, a, out, i=i: outs.__setitem__(("a", i), out))
        layer.feed_forward.register_forward_hook(lambda m, a, out, i=i: outs.__setitem__(("m", i), out))
    with torch.no_grad():
        model(torch.randint(0, model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)))
    assert [len(sources) for sources in read] == [1, 2]  # each block's: the embedding, then D_0 for the second
    d0 = read[1][1]
    assert d0 is outs[1] and torch.equal(outs[0], outs[("a", 0)] + outs[("m", 0)])
    wide = torch.promote_types(dtype, torch.float32)
    assert torch.equal(d0, (outs[0].to(wide) + outs[("a", 1)] + outs[("m", 1)]).to(dtype))
    if dtype == torch.float64:
        torch.testing.assert_close(d0, inputs[2] - inputs[0], rtol=1e-12, atol=1e-12)
