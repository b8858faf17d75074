"""Job configs parse through train_cpt's parser and hold the recipe they claim."""

import tomllib

import pytest
import torch
from conftest import REPO

from mhar_titan.config import CONFIG_MODULE, MODEL_NAME, parse_config
from mhar_titan.model.args import FLAVORS
from mhar_titan.train_spec import build_train_spec


def _parse(name: str, *overrides: str):
    return parse_config(["--job.config_file", str(REPO / "configs" / name), *overrides])


def test_tiny_config_parses_with_project_sections():
    cfg = _parse("tiny_cpu.toml", "--training.steps", "7")
    assert cfg.job.custom_config_module == CONFIG_MODULE
    assert cfg.model.name == MODEL_NAME and cfg.model.flavor == "tiny"
    assert cfg.training.steps == 7
    assert cfg.training.seq_len in range(128, 257)


def test_marin8b_control_config_holds_the_recipe():
    cfg = _parse("marin8b_control.toml")
    t, o, s = cfg.training, cfg.optimizer, cfg.lr_scheduler
    assert (t.seq_len, t.local_batch_size, t.global_batch_size, t.steps) == (4096, 2, 256, 9500)
    assert (t.dtype, t.mixed_precision_param, t.mixed_precision_reduce) == ("float32", "bfloat16", "float32")
    assert t.max_norm == 1.0
    assert (o.name, o.lr, o.beta1, o.beta2, o.eps, o.weight_decay) == ("AdamW", 4e-4, 0.9, 0.95, 1e-8, 0.05)
    assert s.decay_type == "linear" and o.lr * s.min_lr_factor == pytest.approx(4e-6, rel=1e-12)
    assert cfg.activation_checkpoint.mode == "none"  # the memory plan's choice for 8x 80 GB (tests/test_plan.py)
    assert cfg.compile.enable and "model" in cfg.compile.components
    assert cfg.parallelism.data_parallel_shard_degree == -1
    assert cfg.checkpoint.initial_load_in_hf and cfg.model.flavor == "hf"
    assert cfg.checkpoint.initial_load_path is None  # the base path is set once, in model.hf_assets_path
    assert (cfg.ema.enable, cfg.ema.beta, cfg.loss.z_loss) == (True, 0.999, 1e-4)
    assert cfg.validation.enable and cfg.validation.seq_len == 4096


def test_other_model_names_are_refused_by_name():
    with pytest.raises(ValueError, match="'llama3'"):
        _parse("tiny_cpu.toml", "--model.name", "llama3")


def test_marin8b_flavor_is_llama31_8b():
    args = FLAVORS["marin8b"]
    with torch.device("meta"):
        model = build_train_spec().model_cls(args)
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248  # Llama-3.1-8B
    assert model.layers["0"].feed_forward.w1.out_features == 14336
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads) == (4096, 32, 32, 8)
    assert (args.vocab_size, args.norm_eps, args.rope_theta) == (128256, 1e-5, 500000)
    r = args.rope_scaling_args
    assert (r.scaling_factor, r.low_freq_factor, r.high_freq_factor, r.original_max_position_embeddings) == (
        8.0,
        1.0,
        4.0,
        8192,
    )


def test_tiny_flavor_has_a_few_million_parameters():
    with torch.device("meta"):
        model = build_train_spec().model_cls(FLAVORS["tiny"])
    assert 1_000_000 < sum(p.numel() for p in model.parameters()) < 10_000_000


@pytest.mark.parametrize(
    "pair", [("tiny_cpu.toml", "tiny_cpu_mhar.toml"), ("marin8b_control.toml", "marin8b_mhar.toml")]
)
def test_pair_configs_differ_only_in_mhar_and_run_names(pair):
    control = tomllib.loads((REPO / "configs" / pair[0]).read_text())
    mhar = tomllib.loads((REPO / "configs" / pair[1]).read_text())
    assert control.pop("mhar") == {"enable": False} and mhar.pop("mhar")["enable"] is True
    for cfg in (control, mhar):
        cfg["job"].pop("dump_folder")
        cfg["job"].pop("description")
    assert control == mhar
    assert not _parse(pair[0]).mhar.enable and _parse(pair[1]).mhar.enable
    parsed = _parse(pair[1]).mhar
    parsed.validate(4096, 32)  # the 8B geometry takes the MHAR arm's settings


def test_a_url_as_the_run_folder_is_refused_not_made_a_local_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where os.makedirs would have made `s3:/bucket/run`
    with pytest.raises(ValueError, match=r"= 's3://bucket/run' is a URL: the run folder .* must be a local"):
        _parse("tiny_cpu.toml", "--job.dump_folder", "s3://bucket/run")
    with pytest.raises(ValueError, match=r"^\[checkpoint\] folder = 'nosuch://bucket/run': no filesystem for nosuch"):
        _parse("tiny_cpu.toml", "--checkpoint.folder", "nosuch://bucket/run")
    for key in ("--job.dump_folder", "--checkpoint.folder"):  # a slash missing: not a local folder named `s3:`
        with pytest.raises(ValueError, match=r"= 's3:/bucket/run': reads as a URL without its `://`"):
            _parse("tiny_cpu.toml", key, "s3:/bucket/run")
    assert not list(tmp_path.iterdir())
    assert _parse("tiny_cpu.toml", "--checkpoint.folder", "s3://bucket/run").checkpoint.folder == "s3://bucket/run"


def test_a_validation_loader_setting_that_would_change_nothing_is_refused():
    with pytest.raises(ValueError, match=r"^\[validation.dataloader\] num_workers = 2: validation reads its windows"):
        _parse("tiny_cpu.toml", "--validation.dataloader.num_workers", "2")
