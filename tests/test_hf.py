"""HF checkpoints in and out, against transformers' LlamaForCausalLM as the oracle."""

import json
import os
import re
import stat
import struct

import pytest
import torch
from conftest import REPO
from safetensors.torch import load_file, save_file
from tiny_runs import write_tiny_run
from transformers import LlamaConfig, LlamaForCausalLM

from mhar_titan.hf import __main__ as hf_cli
from mhar_titan.hf.export import export_hf, init_hf
from mhar_titan.hf.files import SAFETENSORS_MAX_HEADER
from mhar_titan.hf.ledger import read_json
from mhar_titan.hf.load import inspect, load_hf_model
from mhar_titan.model.args import MHAR, model_args_from_hf_config

VOCAB = 128


def hf_config(**overrides):
    cfg = dict(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
        eos_token_id=1,
    )
    cfg.update(overrides)
    return LlamaConfig(**cfg)


@pytest.fixture
def hf_dir(tmp_path):
    """A random tiny Llama-3.1 saved as sharded safetensors, with a tokenizer file beside it."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_config()).eval()
    path = tmp_path / "base"
    model.save_pretrained(path, max_shard_size="60KB", safe_serialization=True)
    (path / "tokenizer.json").write_text('{"version": "1.0"}')
    assert len(list(path.glob("*.safetensors"))) > 1
    return path, model


def tokens():
    return torch.randint(0, VOCAB, (2, 48))


def test_logits_match_transformers(hf_dir):
    path, ref = hf_dir
    model = load_hf_model(str(path))
    t = tokens()
    with torch.no_grad():
        want = ref(t).logits
        got = model(t)
    assert (got - want).abs().max() / want.abs().max() < 1e-5
    ledger = model.load_ledger
    assert ledger.ok and not ledger.initialised and len(ledger.loaded) == len(ref.state_dict())


def test_mhar_at_init_is_the_control_bit_for_bit(hf_dir):
    path, _ = hf_dir
    control = load_hf_model(str(path))
    mhar = load_hf_model(str(path), mhar={"enable": True, "num_heads": 4, "num_blocks": 2})
    assert len(mhar.load_ledger.initialised) == 4 * 2 * 4
    assert set(mhar.load_ledger.initialised.values()) == {"zeros", "ones"}
    t = tokens()
    with torch.no_grad():
        assert torch.equal(mhar(t), control(t))


def test_export_round_trips_every_tensor(hf_dir, tmp_path):
    path, ref = hf_dir
    model = load_hf_model(str(path))
    out = tmp_path / "export"
    export_hf(model, str(out), base_path=str(path), dtype=torch.float32, max_shard_bytes=40_000)
    assert (out / "tokenizer.json").exists() and (out / "model.safetensors.index.json").exists()
    again = load_hf_model(str(out))
    for (k, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    theirs = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    for k, v in ref.state_dict().items():
        assert torch.equal(theirs.state_dict()[k], v), k


def test_mhar_export_keeps_routing_or_refuses(hf_dir, tmp_path):
    path, _ = hf_dir
    mhar_cfg = {"enable": True, "num_heads": 4, "num_blocks": 2}
    model = load_hf_model(str(path), mhar=mhar_cfg)
    # closed gates: the plain model is exact, so a routing-free export is allowed
    export_hf(model, str(tmp_path / "plain"), base_path=str(path), dtype=torch.float32, include_routing=False)
    assert "mhar" not in read_json(str(tmp_path / "plain" / "config.json"))
    LlamaForCausalLM.from_pretrained(tmp_path / "plain")

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_routing." in name:
                p.copy_(torch.randn_like(p))
    with pytest.raises(ValueError, match="gates are not 0"):
        export_hf(model, str(tmp_path / "refused"), base_path=str(path), include_routing=False)
    assert not (tmp_path / "refused").exists()

    export_hf(model, str(tmp_path / "mhar"), base_path=str(path), dtype=torch.float32)
    config = read_json(str(tmp_path / "mhar" / "config.json"))
    assert config["mhar"]["num_blocks"] == 2 and config["model_type"] == "mhar_llama"
    again = load_hf_model(str(tmp_path / "mhar"), mhar=mhar_cfg)
    assert not again.load_ledger.initialised
    for (k, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    with pytest.raises(ValueError, match="an MHAR export with enable = True, loaded with mhar enable = False"):
        load_hf_model(str(tmp_path / "mhar"), mhar={"enable": False})  # the control cannot drop trained routing


def _single_file(path, tmp_path, edit):
    model = load_hf_model(str(path))
    out = tmp_path / "single"
    export_hf(model, str(out), base_path=str(path), dtype=torch.float32)
    tensors = {}
    for shard in out.glob("*.safetensors"):
        tensors.update(load_file(shard))
        shard.unlink()
    (out / "model.safetensors.index.json").unlink()
    edit(tensors)
    save_file(tensors, out / "model.safetensors")
    return out


@pytest.mark.parametrize(
    "edit,words",
    [
        (lambda t: t.pop("model.layers.2.mlp.up_proj.weight"), "missing: layers.2.feed_forward.w3.weight"),
        (
            lambda t: t.update({"model.norm.weight": torch.ones(65)}),
            r"model\.norm\.weight: shape \(65,\) in the checkpoint",
        ),
        (lambda t: t.update({"model.layers.0.extra.weight": torch.ones(3)}), r"unused: model\.layers\.0\.extra"),
        (lambda t: t.update({"lm_head.weight": t["lm_head.weight"].bfloat16()}), r"lm_head\.weight: dtype BF16"),
    ],
)
def test_bad_checkpoints_fail_naming_the_key(hf_dir, tmp_path, edit, words):
    path, _ = hf_dir
    bad = _single_file(path, tmp_path, edit)
    with pytest.raises(ValueError, match=words):
        load_hf_model(str(bad))
    assert "load ledger" in inspect(str(bad))


@pytest.mark.parametrize(
    "override,field_name",
    [
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unrepresentable_configs_are_refused_by_field(override, field_name):
    cfg = {**hf_config().to_dict(), **override}
    if "rope_scaling" in override:
        cfg.pop("rope_parameters", None)
    with pytest.raises(ValueError, match=field_name):
        model_args_from_hf_config(json.loads(json.dumps(cfg)))
    with pytest.raises(ValueError, match="model_type"):
        model_args_from_hf_config({**hf_config().to_dict(), "model_type": "mistral"})


def test_marin8b_config_gives_the_marin8b_flavor():
    from mhar_titan.model.args import FLAVORS

    cfg = hf_config(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        eos_token_id=128001,
    )
    args = model_args_from_hf_config(cfg.to_dict())
    want = FLAVORS["marin8b"]
    with torch.device("meta"):
        from mhar_titan.model.model import MHARTransformer

        ours, flavor = MHARTransformer(args), MHARTransformer(want)
    assert [(k, v.shape) for k, v in ours.state_dict().items()] == [
        (k, v.shape) for k, v in flavor.state_dict().items()
    ]
    assert (args.norm_eps, args.rope_theta, args.rope_scaling_args) == (
        want.norm_eps,
        want.rope_theta,
        want.rope_scaling_args,
    )


def test_inspect_cli_summarises_a_checkpoint(hf_dir, capsys):
    """`python -m mhar_titan.hf inspect`'s main (tests/test_cli_help.py runs the command itself)."""
    path, ref = hf_dir
    hf_cli.main(["inspect", str(path)])
    out = capsys.readouterr().out
    n = sum(p.numel() for p in ref.parameters())
    assert "4 layers" in out and f"{n:,} parameters" in out
    assert f"{len(ref.state_dict())} tensors loaded" in out and "0 unused" in out


def test_init_writes_a_random_base_that_loads_back_exactly(tmp_path):
    import copy

    from mhar_titan.hf.export import init_hf
    from mhar_titan.model.args import FLAVORS
    from mhar_titan.model.model import build_initialised

    seed = int(torch.randint(0, 2**31, ()))
    init_hf(str(tmp_path / "base"), "tiny", tokenizer_dir=str(REPO / "assets" / "tiny"), seed=seed)
    assert (tmp_path / "base" / "tokenizer.json").is_file()
    loaded = load_hf_model(str(tmp_path / "base"), dtype=torch.float32).state_dict()
    torch.manual_seed(seed)
    want = build_initialised(copy.deepcopy(FLAVORS["tiny"]))
    for key, value in want.state_dict().items():
        assert torch.equal(loaded[key], value), key
    with pytest.raises(ValueError, match="flavor 'nope'"):
        init_hf(str(tmp_path / "other"), "nope")


def test_hf_smoke_writes_loads_both_arms_and_finds_identical_logits(capsys):
    from benchmarks.hf_smoke import main as smoke_main
    from mhar_titan.model.args import FLAVORS

    smoke_main(["--flavor", "tiny", "--num-blocks", "2", "--tokens", "16", "--dtype", "fp32"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["logits_identical"] is True and result["max_abs_diff"] == 0.0
    tiny = FLAVORS["tiny"]
    assert result["mhar_parameters"] - result["control_parameters"] == 2 * tiny.n_layers * (3 * tiny.dim + 1)


@pytest.fixture
def bad_header_dir(tmp_path):
    """A checkpoint directory whose single model.safetensors is written by the test."""
    path = tmp_path / "bad"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(hf_config().to_dict()))
    return path


def _framed(header: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header


@pytest.mark.parametrize(
    "content,words",
    [
        (b"\x10\x00", r"not a safetensors file: 2 bytes, shorter than the 8-byte header length"),
        (
            struct.pack("<Q", 2**62) + b"{}",
            r"corrupt safetensors header: length 4611686018427387904 bytes, but the file has 2 after",
        ),
        (
            struct.pack("<Q", 1000) + b'{"a": 1}',
            r"corrupt safetensors header: length 1000 bytes, but the file has 8 after",
        ),
        (_framed(b'{"w": {"dtype": "F32", "shape": [1], '), r"corrupt safetensors header: not JSON"),
        (_framed(b"\xff\xfe\x00{"), r"corrupt safetensors header: not JSON"),
        (_framed(b"[1, 2]"), r"corrupt safetensors header: JSON list, expected an object"),
        (_framed(b'{"w": 3}'), r"corrupt safetensors header: tensor 'w' has no dtype and shape: 3"),
    ],
    ids=["truncated", "huge-length", "length-past-the-end", "garbage-json", "not-utf8", "json-list", "bad-entry"],
)
def test_corrupt_safetensors_headers_are_refused_naming_the_file(bad_header_dir, content, words):
    shard = bad_header_dir / "model.safetensors"
    shard.write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(str(shard)) + ": " + words):
        load_hf_model(str(bad_header_dir))


def test_safetensors_header_longer_than_the_format_allows_is_refused_unread(bad_header_dir):
    shard = bad_header_dir / "model.safetensors"
    with open(shard, "wb") as f:
        f.write(struct.pack("<Q", SAFETENSORS_MAX_HEADER + 1))
        f.truncate(SAFETENSORS_MAX_HEADER + 100)  # sparse: nothing is written or read
    with pytest.raises(
        ValueError, match=rf"length {SAFETENSORS_MAX_HEADER + 1} bytes, .* at most {SAFETENSORS_MAX_HEADER}"
    ):
        inspect(str(bad_header_dir))


@pytest.mark.parametrize("field_name", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("key", ["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"])
def test_llama3_rope_without_a_field_is_refused_by_name(field_name, key):
    cfg = hf_config().to_dict()
    rope = cfg.pop("rope_parameters")
    del rope[key]
    cfg[field_name] = rope
    want = (
        f"config.json: {field_name}.{key} is missing (rope type llama3 needs factor, low_freq_factor, "
        "high_freq_factor, original_max_position_embeddings)"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(want)}$"):
        model_args_from_hf_config(cfg)


@pytest.mark.parametrize("mask", [0o022, 0o027], ids=["umask022", "umask027"])
def test_export_and_init_folders_get_the_mode_mkdir_would_give(hf_dir, tmp_path, mask):
    path, _ = hf_dir
    model = load_hf_model(str(path))
    old = os.umask(mask)
    try:
        export_hf(model, str(tmp_path / "export"), base_path=str(path), dtype=torch.float32)
        init_hf(str(tmp_path / "init"), "tiny")
        (tmp_path / "plain").mkdir()
    finally:
        os.umask(old)
    want = 0o777 & ~mask
    assert stat.S_IMODE((tmp_path / "plain").stat().st_mode) == want
    assert stat.S_IMODE((tmp_path / "export").stat().st_mode) == want
    assert stat.S_IMODE((tmp_path / "init").stat().st_mode) == want


def test_export_cli_checks_its_inputs_first_and_answers_in_one_line(tmp_path, capsys):
    run, out = tmp_path / "run", tmp_path / "out"
    write_tiny_run(run, tmp_path / "no-base", MHAR(enable=False), seed=0, step=4)
    out.mkdir()
    for argv, message in [
        ([str(run), str(out)], f"{out} already exists; export into a new directory"),
        ([str(tmp_path / "nothing"), str(tmp_path / "o1")], "no complete checkpoint (step-N with .metadata)"),
        ([str(run), str(tmp_path / "o2"), "--step", "7"], "no complete checkpoint for step 7; have [4]"),
    ]:
        with pytest.raises(SystemExit) as stop:
            hf_cli.main(["export", *argv])
        assert str(stop.value).startswith("python -m mhar_titan.hf export: ") and message in str(stop.value)
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
    hf_cli.main(["export", str(run), str(tmp_path / "o3"), "--dtype", "fp32"])
    printed = capsys.readouterr()
    assert f"the run's base {tmp_path / 'no-base'} is not there: the export gets no tokenizer files" in printed.err
    assert "reading " in printed.out and (tmp_path / "o3" / "config.json").is_file()
