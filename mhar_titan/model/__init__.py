"""The model: arguments and flavors, config.json <-> arguments, the MHAR Llama, the state-dict adapter,
and its parallelisation (torchtitan's models/llama3/{model,infra,state_dict_adapter} laid out alike)."""
