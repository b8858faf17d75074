"""mhar-titan: torchtitan extension for 8B mid-training with delta-MHAR.

Importing the package (or any module of it but `mhar_titan.register`) has no side effects. train_cpt.py
registers the train spec (`[model] name = "llama3_mhar"`) itself; stock torchtitan can run it with
`--experimental.custom_import=mhar_titan.register`.
"""
