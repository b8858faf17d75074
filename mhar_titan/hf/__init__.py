"""Hugging Face checkpoints in and out: Llama-3.x safetensors, graft-aware.

Reading (load.py, ledger.py): config.json becomes model arguments (or a refusal naming the field,
mhar_titan/model/hf_config.py), and every checkpoint tensor is accounted for in a load ledger: loaded, newly initialised
(the MHAR routing parameters), unused. A missing base tensor, a shape or dtype mismatch or an unused
tensor fails the load with the ledger.

Writing (export.py, run.py): sharded safetensors with an index, config.json and the base's tokenizer
files. The control writes a plain `LlamaForCausalLM`; the MHAR arm adds its routing tensors
(`model.layers.N.mhar.{attn,ffn}.*`) and exports as its own architecture (`mhar_llama`: an `mhar`
block, `auto_map` and the modeling files of modeling/, loaded with trust_remote_code), which a plain
Llama loader refuses; it may leave the routing out only while every gate is 0. A run's checkpoint is
exported streamed, one output shard at a time (run.py).

The command line is __main__.py: python -m mhar_titan.hf {inspect,export,init} --help
"""
