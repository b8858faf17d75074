"""The MHAR arm's own HF architecture (mhar_llama, remote code): logits, generation, refusals, round trip."""

import ast
import json

import pytest
import torch
from test_hf import VOCAB, hf_config
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from mhar_titan.hf.export import export_hf
from mhar_titan.hf.files import MHAR_LAYER_TYPE, MODELING_DIR, MODELING_FILES
from mhar_titan.hf.ledger import read_json
from mhar_titan.hf.load import load_hf_model
from mhar_titan.hf.modeling.configuration_mhar_llama import MHAR_LAYER_TYPE as MODELING_LAYER_TYPE
from mhar_titan.hf.modeling.configuration_mhar_llama import MHARLlamaConfig
from mhar_titan.hf.modeling.modeling_mhar_llama import MHARLlamaForCausalLM
from mhar_titan.model.args import model_args_from_hf_config
from mhar_titan.model.sources import SITE_NAMES, SourceLayout

MHAR_CFG = {"enable": True, "num_heads": 4, "num_blocks": 2, "backend": "torch"}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A random tiny Llama-3.1 in HF format (4 layers: 2 routing blocks of 2)."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf") / "base"
    LlamaForCausalLM(hf_config()).save_pretrained(path, max_shard_size="60KB")
    return path


def mhar_model(base, open_gates: bool):
    model = load_hf_model(str(base), mhar=MHAR_CFG)
    if open_gates:
        torch.manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "_routing." in name:
                    p.copy_(torch.randn_like(p) * 0.5)
    return model


def exported(model, base, out):
    export_hf(model, str(out), base_path=str(base), dtype=torch.float32, max_shard_bytes=40_000)
    return out


def remote(path):
    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()


def tokens(n=32):
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("open_gates", [False, True], ids=["gates-0", "gates-open"])
def test_remote_code_logits_equal_ours(base, tmp_path, open_gates):
    model = mhar_model(base, open_gates)
    out = exported(model, base, tmp_path / "mhar")
    config = read_json(str(out / "config.json"))
    assert config["model_type"] == "mhar_llama" and config["architectures"] == ["MHARLlamaForCausalLM"]
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModelForCausalLM"}
    assert config["mhar"] == {"num_heads": 4, "num_blocks": 2, "variant": "delta"}
    assert all((out / name).is_file() for name in MODELING_FILES)
    theirs = remote(out)
    assert type(theirs).__name__ == "MHARLlamaForCausalLM"
    t = tokens()
    with torch.no_grad():
        want, got = model(t), theirs(t).logits
        plain = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)(t).logits
    assert (got - want).abs().max() / want.abs().max() < 1e-5
    assert torch.equal(plain, got) if not open_gates else (plain - got).abs().max() > 1e-2


def test_generate_with_cache_equals_our_greedy_continuation(base, tmp_path):
    model = mhar_model(base, open_gates=True)
    theirs = remote(exported(model, base, tmp_path / "mhar"))
    prompt = tokens(8)[:1]
    cached = theirs.generate(prompt, max_new_tokens=5, do_sample=False, use_cache=True)
    uncached = theirs.generate(prompt, max_new_tokens=5, do_sample=False, use_cache=False)
    seq = prompt
    with torch.no_grad():
        for _ in range(5):
            seq = torch.cat([seq, model(seq)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(cached, uncached) and torch.equal(cached, seq)


def test_plain_llama_loaders_refuse_an_mhar_export(base, tmp_path):
    out = exported(mhar_model(base, open_gates=True), base, tmp_path / "mhar")
    # LlamaConfig validates layer_types: the export's `mhar_delta` entries are not an attention kind it knows.
    with pytest.raises(Exception, match=r"layer_types` entries must be in .* but got \['mhar_delta'"):
        LlamaForCausalLM.from_pretrained(out)
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        AutoModelForCausalLM.from_pretrained(out)
    # a folder re-saved by transformers keeps the marker, and so still refuses
    resaved = tmp_path / "resaved"
    remote(out).save_pretrained(resaved)
    assert read_json(str(resaved / "config.json"))["layer_types"] == [MHAR_LAYER_TYPE] * 4
    with pytest.raises(Exception, match="mhar_delta"):
        LlamaForCausalLM.from_pretrained(resaved)


def test_round_trip_is_exact_and_reads_the_exports_settings(base, tmp_path):
    model = mhar_model(base, open_gates=True)
    first = exported(model, base, tmp_path / "first")
    again = load_hf_model(str(first))  # the export's own mhar settings, no argument
    assert (again.model_args.mhar.num_heads, again.model_args.mhar.num_blocks) == (4, 2)
    assert not again.load_ledger.initialised and again.load_ledger.ok
    second = exported(again, first, tmp_path / "second")
    assert (first / "config.json").read_text() == (second / "config.json").read_text()
    for name in ("model.safetensors.index.json", *MODELING_FILES):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    for (k, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    # the export's own block passed back in (with its "variant") is consistent, so it loads
    load_hf_model(str(first), mhar=read_json(str(first / "config.json"))["mhar"])


@pytest.mark.parametrize(
    "mhar,words",
    [
        ({"enable": True, "num_heads": 2, "num_blocks": 2}, "num_heads = 4, loaded with mhar num_heads = 2"),
        ({"enable": True, "num_heads": 4, "num_blocks": 4}, "num_blocks = 2, loaded with mhar num_blocks = 4"),
        ({"enable": False}, "enable = True, loaded with mhar enable = False"),
    ],
)
def test_contradicting_mhar_settings_are_refused_by_name(base, tmp_path, mhar, words):
    out = exported(mhar_model(base, open_gates=False), base, tmp_path / "mhar")
    with pytest.raises(ValueError, match=words):
        load_hf_model(str(out), mhar=mhar)


def test_the_trainer_base_path_refuses_an_mhar_export_naming_why(base, tmp_path):
    out = exported(mhar_model(base, open_gates=False), base, tmp_path / "mhar")
    config = read_json(str(out / "config.json"))
    with pytest.raises(ValueError, match="model_type = .mhar_llama.: an MHAR export is not a training base"):
        model_args_from_hf_config(config)
    model_args_from_hf_config(read_json(str(base / "config.json")))  # plain Llama bases still load
    plain = {**config, "model_type": "llama"}
    with pytest.raises(ValueError, match="architectures"):
        model_args_from_hf_config(plain)


def test_control_export_stays_plain_llama(base, tmp_path):
    out = exported(load_hf_model(str(base)), base, tmp_path / "control")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert not {"auto_map", "mhar", "layer_types"} & set(config)
    assert not any((out / name).exists() for name in MODELING_FILES)


def test_modeling_files_stand_alone():
    """Only torch, transformers (and packaging, which transformers requires), the standard library and each
    other: they are copied into exports that load without mhar_titan."""
    allowed = {"__future__", "typing", "inspect", "torch", "transformers", "packaging"}
    for name in MODELING_FILES:
        tree = ast.parse(open(f"{MODELING_DIR}/{name}").read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert node.module.split(".")[0] in allowed, node.module
            elif isinstance(node, ast.Import):
                assert all(a.name.split(".")[0] in allowed for a in node.names)
    assert MHAR_LAYER_TYPE == MODELING_LAYER_TYPE
    with pytest.raises(ValueError, match="mhar.num_blocks = 3"):
        MHARLlamaConfig(mhar={"num_heads": 4, "num_blocks": 3}, **hf_config().to_dict())


@pytest.mark.parametrize("num_blocks", [1, 2, 4, 8])
def test_each_layer_reads_the_layouts_sources(num_blocks):
    """The standalone modeling file keeps its own arithmetic: held here to the project's source layout (sites per
    layer, and per site the null and the caller sources it reads), over 8 layers."""
    llama = hf_config(num_hidden_layers=8).to_dict()
    config = MHARLlamaConfig(mhar={"num_heads": 4, "num_blocks": num_blocks}, **llama)
    model = MHARLlamaForCausalLM(config).eval()
    layout = SourceLayout(num_blocks, config.num_hidden_layers)
    read = {}  # (layer, site): the sources the site is given; it stacks its own null before them
    for i, layer in enumerate(model.model.layers):
        assert tuple(layer.mhar) == SITE_NAMES
        for site, module in layer.mhar.items():
            module.register_forward_pre_hook(lambda m, a, key=(i, site): read.__setitem__(key, len(a[1])))
    with torch.no_grad():
        model(tokens(8))
    assert read == {(i, site): layout.caller_sources(i) for i in range(layout.n_layers) for site in SITE_NAMES}
