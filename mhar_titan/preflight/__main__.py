"""python -m mhar_titan.preflight CONTROL.toml MHAR.toml [options] [--section.key value ...]"""

from mhar_titan.third_party import quiet_imports

quiet_imports()  # before the stages' modules import transformers (and torchao with it)

from mhar_titan.preflight.cli import main  # noqa: E402  (after the import-time messages are quieted)

if __name__ == "__main__":
    main()
