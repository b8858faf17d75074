"""Document masking (`[model] attention_mask = "block_causal"`): what a token sees, on CPU ranks as on GPUs; the
graft's identity with it; where the setting is recorded and checked."""

import copy
import json
from types import SimpleNamespace

import pytest
import torch
import torchtitan.models.attention as titan_attention
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torchtitan.models.attention import FlexAttentionWrapper

from mhar_titan import cpu
from mhar_titan.compare.pair import _recipe_check
from mhar_titan.components import fingerprint
from mhar_titan.config import parse_config
from mhar_titan.model.args import FLAVORS, MHAR
from mhar_titan.model.model import MHARTransformer

SEQ, EOS = 64, 1
TOKENIZER = SimpleNamespace(eos_id=EOS)  # all get_attention_masks reads of a tokenizer


@pytest.fixture(autouse=True)
def eager_block_masks(monkeypatch):
    """What the CPU shim does (tested in test_cpu_support.py): block masks built without torch.compile."""
    monkeypatch.setattr(titan_attention, "_compiled_create_block_mask", create_block_mask)


def build(mask: str, seed: int, **mhar) -> MHARTransformer:
    args = copy.deepcopy(FLAVORS["tiny"])
    args.max_seq_len, args.mhar = SEQ, MHAR(**mhar)
    args.attn_mask_type, args.attn_type = mask, "flex" if mask == "block_causal" else "sdpa"
    torch.manual_seed(seed)
    model = MHARTransformer(args)
    with torch.no_grad():
        model.init_weights()
    cpu.use_masked_sdpa(model)
    return model


def logits(model: MHARTransformer, tokens: torch.Tensor) -> torch.Tensor:
    if model.model_args.attn_type == "sdpa":
        return model(tokens)
    return model(tokens, attention_masks=model.get_attention_masks(tokens, TOKENIZER))


def packed(generator: torch.Generator) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Two windows of three documents each (no eos inside a document), and the documents' (start, end)."""
    tokens = torch.randint(2, 2048, (2, SEQ), generator=generator)
    bounds = [(0, 20), (20, 45), (45, SEQ)]
    for _, end in bounds[:-1]:
        tokens[:, end - 1] = EOS  # a document ends with its eos
    return tokens, bounds


@pytest.mark.parametrize("mhar", [False, True], ids=["control", "mhar"])
def test_a_documents_logits_do_not_depend_on_the_other_documents_of_its_window(mhar):
    model = build("block_causal", seed=3, enable=mhar, num_blocks=2)
    causal = build("causal", seed=3, enable=mhar, num_blocks=2)
    g = torch.Generator().manual_seed(0)
    tokens, bounds = packed(g)
    with torch.no_grad():
        seen = logits(model, tokens)
        for start, end in bounds:
            others = torch.randint(2, 2048, tokens.shape, generator=g)
            others[:, start:end] = tokens[:, start:end]  # the same document at the same positions, new neighbours
            others[:, [e - 1 for _, e in bounds[:-1]]] = EOS  # with their ends where they were
            # Exact: masked scores weigh 0 and the same row sums run in the same order.
            assert torch.equal(logits(model, others)[:, start:end], seen[:, start:end]), (start, end)
            if start > 0:  # plain causal attention reads across the boundary
                assert not torch.allclose(logits(causal, others)[:, start:end], logits(causal, tokens)[:, start:end])
        # The first document sees nothing before it either way: block causal agrees with causal there (two
        # kernels, fp32: the difference is rounding, far below the logits' spread).
        first = slice(*bounds[0])
        assert torch.allclose(seen[:, first], logits(causal, tokens)[:, first], rtol=0, atol=1e-5)


def test_the_graft_computes_the_control_bit_for_bit_with_document_masks():
    control = build("block_causal", seed=1)
    mhar = build("block_causal", seed=2, enable=True, num_blocks=2)
    missing, _ = mhar.load_state_dict(control.state_dict(), strict=False)
    assert missing and all("_routing." in k for k in missing)
    tokens, _ = packed(torch.Generator().manual_seed(1))
    assert torch.equal(logits(mhar, tokens), logits(control, tokens))


@pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")
def test_cpu_masked_sdpa_computes_flex_attention_with_the_same_block_mask():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, SEQ, 16, generator=g) for _ in range(3))
    tokens, _ = packed(g)
    model = build("block_causal", seed=0)
    block_mask = model.get_attention_masks(tokens, TOKENIZER)
    ours = cpu.MaskedSDPA()(q, k, v, block_mask=block_mask)
    reference = flex_attention(q, k, v, block_mask=block_mask)  # eager: torch's reference path on a CPU
    assert torch.allclose(ours, reference, rtol=0, atol=1e-5)  # fp32 softmax-weighted means of unit normals
    # every flex module of the model was replaced, none left to hit flex's missing CPU backward
    assert not [m for m in model.modules() if isinstance(m, FlexAttentionWrapper)]
    assert sum(isinstance(m, cpu.MaskedSDPA) for m in model.modules()) == model.n_layers


def test_the_mask_setting_is_checked_and_sets_the_models_attention():
    with pytest.raises(ValueError, match=r"\[model\] attention_mask = 'document' must be one of causal, block_causal"):
        parse_config(["--job.config_file", "configs/tiny_cpu.toml", "--model.attention_mask", "document"])
    for mask, attn in (("causal", "sdpa"), ("block_causal", "flex")):
        cfg = parse_config(["--job.config_file", "configs/tiny_cpu.toml", "--model.attention_mask", mask])
        args = copy.deepcopy(FLAVORS["tiny"])
        args.update_from_config(cfg)
        assert (args.attn_mask_type, args.attn_type) == (mask, attn)


def _fingerprint(overrides: list[str]) -> dict:
    cfg = parse_config(["--job.config_file", "configs/tiny_cpu.toml", *overrides])
    args = copy.deepcopy(FLAVORS["tiny"])
    args.update_from_config(cfg)
    return fingerprint.fingerprint(cfg, args, ["a.parquet"], 8)


def test_both_settings_are_in_the_fingerprint_and_the_pairs_recipe_check(tmp_path):
    plain = _fingerprint([])
    masked = _fingerprint(["--model.attention_mask", "block_causal", "--data.no-loss_on_document_start"])
    assert "loss_on_document_start" not in plain["data"]  # recorded only when set: earlier runs still match
    lines = fingerprint.describe(fingerprint.differences(plain, masked))
    assert lines == [
        'model.attn_mask_type: "causal" in the run, "block_causal" now',
        'data.loss_on_document_start: "<absent>" in the run, false now',  # absent: the default, true
    ]
    with pytest.raises(ValueError, match="architecture"):  # a resume cannot change the mask
        fingerprint.check(plain, masked, ["data"], "run")
    # the pair's comparison names an attention mask that differs between the arms
    for arm, recorded in (("control", plain), ("mhar", masked)):
        (tmp_path / arm).mkdir()
        (tmp_path / arm / fingerprint.FILE).write_text(json.dumps({**recorded, "history": []}))
    check = _recipe_check(tmp_path / "control", tmp_path / "mhar")
    assert check["identical"] is False
    assert 'model.attn_mask_type: "causal" in control, "block_causal" in mhar' in check["differences"]
