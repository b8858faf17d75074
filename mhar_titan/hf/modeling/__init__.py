"""The MHAR arm's HF configuration and modeling files, copied verbatim into every MHAR export.

They import only torch and transformers (never mhar_titan), so that an export folder loads with
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` anywhere.
"""
